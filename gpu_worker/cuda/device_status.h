// Whether a CUDA device is usable here, and a sticky-error injector for
// fault tests. Launcher conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include <string>

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// Whether a CUDA device exists and a context can be made on the current one;
// otherwise false with the reason in *why (why may be null).
bool CudaDeviceUsable(std::string* why);

// Launches a kernel that traps: the context's sticky error (a fault test's
// stand-in for a real device failure).
cudaError_t InjectStickyError(cudaStream_t s);

}  // namespace hmoe::cuda
