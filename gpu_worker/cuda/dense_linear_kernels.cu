#include <cuda_fp16.h>

#include <cstring>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/dense_linear_kernels.h"
#include "gpu_worker/cuda/native_decode.cuh"

namespace hmoe::cuda {
namespace {

constexpr int kDenseGroup = 128;
constexpr int kMaxWarps = kThreads / 32;

// The weight (r, c) of a dense matrix: f32(value * scale), as QuantMatrix::At.
__device__ __forceinline__ float DenseWeightDev(const DevQuantMatrix& W, int64_t r, int64_t c) {
  if (W.format == WeightFormat::kInt8) {
    const int8_t q = static_cast<const int8_t*>(W.w)[r * W.cols + c];
    return static_cast<float>(q) * W.scale[r];
  }
  return NativeWeightDev(W, r, c);  // kFp8, kInt4: as the native formats lay them out
}

// 8 * N / 8 bf16 at `p` (16-byte aligned) as f32.
template <int N>
__device__ __forceinline__ void LoadX(const uint16_t* p, float* v) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    const uint4 u = __ldg(q + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[i * 8 + 2 * j] = __uint_as_float(w[j] << 16);
      v[i * 8 + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
}

// A 16-byte weight load that bypasses L1 (each weight is read once; L1
// keeps the activations, which every row of the block reads again).
__device__ __forceinline__ uint4 LoadWeights(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Two e4m3 codes (bytes 0 and 2 of `w`, the rest 0) as f32 values / 256:
// the code's bits placed in an f16 (bias 15 instead of 7), exact.
__device__ __forceinline__ float2 E4M3PairOver256(uint32_t w) {
  const uint32_t h = ((w & 0x007f007fu) << 7) | ((w & 0x00800080u) << 8);
  __half2 v;
  memcpy(&v, &h, sizeof(h));
  return __half22float2(v);
}

// One 16-byte chunk's weights as f32: kFp8 16 values / 256, kInt8 16 ints,
// kInt4 32 ints (unscaled).
template <WeightFormat F>
__device__ __forceinline__ void Decode(const uint4& u, float* v) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (F == WeightFormat::kFp8) {
      const float2 a = E4M3PairOver256(__byte_perm(w[j], 0, 0x4140));
      const float2 b = E4M3PairOver256(__byte_perm(w[j], 0, 0x4342));
      v[4 * j] = a.x;
      v[4 * j + 1] = a.y;
      v[4 * j + 2] = b.x;
      v[4 * j + 3] = b.y;
    } else if constexpr (F == WeightFormat::kInt8) {
      // 2^23 + (q + 128) built in the float's bits, then the offset taken off.
      const uint32_t o = w[j] ^ 0x80808080u;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        v[4 * j + k] = __uint_as_float(__byte_perm(o, 0x4B000000u, 0x7440 + k)) - 8388736.0f;
    } else {
      const uint32_t o = w[j] ^ 0x88888888u;
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[8 * j + k] = __uint_as_float(0x4B000000u | ((o >> (4 * k)) & 15u)) - 8388616.0f;
    }
  }
}

// The sums acc[t] of the lanes of a row group (G lanes, G / 32 warps, 32 <= G
// <= kThreads) to y[t * ldy + r] times `mul`.
template <int TB>
__device__ __forceinline__ void StoreRow(float (&acc)[TB], int T, int G, bool live, int64_t r,
                                         int64_t ldy, float mul, float* y) {
  __shared__ float sh[kMaxWarps][TB];
#pragma unroll
  for (int t = 0; t < TB; ++t) acc[t] = WarpSum(acc[t]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (G == 32) {
    if (!live) return;
#pragma unroll
    for (int t = 0; t < TB; ++t)
      if (t == lane && t < T) y[t * ldy + r] = acc[t] * mul;
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < TB; ++t) sh[warp][t] = acc[t];
  }
  __syncthreads();
  const int wpr = G >> 5, first = (threadIdx.x / G) * wpr;
  if (live && warp == first && lane < T) {
    float s = 0.0f;
    for (int i = 0; i < wpr; ++i) s += sh[first + i][lane];
    y[lane * ldy + r] = s * mul;
  }
}

// 16-byte path: rows whose bytes are a multiple of 16, cols % 8 == 0.
template <WeightFormat F, int TB>
__global__ void __launch_bounds__(kThreads)
    GemvVecKernel(DevQuantMatrix W, const uint16_t* __restrict__ x, int T, float* __restrict__ y,
                  int64_t ldy, int G) {
  constexpr int kPer = F == WeightFormat::kInt4 ? 32 : 16;  // weights per chunk
  const int lane = threadIdx.x % G;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / G) + threadIdx.x / G;
  const bool live = r < W.rows;
  const int64_t cols = W.cols;
  const int64_t row_bytes = F == WeightFormat::kInt4 ? cols / 2 : cols;
  const int64_t nch = row_bytes / 16;
  float acc[TB];
#pragma unroll
  for (int t = 0; t < TB; ++t) acc[t] = 0.0f;
  float mul = 1.0f;
  if (live) {
    const uint4* wp =
        reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(W.w) + r * row_bytes);
    const int64_t spr = CeilDiv(cols, kDenseGroup);
    const float* srow = F == WeightFormat::kFp8    ? W.scale + (r / kDenseGroup) * spr
                        : F == WeightFormat::kInt4 ? W.scale + r * spr
                                                   : W.scale + r;
    // One chunk's products into acc.
    auto chunk = [&](const uint4& u, int64_t ch) {
      float wv[kPer];
      Decode<F>(u, wv);
      const int64_t c0 = ch * kPer;
      const float sc = F == WeightFormat::kFp8    ? srow[c0 / kDenseGroup] * 256.0f
                       : F == WeightFormat::kInt4 ? srow[c0 / kDenseGroup]
                                                  : 1.0f;
#pragma unroll
      for (int t = 0; t < TB; ++t) {
        if (t < T) {
          float xv[kPer];
          LoadX<kPer>(x + t * cols + c0, xv);
          float p = 0.0f;
#pragma unroll
          for (int i = 0; i < kPer; ++i) p = fmaf(xv[i], wv[i], p);
          acc[t] = F == WeightFormat::kInt8 ? acc[t] + p : fmaf(p, sc, acc[t]);
        }
      }
    };
    // Two loads in flight per lane, then the odd one.
    int64_t ch = lane;
    for (; ch + G < nch; ch += 2 * G) {
      const uint4 u0 = LoadWeights(wp + ch), u1 = LoadWeights(wp + ch + G);
      chunk(u0, ch);
      chunk(u1, ch + G);
    }
    if (ch < nch) chunk(LoadWeights(wp + ch), ch);
    if (F == WeightFormat::kInt8) mul = srow[0];
  }
  StoreRow<TB>(acc, T, G, live, r, ldy, mul, y);
}

// Any shape: weight by weight.
template <int TB>
__global__ void __launch_bounds__(kThreads)
    GemvScalarKernel(DevQuantMatrix W, const uint16_t* __restrict__ x, int T, float* __restrict__ y,
                     int64_t ldy, int G) {
  const int lane = threadIdx.x % G;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / G) + threadIdx.x / G;
  const bool live = r < W.rows;
  float acc[TB];
#pragma unroll
  for (int t = 0; t < TB; ++t) acc[t] = 0.0f;
  if (live) {
    for (int64_t c = lane; c < W.cols; c += G) {
      const float w = DenseWeightDev(W, r, c);
#pragma unroll
      for (int t = 0; t < TB; ++t)
        if (t < T) acc[t] = fmaf(Bf16ToF(x[t * W.cols + c]), w, acc[t]);
    }
  }
  StoreRow<TB>(acc, T, G, live, r, ldy, 1.0f, y);
}

__global__ void ToBf16Kernel(DevQuantMatrix W, int64_t row0, int64_t n, uint16_t* out) {
  const int64_t total = n * W.cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = FToBf16(DenseWeightDev(W, row0 + i / W.cols, i % W.cols));
}

template <int TB>
cudaError_t LaunchTb(const DevQuantMatrix& W, const uint16_t* x, int T, float* y, int64_t ldy,
                     bool vec, int G, cudaStream_t s) {
  const int64_t blocks = CeilDiv(W.rows, kThreads / G);
  if (!vec) {
    GemvScalarKernel<TB><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(W, x, T, y, ldy, G);
  } else if (W.format == WeightFormat::kFp8) {
    GemvVecKernel<WeightFormat::kFp8, TB>
        <<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(W, x, T, y, ldy, G);
  } else if (W.format == WeightFormat::kInt8) {
    GemvVecKernel<WeightFormat::kInt8, TB>
        <<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(W, x, T, y, ldy, G);
  } else {
    GemvVecKernel<WeightFormat::kInt4, TB>
        <<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(W, x, T, y, ldy, G);
  }
  return cudaGetLastError();
}

}  // namespace

bool DenseLinearTakes(WeightFormat f, int group) {
  return (f == WeightFormat::kFp8 && group == kDenseGroup) || f == WeightFormat::kInt8 ||
         (f == WeightFormat::kInt4 && group == kDenseGroup);
}

cudaError_t DenseGemv(const DevQuantMatrix& W, const uint16_t* x, int64_t T, float* y, int64_t ldy,
                      cudaStream_t s) {
  if (T == 0 || W.rows == 0) return cudaSuccess;
  if (T < 0 || T > kDenseGemvMaxTokens || W.cols <= 0 || !DenseLinearTakes(W.format, W.group) ||
      W.w == nullptr || W.scale == nullptr || ldy < W.rows)
    return cudaErrorInvalidValue;
  const int64_t row_bytes = W.format == WeightFormat::kInt4 ? (W.cols + 1) / 2 : W.cols;
  const bool vec = row_bytes % 16 == 0 && W.cols % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(W.w) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0;
  // Lanes per row: about two 16-byte chunks each, 32 to a block's worth.
  const int64_t chunks = vec ? row_bytes / 16 : CeilDiv(W.cols, 16);
  int G = 32;
  while (G < kThreads && G < CeilDiv(chunks, 2)) G *= 2;
  const int t = static_cast<int>(T);
  if (T <= 1) return LaunchTb<1>(W, x, t, y, ldy, vec, G, s);
  if (T <= 2) return LaunchTb<2>(W, x, t, y, ldy, vec, G, s);
  if (T <= 4) return LaunchTb<4>(W, x, t, y, ldy, vec, G, s);
  if (T <= 8) return LaunchTb<8>(W, x, t, y, ldy, vec, G, s);
  if (T <= 16) return LaunchTb<16>(W, x, t, y, ldy, vec, G, s);
  return LaunchTb<32>(W, x, t, y, ldy, vec, G, s);
}

cudaError_t DenseToBf16(const DevQuantMatrix& W, int64_t row0, int64_t n, uint16_t* out,
                        cudaStream_t s) {
  if (n == 0 || W.cols == 0) return cudaSuccess;
  if (n < 0 || row0 < 0 || row0 + n > W.rows || !DenseLinearTakes(W.format, W.group) ||
      W.w == nullptr || W.scale == nullptr)
    return cudaErrorInvalidValue;
  const int64_t blocks = Min64(CeilDiv(n * W.cols, kThreads), 65536);
  ToBf16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(W, row0, n, out);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
