// The CPU reference backend of Model (model.h has the API and contracts).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/model.h"

namespace hmoe::cpu {

// Options are validated by the caller (Model::Create); `experts` null: build
// the in-process reference from `ckpt`.
absl::StatusOr<std::unique_ptr<Model>> CreateCpuModel(const ModelConfig& config,
                                                      const Checkpoint& ckpt,
                                                      const ModelOptions& options,
                                                      RoutedExperts* experts);

}  // namespace hmoe::cpu
