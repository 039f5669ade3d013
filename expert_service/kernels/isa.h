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

// The ISA to use: min(detected, `requested`). `requested` above what the
// CPU supports falls back to the best available unless `strict`, in which
// case it is FAILED_PRECONDITION. Reads no environment: the binaries turn
// HMOE_ISA / --isa into `requested` (RunOptions::isa) at start-up.
absl::StatusOr<Isa> ResolveIsa(std::optional<Isa> requested, bool strict = false);

// An ISA cap as an operator gives it (HMOE_ISA's value; `source` names it in
// the error): empty is none, else ParseIsa's names; INVALID_ARGUMENT
// "HMOE_ISA='sse9' is not one of amx|avx512|avx2|scalar" otherwise.
absl::StatusOr<std::optional<Isa>> ParseIsaCap(std::string_view value, std::string_view source);

// The tighter of two caps (nullopt: no cap).
std::optional<Isa> MinIsa(std::optional<Isa> a, std::optional<Isa> b);

}  // namespace hmoe
