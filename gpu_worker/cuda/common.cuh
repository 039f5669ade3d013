// Device helpers shared by the kernel families' .cu files (bf16 conversion,
// warp and block reductions, launch sizes). Included by .cu files only; the
// anonymous namespace gives each .cu its own internal copy.
#pragma once

#include <algorithm>
#include <cstdint>

namespace hmoe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float Bf16ToF(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ uint16_t FToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Sum over the block; `sh` holds 33 floats. Every thread gets the total.
__device__ float BlockSum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpSum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    float w = lane < nw ? sh[lane] : 0.0f;
    w = WarpSum(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  const float total = sh[32];
  __syncthreads();
  return total;
}

__host__ __device__ constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ constexpr int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Blocks for a grid-stride loop over n items.
unsigned GridFor(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::min<int64_t>(CeilDiv(n, threads), int64_t{1} << 20));
}

// Blocks for a loop with one block per item (x dimension).
unsigned BlocksFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(n, int64_t{1} << 30));
}

__device__ __forceinline__ void RopePair(float* x, int64_t j, int64_t dim, const float* cs,
                                         bool interleaved) {
  const int64_t half = dim / 2;
  const int64_t ia = interleaved ? 2 * j : j;
  const int64_t ib = interleaved ? 2 * j + 1 : j + half;
  const float c = cs[2 * j], s = cs[2 * j + 1];
  const float x1 = x[ia], x2 = x[ib];
  x[ia] = x1 * c - x2 * s;
  x[ib] = x2 * c + x1 * s;
}

}  // namespace
}  // namespace hmoe::cuda
