#include "expert_service/kernels/tuning.h"

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hmoe {
namespace {

// What values a knob takes.
enum class Kind {
  kBool,     // 0 or 1
  kRange,    // lo..hi
  kEven,     // even, lo..hi
  kKcBytes,  // 0 or a power of two, 256..hi
};

// One knob: its variable, where it lives and what values it takes.
struct Knob {
  const char* name;
  Kind kind;
  int64_t lo, hi;  // inclusive
  int64_t (*get)(const KernelTuning&);
  void (*set)(KernelTuning&, int64_t);
};

#define HMOE_KNOB(NAME, FIELD, KIND, LO, HI)                                            \
  Knob {                                                                                \
    NAME, KIND, LO, HI, [](const KernelTuning& t) { return int64_t(t.FIELD); },         \
        [](KernelTuning& t, int64_t v) { t.FIELD = static_cast<decltype(t.FIELD)>(v); } \
  }
#define HMOE_BOOL_KNOB(NAME, FIELD) HMOE_KNOB(NAME, FIELD, Kind::kBool, 0, 1)

const Knob kKnobs[] = {
    HMOE_KNOB("HMOE_AMX_KC_BYTES", amx.kc_bytes, Kind::kKcBytes, 0, 4096),
    HMOE_BOOL_KNOB("HMOE_AMX_PREFETCH", amx.prefetch),
    HMOE_BOOL_KNOB("HMOE_AMX_ORDER", amx.order),
    HMOE_KNOB("HMOE_AMX_ORDER0_ROWS", amx.order0_rows, Kind::kRange, 0, 512),
    HMOE_BOOL_KNOB("HMOE_AMX_STREAM", amx.stream),
    HMOE_BOOL_KNOB("HMOE_AMX_TAIL16", amx.tail16),
    HMOE_BOOL_KNOB("HMOE_AMX_I4_STAGE", amx.i4_stage),
    HMOE_KNOB("HMOE_FEW_PF_I4", few.pf_i4, Kind::kRange, 0, 65536),
    HMOE_KNOB("HMOE_FEW_PF_I8", few.pf_i8, Kind::kRange, 0, 65536),
    HMOE_KNOB("HMOE_FEW_PF_BF16", few.pf_bf16, Kind::kRange, 0, 65536),
    HMOE_KNOB("HMOE_MOE_TASK_PANELS", moe.task_panels, Kind::kEven, 2, MoeTuning::kMaxTaskPanels),
    HMOE_BOOL_KNOB("HMOE_MOE_LOOKAHEAD", moe.lookahead),
    HMOE_BOOL_KNOB("HMOE_MOE_GATHER_STREAM", moe.gather_stream),
    HMOE_BOOL_KNOB("HMOE_PROFILE", moe.profile),
};
#undef HMOE_BOOL_KNOB
#undef HMOE_KNOB

// The values k takes, in words.
std::string Allowed(const Knob& k) {
  switch (k.kind) {
    case Kind::kBool:
      return "0 or 1";
    case Kind::kRange:
      return absl::StrCat("an integer from ", k.lo, " to ", k.hi);
    case Kind::kEven:
      return absl::StrCat("an even number from ", k.lo, " to ", k.hi);
    case Kind::kKcBytes:
      return absl::StrCat("0 (per format) or a power of two from 256 to ", k.hi);
  }
  return "";
}

bool Allows(const Knob& k, int64_t v) {
  if (k.kind == Kind::kKcBytes) return v == 0 || (v >= 256 && v <= k.hi && (v & (v - 1)) == 0);
  if (v < k.lo || v > k.hi) return false;
  return k.kind != Kind::kEven || v % 2 == 0;
}

}  // namespace

absl::Status ValidateKernelTuning(const KernelTuning& t) {
  for (const Knob& k : kKnobs) {
    if (const int64_t v = k.get(t); !Allows(k, v))
      return absl::InvalidArgumentError(
          absl::StrCat("kernel tuning: ", k.name, " is ", v, "; want ", Allowed(k)));
  }
  return absl::OkStatus();
}

absl::StatusOr<KernelTuning> KernelTuningFromEnv(
    const std::function<const char*(const char*)>& getenv) {
  KernelTuning t;
  for (const Knob& k : kKnobs) {
    const char* s = getenv(k.name);
    if (s == nullptr) continue;
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno != 0 || !Allows(k, v))
      return absl::InvalidArgumentError(
          absl::StrCat("environment: ", k.name, "=\"", s, "\"; want ", Allowed(k)));
    k.set(t, v);
  }
  return t;
}

absl::StatusOr<KernelTuning> KernelTuningFromEnv() {
  return KernelTuningFromEnv([](const char* name) { return std::getenv(name); });
}

std::string KernelTuningToString(const KernelTuning& t) {
  const KernelTuning d;
  std::vector<std::string> parts;
  for (const Knob& k : kKnobs)
    if (k.get(t) != k.get(d)) parts.push_back(absl::StrCat(k.name, "=", k.get(t)));
  return absl::StrJoin(parts, " ");
}

const std::vector<std::string>& KernelTuningVariables() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> n;
    for (const Knob& k : kKnobs) n.emplace_back(k.name);
    return n;
  }();
  return kNames;
}

}  // namespace hmoe
