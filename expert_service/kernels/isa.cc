#include "expert_service/kernels/isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

uint64_t Xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

Isa Detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::kScalar;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return Isa::kScalar;
  const uint64_t xcr0 = Xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return Isa::kScalar;  // XMM + YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::kScalar;
  const unsigned b7 = b, c7 = c, d7 = d;
  const bool avx2 = b7 & (1u << 5);
  if (!(avx2 && fma && f16c)) return Isa::kScalar;
  const bool zmm_state = (xcr0 & 0xe0) == 0xe0;
  const bool avx512 = zmm_state && (b7 & (1u << 16)) /*F*/ && (b7 & (1u << 17)) /*DQ*/ &&
                      (b7 & (1u << 30)) /*BW*/ && (b7 & (1u << 31)) /*VL*/ &&
                      (c7 & (1u << 11)) /*VNNI*/;
  unsigned a71 = 0, b71, c71, d71;
  __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  const bool bf16 = a71 & (1u << 5);
  if (!(avx512 && bf16)) return Isa::kAvx2;
  const bool amx = (d7 & (1u << 22)) /*AMX-BF16*/ && (d7 & (1u << 24)) /*AMX-TILE*/ &&
                   (d7 & (1u << 25)) /*AMX-INT8*/;
  if (!amx) return Isa::kAvx512;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return Isa::kAvx512;
  return Isa::kAmx;
}

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
  }
  return "?";
}

std::optional<Isa> ParseIsa(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (s == "scalar") return Isa::kScalar;
  if (s == "avx2") return Isa::kAvx2;
  if (s == "avx512") return Isa::kAvx512;
  if (s == "amx") return Isa::kAmx;
  return std::nullopt;
}

Isa DetectedIsa() {
  static const Isa isa = Detect();
  return isa;
}

absl::StatusOr<Isa> ResolveIsa(std::optional<Isa> requested, bool strict) {
  Isa isa = DetectedIsa();
  if (requested) {
    if (*requested > DetectedIsa() && strict)
      return absl::FailedPreconditionError(absl::StrCat("ISA ", std::string(IsaName(*requested)),
                                                        " requested but this CPU supports only ",
                                                        std::string(IsaName(DetectedIsa()))));
    isa = std::min(isa, *requested);
  }
  return isa;
}

absl::StatusOr<std::optional<Isa>> ParseIsaCap(std::string_view value, std::string_view source) {
  if (value.empty()) return std::optional<Isa>();
  std::optional<Isa> cap = ParseIsa(value);
  if (!cap)
    return absl::InvalidArgumentError(absl::StrCat(std::string(source), "='", std::string(value),
                                                   "' is not one of amx|avx512|avx2|scalar"));
  return cap;
}

std::optional<Isa> MinIsa(std::optional<Isa> a, std::optional<Isa> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

}  // namespace hmoe
