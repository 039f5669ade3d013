// CUDA kernels behind gpu_worker/cuda/elementwise_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cmath>
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/elementwise_kernels.h"

namespace hmoe::cuda {
namespace {

__global__ void EmbedRowsKernel(const uint16_t* table, int64_t cols, const int32_t* ids, int64_t T,
                                float* out) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const uint16_t* src = table + static_cast<int64_t>(ids[t]) * cols;
    float* dst = out + t * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = Bf16ToF(src[c]);
  }
}

__global__ void AddRmsNormKernel(float* x, const float* add, int64_t rows, int64_t n,
                                 const float* w, float eps, float* h, uint16_t* h_bf16) {
  __shared__ float sh[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* xr = x + r * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      float v = xr[i];
      if (add != nullptr) {
        v += add[r * n + i];
        xr[i] = v;
      }
      ss += v * v;
    }
    ss = BlockSum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float y = w[i] * (xr[i] * inv);
      if (h != nullptr) h[r * n + i] = y;
      if (h_bf16 != nullptr) h_bf16[r * n + i] = FToBf16(y);
    }
  }
}

__global__ void ApplyRopeKernel(float* x, int64_t T, int64_t heads, int64_t tok_stride,
                                int64_t head_stride, int64_t offset, int64_t dim, const float* cs,
                                bool interleaved) {
  const int64_t half = dim / 2, total = T * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = idx % half, th = idx / half;
    const int64_t i = th % heads, t = th / heads;
    RopePair(x + t * tok_stride + i * head_stride + offset, j, dim, cs + t * dim, interleaved);
  }
}

__global__ void SiluMulKernel(const float* gu, int64_t T, int64_t I, uint16_t* out) {
  const int64_t total = T * I;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / I, i = idx % I;
    const float g = gu[t * 2 * I + i], u = gu[t * 2 * I + I + i];
    out[idx] = FToBf16(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void ToBf16Kernel(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = FToBf16(x[i]);
}

__global__ void Bf16ToF32Kernel(const uint16_t* x, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = Bf16ToF(x[i]);
}

__global__ void AddBiasKernel(float* y, int64_t T, int64_t N, const float* b) {
  const int64_t total = T * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += b[i % N];
}

__global__ void AccumulateKernel(float* x, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = x[i] + a[i];
    if (b != nullptr) v += b[i];
    x[i] = v;
  }
}

__global__ void GatherRowsKernel(const float* x, int64_t cols, const int32_t* rows, int64_t n,
                                 float* out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const float* src = x + static_cast<int64_t>(rows[i]) * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[i * cols + c] = src[c];
  }
}

}  // namespace

cudaError_t EmbedRows(const uint16_t* table, int64_t cols, const int32_t* ids, int64_t T,
                      float* out, cudaStream_t s) {
  if (T <= 0 || cols <= 0) return cudaSuccess;
  EmbedRowsKernel<<<BlocksFor(T), kThreads, 0, s>>>(table, cols, ids, T, out);
  return cudaGetLastError();
}

cudaError_t AddRmsNorm(float* x, const float* add, int64_t rows, int64_t n, const float* w,
                       float eps, float* h, uint16_t* h_bf16, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  const int threads = n >= 4096 ? 1024 : n >= 1024 ? 512 : 256;
  AddRmsNormKernel<<<BlocksFor(rows), threads, 0, s>>>(x, add, rows, n, w, eps, h, h_bf16);
  return cudaGetLastError();
}

cudaError_t ApplyRope(float* x, int64_t T, int64_t heads, int64_t tok_stride, int64_t head_stride,
                      int64_t offset, int64_t dim, const float* cs, bool interleaved,
                      cudaStream_t s) {
  const int64_t total = T * heads * (dim / 2);
  if (T <= 0 || heads <= 0 || total <= 0) return cudaSuccess;
  ApplyRopeKernel<<<GridFor(total), kThreads, 0, s>>>(x, T, heads, tok_stride, head_stride, offset,
                                                      dim, cs, interleaved);
  return cudaGetLastError();
}

cudaError_t SiluMul(const float* gu, int64_t T, int64_t I, uint16_t* out_bf16, cudaStream_t s) {
  if (T <= 0 || I <= 0) return cudaSuccess;
  SiluMulKernel<<<GridFor(T * I), kThreads, 0, s>>>(gu, T, I, out_bf16);
  return cudaGetLastError();
}

cudaError_t ToBf16(const float* x, int64_t n, uint16_t* out, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  ToBf16Kernel<<<GridFor(n), kThreads, 0, s>>>(x, n, out);
  return cudaGetLastError();
}

cudaError_t Bf16ToF32(const uint16_t* x, int64_t n, float* out, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  Bf16ToF32Kernel<<<GridFor(n), kThreads, 0, s>>>(x, n, out);
  return cudaGetLastError();
}

cudaError_t AddBias(float* y, int64_t T, int64_t N, const float* b, cudaStream_t s) {
  if (T <= 0 || N <= 0) return cudaSuccess;
  AddBiasKernel<<<GridFor(T * N), kThreads, 0, s>>>(y, T, N, b);
  return cudaGetLastError();
}

cudaError_t Accumulate(float* x, const float* a, const float* b, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  AccumulateKernel<<<GridFor(n), kThreads, 0, s>>>(x, a, b, n);
  return cudaGetLastError();
}

cudaError_t GatherRows(const float* x, int64_t cols, const int32_t* rows, int64_t n, float* out,
                       cudaStream_t s) {
  if (n <= 0 || cols <= 0) return cudaSuccess;
  GatherRowsKernel<<<BlocksFor(n), kThreads, 0, s>>>(x, cols, rows, n, out);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
