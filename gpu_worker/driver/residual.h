// Residual schemes: how a layer's sublayers (attention, then the
// feed-forward) read and join the hidden state a pass carries per token.
// One row per ResidualKind (ModelConfig::residual) in the residual table
// (residual.cc); each backend runs the scheme through its own
// implementation of it (cpu: cpu/residual.h's table; cuda: plain only,
// others UNIMPLEMENTED at load). A new scheme is one file per backend plus
// its rows.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace hmoe {

// A layer's sublayers, in the order they run.
enum class Sublayer { kAttention, kFeedForward };

struct ResidualSpec {
  ResidualKind kind = ResidualKind::kPlain;
  // Hidden-state copies a pass carries per token ([T, streams, H]); plain: 1.
  int64_t streams = 1;
};
// The scheme of `config` (its ResidualKind's row); UNIMPLEMENTED naming the
// kind when it has none.
absl::StatusOr<ResidualSpec> ResidualSpecFor(const ModelConfig& config);

}  // namespace hmoe
