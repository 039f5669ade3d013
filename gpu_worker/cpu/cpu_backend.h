// The CPU reference backend (driver/backend.h): the exact forward pass in
// fp32 math over the checkpoint's weights (bf16 read in place, fp8
// dequantized at load), the numerics ground truth for every faster backend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/runtime/thread_pool.h"
#include "gpu_worker/driver/backend.h"

namespace hmoe::cpu {

// Options are validated and resolved by the caller (Model::Create); the
// checkpoint's tensors have passed CheckWeights. `pool` runs the parallel loops.
absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCpuBackend(const ModelConfig& config,
                                                               const Checkpoint& ckpt,
                                                               const ModelOptions& options,
                                                               std::shared_ptr<ThreadPool> pool);

}  // namespace hmoe::cpu
