// The reference backend's residual schemes (gpu_worker/driver/residual.h):
// the hidden state a pass carries, which the layers' sublayers read and
// join. One implementation per ResidualKind in the table of residual.cc.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/driver/residual.h"

namespace hmoe::cpu {

class Residual {
 public:
  virtual ~Residual() = default;
  // Starts a pass from its tokens' embeddings x [T, H].
  virtual void Begin(const float* x, int64_t T) = 0;
  // What sublayer `s` of layer `layer` reads before its norm, [T, H].
  virtual const float* Input(int layer, Sublayer s) = 0;
  // Joins sublayer `s` of layer `layer`'s output y [T, H] (a deferred
  // expert call's sum joins as the feed-forward of the layer it is joined
  // at).
  virtual void Join(int layer, Sublayer s, const float* y) = 0;
  // What the final norm reads, [T, H].
  virtual const float* Output() = 0;
};

// The implementation of `spec.kind` for hidden size H; UNIMPLEMENTED naming
// the kind when there is none.
absl::StatusOr<std::unique_ptr<Residual>> MakeResidual(const ResidualSpec& spec, int64_t H);

}  // namespace hmoe::cpu
