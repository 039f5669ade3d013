// Routing calibration: run a prompts file through a model and
// keep its routing counts, which PlanPlacement turns into hot experts
// (hmoe-gpu-worker --calibrate).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/routing_stats.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/model.h"

namespace hmoe {

struct CalibrationResult {
  RoutingTable routing;   // the model's counts after the prompts
  int64_t prompts = 0;    // prompts run
  int64_t tokens = 0;     // tokens prefilled
  int64_t truncated = 0;  // prompts cut to the model's max_seq_len
  double seconds = 0;
};

// Reads `path` (UTF-8 text, one prompt per line; empty lines skipped),
// encodes each with `tok` (the post-processor's special tokens added, as a
// client's text prompt is), cuts it to `model`'s max_seq_len and prefills
// it in a fresh Sequence. The counts include whatever `model` ran before.
// NOT_FOUND for a missing file, INVALID_ARGUMENT (naming the line) for
// invalid UTF-8 or a file with no prompt; Forward's errors are passed on
// with the line number.
absl::StatusOr<CalibrationResult> CalibrateRouting(const Model& model, const Tokenizer& tok,
                                                   const std::string& path);

}  // namespace hmoe
