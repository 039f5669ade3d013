// CUDA kernels behind gpu_worker/cuda/streamed_expert_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/native_decode.cuh"
#include "gpu_worker/cuda/streamed_expert_kernels.h"

namespace hmoe::cuda {
namespace {

// ---- streamed experts (hybrid prefill) --------------------------------------------

// out[r][c] = bf16(W[r][c]) dequantized: bf16 as is, int8 q * scale[r],
// int4 q * scale[r][c / group] (rounded to bf16 once).
__global__ void DequantToBf16Kernel(DevQuantMatrix W, uint16_t* out) {
  const int64_t n = W.rows * W.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / W.cols, c = i % W.cols;
    if (IsNativeDev(W.format)) {
      out[i] = FToBf16(NativeWeightDev(W, r, c));
    } else if (W.format == WeightFormat::kBf16) {
      out[i] = static_cast<const uint16_t*>(W.w)[i];
    } else if (W.format == WeightFormat::kInt8) {
      out[i] = FToBf16(static_cast<float>(static_cast<const int8_t*>(W.w)[i]) * W.scale[r]);
    } else {
      const int b = static_cast<const uint8_t*>(W.w)[r * ((W.cols + 1) / 2) + c / 2];
      const int v = (c % 2 == 0) ? (b & 0xF) : (b >> 4);
      const int64_t ng = (W.cols + W.group - 1) / W.group;
      out[i] = FToBf16(static_cast<float>(v >= 8 ? v - 16 : v) * W.scale[r * ng + c / W.group]);
    }
  }
}

__global__ void GatherBf16RowsKernel(const uint16_t* x, int64_t cols, const int32_t* rows,
                                     int64_t n, uint16_t* out) {
  const bool vec = cols % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint16_t* src = x + static_cast<int64_t>(rows[i]) * cols;
    uint16_t* dst = out + i * cols;
    if (vec) {
      for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x)
        reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = src[c];
    }
  }
}

__global__ void ScatterWeightedRowsKernel(const float* z, int64_t cols, const int32_t* slots,
                                          int64_t n, const float* w, float* ys) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = slots[i];
    const float ws = w[s];
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      ys[s * cols + c] = ws * z[i * cols + c];
  }
}

__global__ void SumMarkedSlotsKernel(const float* ys, const uint8_t* marked, int64_t T, int64_t K,
                                     int64_t H, float* out) {
  const int64_t n = T * H;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, c = i % H;
    float o = 0.0f;
    for (int64_t j = 0; j < K; ++j)
      if (marked[t * K + j]) o += ys[(t * K + j) * H + c];
    out[i] = o;
  }
}

}  // namespace

cudaError_t DequantToBf16(const DevQuantMatrix& w, uint16_t* out, cudaStream_t s) {
  if (w.rows == 0 || w.cols == 0) return cudaSuccess;
  if (w.w == nullptr || out == nullptr || w.rows < 0 || w.cols < 0 || !IsWeightFormat(w.format) ||
      (HasScales(w.format) && w.scale == nullptr) || (IsGrouped(w.format) && w.group <= 0))
    return cudaErrorInvalidValue;
  DequantToBf16Kernel<<<GridFor(w.rows * w.cols), kThreads, 0, s>>>(w, out);
  return cudaGetLastError();
}

cudaError_t GatherBf16Rows(const uint16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           uint16_t* out, cudaStream_t s) {
  if (n == 0 || cols == 0) return cudaSuccess;
  if (x == nullptr || rows == nullptr || out == nullptr || n < 0 || cols < 0)
    return cudaErrorInvalidValue;
  GatherBf16RowsKernel<<<static_cast<unsigned>(std::min<int64_t>(n, 65535)), kThreads, 0, s>>>(
      x, cols, rows, n, out);
  return cudaGetLastError();
}

cudaError_t ScatterWeightedRows(const float* z, int64_t cols, const int32_t* slots, int64_t n,
                                const float* w, float* ys, cudaStream_t s) {
  if (n == 0 || cols == 0) return cudaSuccess;
  if (z == nullptr || slots == nullptr || w == nullptr || ys == nullptr || n < 0 || cols < 0)
    return cudaErrorInvalidValue;
  ScatterWeightedRowsKernel<<<static_cast<unsigned>(std::min<int64_t>(n, 65535)), kThreads, 0, s>>>(
      z, cols, slots, n, w, ys);
  return cudaGetLastError();
}

cudaError_t SumMarkedSlots(const float* ys, const uint8_t* marked, int64_t T, int64_t K, int64_t H,
                           float* out, cudaStream_t s) {
  if (T == 0 || H == 0) return cudaSuccess;
  if (ys == nullptr || marked == nullptr || out == nullptr || T < 0 || K <= 0 || H < 0)
    return cudaErrorInvalidValue;
  SumMarkedSlotsKernel<<<GridFor(T * H), kThreads, 0, s>>>(ys, marked, T, K, H, out);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
