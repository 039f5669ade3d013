// CUDA kernels behind gpu_worker/cuda/device_status.h. Layout notes live with each
// kernel; contracts live in the header.
#include <string>

#include "gpu_worker/cuda/device_status.h"

namespace hmoe::cuda {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

bool CudaDeviceUsable(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n <= 0) {
    if (why != nullptr) *why = "no CUDA device";
    return false;
  }
  if (e == cudaSuccess) e = cudaFree(nullptr);  // makes the context
  if (e != cudaSuccess) {
    if (why != nullptr) *why = std::string("CUDA unusable: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  return true;
}

cudaError_t InjectStickyError(cudaStream_t s) {
  TrapKernel<<<1, 1, 0, s>>>();
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
