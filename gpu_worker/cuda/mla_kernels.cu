// CUDA kernels behind gpu_worker/cuda/mla_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/kv_store.cuh"
#include "gpu_worker/cuda/mla_kernels.h"

namespace hmoe::cuda {
namespace {

// One block per token: the row is built in shared memory (r + rope floats),
// then stored in the cache's element type.
__global__ void WriteMlaCacheKernel(const float* kva, int64_t T, int64_t r, int64_t rope,
                                    const float* norm_w, float eps, const float* cs,
                                    bool interleaved, const int32_t* slot, KvRows cache) {
  __shared__ float sh[33];
  extern __shared__ float dst[];
  const int64_t row = r + rope;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t sl = slot[t];
    if (sl < 0) continue;
    const float* src = kva + t * row;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < r; i += blockDim.x) ss += src[i] * src[i];
    ss = BlockSum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(r) + eps);
    for (int64_t i = threadIdx.x; i < r; i += blockDim.x) dst[i] = norm_w[i] * (src[i] * inv);
    const int64_t half = rope / 2;
    const float* cst = cs + t * rope;
    for (int64_t j = threadIdx.x; j < half; j += blockDim.x) {
      const int64_t ia = interleaved ? 2 * j : j;
      const int64_t ib = interleaved ? 2 * j + 1 : j + half;
      const float c = cst[2 * j], s = cst[2 * j + 1];
      const float x1 = src[r + ia], x2 = src[r + ib];
      dst[r + ia] = x1 * c - x2 * s;
      dst[r + ib] = x2 * c + x1 * s;
    }
    if ((rope & 1) != 0 && threadIdx.x == 0) dst[r + rope - 1] = src[r + rope - 1];
    __syncthreads();
    StoreKvRow(dst, cache, sl);
    __syncthreads();
  }
}

// ---- MLA absorb / expand: batched (per head) GEMM with bf16 weights ----------------
//
// C(b, m, n) = sum_k A(b, m, k) * B(b, k, n) for heads b, tokens m. A is f32
// (k contiguous); B is bf16, either n contiguous (kKN: absorb) or k contiguous
// (expand). A block computes a BM x BN tile of one head, staging BK-deep slices
// of A (transposed) and B (as f32) in shared memory; the next slice is loaded
// into registers while the current one is multiplied. Each thread owns TM rows
// x 4 columns. With T <= BM a head's weights are read once per call.

struct GemmArgs {
  const float* a = nullptr;
  int64_t a_ts = 0, a_bs = 0;  // A(b, m, k) = a[m*a_ts + b*a_bs + k]
  const uint16_t* w = nullptr;
  int64_t w_bs = 0, w_ld = 0;  // kKN: w[b*w_bs + k*w_ld + n]; else w[b*w_bs + n*w_ld + k]
  float* c = nullptr;
  uint16_t* c16 = nullptr;
  int64_t c_ts = 0, c_bs = 0;  // C(b, m, n) at m*c_ts + b*c_bs + n
  int64_t M = 0, N = 0, K = 0, batch = 0;
  int64_t rope = 0;  // absorb: C(b, m, N + i) = A(b, m, K + i) for i < rope
};

template <int BM, int BN, int BK, int NT, bool kKN, bool kVec>
__global__ void __launch_bounds__(NT) MlaGemmKernel(GemmArgs g) {
  constexpr int CG = BN / 4, RG = NT / CG, TM = BM / RG;
  static_assert(RG * TM == BM && CG * RG == NT, "tile shape");
  constexpr int AL = BM * BK / NT;                            // A floats per thread per slice
  constexpr int BL = kVec ? BK * BN / 8 / NT : BK * BN / NT;  // B loads per thread
  static_assert(AL * NT == BM * BK && (kVec ? BL * 8 * NT : BL * NT) == BK * BN, "loads");
  __shared__ float As[BK][BM + 1];
  __shared__ __align__(16) float Bs[BK][BN + 4];

  const int tid = threadIdx.x, tx = tid % CG, ty = tid / CG;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t mtiles = (g.M + BM - 1) / BM;
  for (int64_t b = blockIdx.z; b < g.batch; b += gridDim.z) {
    for (int64_t mt = blockIdx.y; mt < mtiles; mt += gridDim.y) {
      const int64_t m0 = mt * BM;
      float ra[AL];
      uint4 rbv[kVec ? BL : 1];
      uint16_t rbs[kVec ? 1 : BL];
      const auto load = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
          const int idx = tid + i * NT, m = idx / BK, k = idx % BK;
          ra[i] =
              (m0 + m < g.M && k0 + k < g.K) ? g.a[(m0 + m) * g.a_ts + b * g.a_bs + k0 + k] : 0.0f;
        }
        const uint16_t* wb = g.w + b * g.w_bs;
        if constexpr (kVec) {
#pragma unroll
          for (int i = 0; i < BL; ++i) {
            const int idx = tid + i * NT;
            int64_t k, n;
            if constexpr (kKN) {
              k = k0 + idx / (BN / 8);
              n = n0 + (idx % (BN / 8)) * 8;
            } else {
              n = n0 + idx / (BK / 8);
              k = k0 + (idx % (BK / 8)) * 8;
            }
            const bool in = k < g.K && n < g.N;
            rbv[i] = in ? *reinterpret_cast<const uint4*>(kKN ? wb + k * g.w_ld + n
                                                              : wb + n * g.w_ld + k)
                        : make_uint4(0, 0, 0, 0);
          }
        } else {
#pragma unroll
          for (int i = 0; i < BL; ++i) {
            const int idx = tid + i * NT;
            int64_t k, n;
            if constexpr (kKN) {
              k = k0 + idx / BN;
              n = n0 + idx % BN;
            } else {
              n = n0 + idx / BK;
              k = k0 + idx % BK;
            }
            rbs[i] = (k < g.K && n < g.N) ? (kKN ? wb[k * g.w_ld + n] : wb[n * g.w_ld + k])
                                          : uint16_t{0};
          }
        }
      };
      const auto store = [&]() {
#pragma unroll
        for (int i = 0; i < AL; ++i) {
          const int idx = tid + i * NT;
          As[idx % BK][idx / BK] = ra[i];
        }
        if constexpr (kVec) {
#pragma unroll
          for (int i = 0; i < BL; ++i) {
            const int idx = tid + i * NT;
            const uint32_t u[4] = {rbv[i].x, rbv[i].y, rbv[i].z, rbv[i].w};
            if constexpr (kKN) {
              const int k = idx / (BN / 8), n = (idx % (BN / 8)) * 8;
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                Bs[k][n + 2 * e] = __uint_as_float(u[e] << 16);
                Bs[k][n + 2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
              }
            } else {
              const int n = idx / (BK / 8), k = (idx % (BK / 8)) * 8;
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                Bs[k + 2 * e][n] = __uint_as_float(u[e] << 16);
                Bs[k + 2 * e + 1][n] = __uint_as_float(u[e] & 0xffff0000u);
              }
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < BL; ++i) {
            const int idx = tid + i * NT;
            if constexpr (kKN) {
              Bs[idx / BN][idx % BN] = Bf16ToF(rbs[i]);
            } else {
              Bs[idx % BK][idx / BK] = Bf16ToF(rbs[i]);
            }
          }
        }
      };

      float acc[TM][4];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

      load(0);
      for (int64_t k0 = 0; k0 < g.K; k0 += BK) {
        __syncthreads();
        store();
        __syncthreads();
        if (k0 + BK < g.K) load(k0 + BK);
#pragma unroll 8
        for (int kk = 0; kk < BK; ++kk) {
          const float4 bv = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
#pragma unroll
          for (int i = 0; i < TM; ++i) {
            const float av = As[kk][ty * TM + i];
            acc[i][0] += av * bv.x;
            acc[i][1] += av * bv.y;
            acc[i][2] += av * bv.z;
            acc[i][3] += av * bv.w;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        const int64_t m = m0 + ty * TM + i;
        if (m >= g.M) continue;
        const int64_t off = m * g.c_ts + b * g.c_bs;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t n = n0 + tx * 4 + j;
          if (n >= g.N) continue;
          if (g.c != nullptr) g.c[off + n] = acc[i][j];
          if (g.c16 != nullptr) g.c16[off + n] = FToBf16(acc[i][j]);
        }
      }
      if (g.rope > 0 && blockIdx.x == 0) {
        for (int64_t idx = tid; idx < BM * g.rope; idx += NT) {
          const int64_t m = m0 + idx / g.rope, i = idx % g.rope;
          if (m < g.M)
            g.c[m * g.c_ts + b * g.c_bs + g.N + i] = g.a[m * g.a_ts + b * g.a_bs + g.K + i];
        }
      }
    }
  }
}

template <int BM, int BN, int BK, int NT, bool kKN>
cudaError_t LaunchGemmTile(const GemmArgs& g, bool vec, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(Max64(1, CeilDiv(g.N, BN))),
                  static_cast<unsigned>(std::min<int64_t>(CeilDiv(g.M, BM), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(g.batch, 65535)));
  if (vec) {
    MlaGemmKernel<BM, BN, BK, NT, kKN, true><<<grid, NT, 0, s>>>(g);
  } else {
    MlaGemmKernel<BM, BN, BK, NT, kKN, false><<<grid, NT, 0, s>>>(g);
  }
  return cudaGetLastError();
}

template <bool kKN>
cudaError_t LaunchGemm(const GemmArgs& g, cudaStream_t s) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec =
      g.w_ld % 8 == 0 && g.w_bs % 8 == 0 && aligned(g.w) && (kKN ? g.N % 8 == 0 : g.K % 8 == 0);
  if (g.M <= 8) return LaunchGemmTile<8, 64, 64, 128, kKN>(g, vec, s);
  if (g.M <= 32) return LaunchGemmTile<32, 64, 32, 256, kKN>(g, vec, s);
  if (g.M <= 64) return LaunchGemmTile<64, 64, 32, 256, kKN>(g, vec, s);
  return LaunchGemmTile<128, 64, 32, 256, kKN>(g, vec, s);
}

}  // namespace

cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          float* cache, cudaStream_t s) {
  KvRows c;
  c.data = cache;
  c.row = r + rope;
  return WriteMlaCache(kva, T, r, rope, norm_w, eps, cs, interleaved, slot, c, s);
}

cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          const KvRows& cache, cudaStream_t s) {
  if (T <= 0 || r + rope <= 0) return cudaSuccess;
  const size_t smem = sizeof(float) * static_cast<size_t>(r + rope);
  if (cache.row != r + rope || smem > 48 * 1024 ||
      (cache.elem == KvElem::kFp8 && (cache.part_len <= 0 || cache.parts <= 0)))
    return cudaErrorInvalidValue;
  WriteMlaCacheKernel<<<BlocksFor(T), kThreads, smem, s>>>(kva, T, r, rope, norm_w, eps, cs,
                                                           interleaved, slot, cache);
  return cudaGetLastError();
}

cudaError_t MlaAbsorbQuery(const float* q, const uint16_t* wkv, int64_t T, int64_t nh, int64_t nope,
                           int64_t rope, int64_t vd, int64_t r, float* out, cudaStream_t s) {
  if (T <= 0 || nh <= 0 || r + rope <= 0) return cudaSuccess;
  GemmArgs g;
  g.a = q;
  g.a_bs = nope + rope;
  g.a_ts = nh * g.a_bs;
  g.w = wkv;
  g.w_bs = (nope + vd) * r;
  g.w_ld = r;
  g.c = out;
  g.c_bs = r + rope;
  g.c_ts = nh * g.c_bs;
  g.M = T;
  g.N = r;
  g.K = nope;
  g.batch = nh;
  g.rope = rope;
  return LaunchGemm<true>(g, s);
}

cudaError_t MlaExpandOutput(const float* olat, const uint16_t* wkv, int64_t T, int64_t nh,
                            int64_t nope, int64_t vd, int64_t r, float* out, uint16_t* out_bf16,
                            cudaStream_t s) {
  if (T <= 0 || nh <= 0 || vd <= 0) return cudaSuccess;
  GemmArgs g;
  g.a = olat;
  g.a_bs = r;
  g.a_ts = nh * r;
  g.w = wkv + nope * r;
  g.w_bs = (nope + vd) * r;
  g.w_ld = r;
  g.c = out;
  g.c16 = out_bf16;
  g.c_bs = vd;
  g.c_ts = nh * vd;
  g.M = T;
  g.N = vd;
  g.K = r;
  g.batch = nh;
  return LaunchGemm<false>(g, s);
}

}  // namespace hmoe::cuda
