// The CUDA backend (driver/backend.h): every non-expert weight on the GPU in
// bf16 (fp8 checkpoints dequantized at load), a paged KV cache in device
// memory (blocks of 16 tokens from one pool), cuBLAS for the projections and
// our kernels (*_kernels.h) for the rest. The routed experts' inputs go to the
// host in pinned buffers and their sums come back to join the residual while
// the shared experts run on the GPU. This header includes no CUDA.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu_worker/driver/backend.h"

namespace hmoe::cuda {

// Whether `device` exists and a context can be made on it; `why` says why not.
bool CudaBackendUsable(int device, std::string* why);

// `device`'s memory in use by every process (total - free) and its total, as
// cudaMemGetInfo reports them; false with `why` when it cannot be queried.
bool DeviceMemoryInfo(int device, int64_t* used, int64_t* total, std::string* why);

// Options are validated and resolved by the caller (Model::Create); the
// checkpoint has passed CheckWeights. RESOURCE_EXHAUSTED (naming the sizes)
// when weights + workspaces + the KV pool exceed options.cuda.gpu_mem_gb or the
// device's free memory; FAILED_PRECONDITION when the device is unusable.
absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCudaBackend(const ModelConfig& config,
                                                                const Checkpoint& ckpt,
                                                                const ModelOptions& options);

}  // namespace hmoe::cuda
