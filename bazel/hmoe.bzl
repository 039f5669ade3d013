"""Our targets' common settings, as CMake's hmoe_target_options gives them.

Every library and program of ours is linked statically (one object per
source, no per-library shared object) and compiled with warnings as errors.
"""

HMOE_COPTS = ["-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers"]

# The per-ISA kernel files' flags (expert_service/CMakeLists.txt): -O2 in
# every mode so header inlines are inlined, never shared across the link.
HMOE_AVX2_COPTS = ["-O2", "-mavx2", "-mfma", "-mf16c", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]
HMOE_AVX512_COPTS = HMOE_AVX2_COPTS + [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512dq",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
]
HMOE_AMX_COPTS = HMOE_AVX512_COPTS + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]

def _ours(rule, name, copts, kwargs):
    rule(name = name, copts = HMOE_COPTS + copts, linkstatic = True, **kwargs)

def hmoe_cc_library(name, copts = [], **kwargs):
    _ours(native.cc_library, name, copts, kwargs)

def hmoe_cc_binary(name, copts = [], **kwargs):
    _ours(native.cc_binary, name, copts, kwargs)

def hmoe_cc_test(name, copts = [], **kwargs):
    _ours(native.cc_test, name, copts, kwargs)
