// Runtime ISA detection and capping. ISA-specific code lives in
// kernels_{avx2,avx512,amx}.cc, compiled with per-file flags, and is only
// entered after the checks here succeed: one binary never SIGILLs.
#pragma once

#include <optional>
#include <string_view>

#include "absl/status/statusor.h"

namespace hmoe {

// Ordered: each level implies the ones below it.
//   kAvx2:   AVX2 + FMA + F16C
//   kAvx512: AVX-512 F/BW/DQ/VL + BF16 + VNNI
//   kAmx:    kAvx512 + AMX-TILE/BF16/INT8, with XTILEDATA permission granted by the OS
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

std::string_view IsaName(Isa isa);
// "scalar" | "avx2" | "avx512" | "amx" (case-insensitive); nullopt otherwise.
std::optional<Isa> ParseIsa(std::string_view name);

// The best ISA this CPU and OS support (cpuid, xgetbv, and for AMX
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). Computed once.
Isa DetectedIsa();

// The ISA to use: min(detected, HMOE_ISA env cap, `requested`).
// `requested` above what the CPU supports falls back to the best available
// unless `strict`, in which case it is FAILED_PRECONDITION. A malformed
// HMOE_ISA is INVALID_ARGUMENT.
absl::StatusOr<Isa> ResolveIsa(std::optional<Isa> requested, bool strict = false);

}  // namespace hmoe
