"""What a workspace that builds us (ours, or one that depends on @hybridmoe)
must define: @hmoe_system, the Debian libraries we link (system_libs.bzl).

    load("@hybridmoe//bazel:deps.bzl", "hybridmoe_dependencies")
    hybridmoe_dependencies()
"""

load(":system_libs.bzl", "system_libs")

def hybridmoe_dependencies():
    system_libs(
        name = "hmoe_system",
        linkopts = {
            # Debian's oneDNN has no .pc file (and its CMake config wants OpenCL).
            "dnnl": ["-ldnnl"],
        },
        pkg_config = {
            "absl": [
                "absl_flat_hash_map",
                "absl_function_ref",
                "absl_span",
                "absl_status",
                "absl_statusor",
                "absl_str_format",
                "absl_strings",
                "absl_synchronization",
                "absl_time",
            ],
            "benchmark": ["benchmark"],
            "gmock": ["gmock"],
            "grpc++": ["grpc++"],
            "gtest": ["gtest"],
            "gtest_main": ["gtest_main"],
            "httplib": ["cpp-httplib"],
            "hwloc": ["hwloc"],
            "nlohmann_json": ["nlohmann_json"],
            "numa": ["numa"],
            "openssl": ["openssl"],
            "pcre2": ["libpcre2-8"],
            "protobuf": ["protobuf"],
            "systemd": ["libsystemd"],
            "ucx": ["ucx"],
        },
    )
