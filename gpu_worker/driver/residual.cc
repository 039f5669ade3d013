#include "gpu_worker/driver/residual.h"

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

// The residual table: one row per ResidualKind.
constexpr ResidualSpec kResiduals[] = {
    {ResidualKind::kPlain, 1},  // x += sublayer(norm(x))
};

}  // namespace

absl::StatusOr<ResidualSpec> ResidualSpecFor(const ModelConfig& config) {
  for (const ResidualSpec& r : kResiduals)
    if (r.kind == config.residual) return r;
  return absl::UnimplementedError(absl::StrCat("residual kind ", static_cast<int>(config.residual),
                                               " (", ResidualKindName(config.residual),
                                               ") has no implementation"));
}

}  // namespace hmoe
