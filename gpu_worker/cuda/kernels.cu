// CUDA kernels behind gpu_worker/cuda/kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gpu_worker/cuda/kernels.h"

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

// ---- elementwise ---------------------------------------------------------------

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

__global__ void WriteMlaCacheKernel(const float* kva, int64_t T, int64_t r, int64_t rope,
                                    const float* norm_w, float eps, const float* cs,
                                    bool interleaved, const int32_t* slot, float* cache) {
  __shared__ float sh[33];
  const int64_t row = r + rope;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t sl = slot[t];
    if (sl < 0) continue;
    const float* src = kva + t * row;
    float* dst = cache + sl * row;
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
  }
}

__global__ void WriteKvCacheKernel(const float* k, const float* v, int64_t T, int64_t row,
                                   const int32_t* slot, float* kcache, float* vcache) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t sl = slot[t];
    if (sl < 0) continue;
    for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
      kcache[sl * row + i] = k[t * row + i];
      vcache[sl * row + i] = v[t * row + i];
    }
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

__global__ void GatherPagedRowsKernel(const float* cache, int64_t row_floats, const int32_t* table,
                                      int64_t bt, int64_t p0, int64_t n, float* out, bool vec) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t p = p0 + i;
    const float* src = cache + (static_cast<int64_t>(table[p / bt]) * bt + p % bt) * row_floats;
    float* dst = out + i * row_floats;
    if (vec) {
      const float4* s4 = reinterpret_cast<const float4*>(src);
      float4* d4 = reinterpret_cast<float4*>(dst);
      for (int64_t c = threadIdx.x; c < row_floats / 4; c += blockDim.x) d4[c] = s4[c];
    } else {
      for (int64_t c = threadIdx.x; c < row_floats; c += blockDim.x) dst[c] = src[c];
    }
  }
}

// One block per row: the visible columns are [lo, hi) of the row.
__global__ void MaskedSoftmaxRowsKernel(float* scores, int64_t rows, int64_t cols,
                                        int64_t group_rows, int64_t q_pos0, int64_t k_pos0,
                                        int64_t window) {
  __shared__ float sh[33];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* s = scores + r * cols;
    const int64_t q = q_pos0 + r % group_rows;
    const int64_t hi = Min64(cols, q - k_pos0 + 1);
    const int64_t lo = window > 0 ? Max64(0, q - window + 1 - k_pos0) : 0;
    float mx = -INFINITY;
    for (int64_t c = lo + threadIdx.x; c < hi; c += blockDim.x) mx = fmaxf(mx, s[c]);
    mx = WarpMax(mx);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x < 32) {
      const int nw = (blockDim.x + 31) >> 5;
      float w = threadIdx.x < nw ? sh[threadIdx.x] : -INFINITY;
      w = WarpMax(w);
      if (threadIdx.x == 0) sh[32] = w;
    }
    __syncthreads();
    mx = sh[32];
    __syncthreads();
    float sum = 0.0f;
    for (int64_t c = lo + threadIdx.x; c < hi; c += blockDim.x) sum += expf(s[c] - mx);
    sum = BlockSum(sum, sh);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      s[c] = c >= lo && c < hi ? expf(s[c] - mx) * inv : 0.0f;
  }
}

// ---- paged attention -------------------------------------------------------------
//
// A block serves one token t, one kv head g and up to kMaxHpb of the heads
// that share g (one warp per head), over the key tiles split, split + splits,
// ... of the token's visible range. Each tile of 32 keys (and values, unless
// values are the keys' leading dv floats, as in MLA) is staged in shared
// memory once for all the block's heads; lane j scores key j, then the warp
// folds the tile into its online softmax (lane owns dims lane + 32c of v).
// With splits > 1, each block leaves (max, sum, unnormalized acc) in scratch
// and a second kernel merges them.

constexpr int kKeyTile = 32;
constexpr int kMaxHpb = 8;
constexpr int kMaxDk = 576;
constexpr int kMaxDv = 512;

struct AttnLayout {
  int hpb = 1;         // heads (warps) per block
  int64_t chunks = 1;  // blocks per kv head
  int splits = 1;
  int dkp = 0;  // q row stride in shared memory
  int ks = 0;   // key row stride in shared memory
  int vs = 0;   // value row stride (0: values read from the key tile)
  bool shared_kv = false;
  size_t smem_bytes = 0;
};

// Row stride (floats) for 32 rows of n floats read as float4 by consecutive
// lanes without bank conflicts: an odd number of 16-byte units.
int PaddedStride(int64_t n) {
  int64_t u = CeilDiv(n, 4);
  if (u % 2 == 0) ++u;
  return static_cast<int>(4 * u);
}

AttnLayout LayoutFor(const PagedAttentionArgs& a) {
  AttnLayout l;
  const int64_t group = a.num_heads / a.num_kv_heads;
  l.hpb = static_cast<int>(std::min<int64_t>(group, kMaxHpb));
  l.chunks = CeilDiv(group, l.hpb);
  const int64_t base = a.T * a.num_kv_heads * l.chunks;
  l.splits = base >= 256 ? 1 : static_cast<int>(std::min<int64_t>(64, CeilDiv(512, base)));
  l.dkp = static_cast<int>(CeilDiv(a.dk, 4) * 4);
  l.ks = PaddedStride(a.dk);
  l.shared_kv = a.v_cache == a.k_cache && a.v_row == a.k_row &&
                a.v_head_offset == a.k_head_offset && a.dv <= a.dk;
  l.vs = l.shared_kv ? 0 : PaddedStride(a.dv);
  l.smem_bytes =
      sizeof(float) * (static_cast<size_t>(l.hpb) * l.dkp + kKeyTile * static_cast<size_t>(l.ks) +
                       kKeyTile * static_cast<size_t>(l.vs));
  return l;
}

// Copies the rows of a tile (32 cache rows of n floats from `base`) into
// shared memory; rows past the visible range become zeros.
__device__ __forceinline__ void LoadTile(const float* base, int64_t row_stride, int64_t n, bool vec,
                                         int stride, float* dst, int64_t p0, int64_t pos,
                                         const int32_t* table, int64_t bt) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int j = warp; j < kKeyTile; j += nw) {
    const int64_t p = p0 + j;
    float* d = dst + j * stride;
    if (p > pos) {
      for (int64_t i = lane; i < n; i += 32) d[i] = 0.0f;
      continue;
    }
    const int64_t row = static_cast<int64_t>(table[p / bt]) * bt + p % bt;
    const float* src = base + row * row_stride;
    if (vec) {
      const float4* s4 = reinterpret_cast<const float4*>(src);
      float4* d4 = reinterpret_cast<float4*>(d);
      for (int64_t i = lane; i < n / 4; i += 32) d4[i] = s4[i];
    } else {
      for (int64_t i = lane; i < n; i += 32) d[i] = src[i];
    }
  }
}

template <int kDvChunks>
__global__ void __launch_bounds__(kMaxHpb * 32)
    PagedAttentionKernel(PagedAttentionArgs a, AttnLayout l, bool vec_k, bool vec_v) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);
  float* kt = qs + l.hpb * l.dkp;
  float* vt = l.shared_kv ? kt : kt + kKeyTile * l.ks;
  const int vstride = l.shared_kv ? l.ks : l.vs;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bid = blockIdx.x;
  const int64_t chunk = bid % l.chunks;
  const int64_t g = (bid / l.chunks) % a.num_kv_heads;
  const int64_t t = bid / l.chunks / a.num_kv_heads;
  const int split = blockIdx.y;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t hl = chunk * l.hpb + warp;
  const bool active = hl < group;
  const int64_t h = g * group + hl;

  if (active) {
    const float* qr = a.q + t * a.q_tok_stride + h * a.q_head_stride;
    for (int64_t d = lane; d < a.dk; d += 32) qs[warp * l.dkp + d] = qr[d];
  }
  const int64_t pos = a.pos[t];
  const int64_t lo = a.window > 0 ? Max64(0, pos - a.window + 1) : 0;
  const int64_t nkeys = pos - lo + 1;
  const int64_t ntiles = nkeys > 0 ? CeilDiv(nkeys, kKeyTile) : 0;
  const int32_t* table = a.block_table + a.table_start[t];
  const float* kbase = a.k_cache + g * a.k_head_offset;
  const float* vbase = a.v_cache + g * a.v_head_offset;

  float m = -INFINITY, lsum = 0.0f;
  float acc[kDvChunks];
#pragma unroll
  for (int c = 0; c < kDvChunks; ++c) acc[c] = 0.0f;

  const float* qw = qs + warp * l.dkp;
  const float* kr = kt + lane * l.ks;
  const int dk4 = static_cast<int>(a.dk / 4) * 4;
  for (int64_t tile = split; tile < ntiles; tile += l.splits) {
    const int64_t p0 = lo + tile * kKeyTile;
    __syncthreads();
    LoadTile(kbase, a.k_row, a.dk, vec_k, l.ks, kt, p0, pos, table, a.block_tokens);
    if (!l.shared_kv)
      LoadTile(vbase, a.v_row, a.dv, vec_v, l.vs, vt, p0, pos, table, a.block_tokens);
    __syncthreads();
    if (!active) continue;
    float sc = 0.0f;
    for (int d = 0; d < dk4; d += 4) {
      const float4 qv = *reinterpret_cast<const float4*>(qw + d);
      const float4 kv = *reinterpret_cast<const float4*>(kr + d);
      sc += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
    }
    for (int d = dk4; d < a.dk; ++d) sc += qw[d] * kr[d];
    const bool valid = p0 + lane <= pos;
    sc = valid ? sc * a.scale : -INFINITY;
    const float mnew = fmaxf(m, WarpMax(sc));  // finite: key p0 is visible
    const float corr = expf(m - mnew);
    const float p = valid ? expf(sc - mnew) : 0.0f;
    lsum = lsum * corr + WarpSum(p);
    m = mnew;
#pragma unroll
    for (int c = 0; c < kDvChunks; ++c) acc[c] *= corr;
    const int jn = static_cast<int>(Min64(kKeyTile, pos - p0 + 1));
    for (int j = 0; j < jn; ++j) {
      const float pj = __shfl_sync(kFull, p, j);
      const float* vr = vt + j * vstride;
#pragma unroll
      for (int c = 0; c < kDvChunks; ++c) {
        const int d = lane + 32 * c;
        if (d < a.dv) acc[c] += pj * vr[d];
      }
    }
  }
  if (!active) return;
  if (l.splits == 1) {
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    float* o = a.out + t * a.out_tok_stride + h * a.out_head_stride;
#pragma unroll
    for (int c = 0; c < kDvChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < a.dv) o[d] = acc[c] * inv;
    }
  } else {
    float* sp = a.scratch + ((t * a.num_heads + h) * l.splits + split) * (a.dv + 2);
    if (lane == 0) {
      sp[0] = m;
      sp[1] = lsum;
    }
#pragma unroll
    for (int c = 0; c < kDvChunks; ++c) {
      const int d = lane + 32 * c;
      if (d < a.dv) sp[2 + d] = acc[c];
    }
  }
}

// One block per (token, head) row: merges the splits' partial softmax states.
__global__ void AttentionMergeKernel(PagedAttentionArgs a, int splits) {
  __shared__ float wsh[64];
  __shared__ float inv_sh;
  for (int64_t rowi = blockIdx.x; rowi < a.T * a.num_heads; rowi += gridDim.x) {
    const float* sp = a.scratch + rowi * splits * (a.dv + 2);
    if (threadIdx.x < 32) {
      float mx = -INFINITY;
      for (int s = threadIdx.x; s < splits; s += 32)
        if (sp[s * (a.dv + 2) + 1] > 0.0f) mx = fmaxf(mx, sp[s * (a.dv + 2)]);
      mx = WarpMax(mx);
      float lt = 0.0f;
      for (int s = threadIdx.x; s < splits; s += 32) {
        const float ls = sp[s * (a.dv + 2) + 1];
        const float w = ls > 0.0f ? expf(sp[s * (a.dv + 2)] - mx) : 0.0f;
        wsh[s] = w;
        lt += w * ls;
      }
      lt = WarpSum(lt);
      if (threadIdx.x == 0) inv_sh = lt > 0.0f ? 1.0f / lt : 0.0f;
    }
    __syncthreads();
    const int64_t t = rowi / a.num_heads, h = rowi % a.num_heads;
    float* o = a.out + t * a.out_tok_stride + h * a.out_head_stride;
    for (int64_t d = threadIdx.x; d < a.dv; d += blockDim.x) {
      float v = 0.0f;
      for (int s = 0; s < splits; ++s)
        if (wsh[s] > 0.0f) v += wsh[s] * sp[s * (a.dv + 2) + 2 + d];
      o[d] = v * inv_sh;
    }
    __syncthreads();
  }
}

template <int kDvChunks>
cudaError_t LaunchAttention(const PagedAttentionArgs& a, const AttnLayout& l, cudaStream_t s) {
  const auto kernel = PagedAttentionKernel<kDvChunks>;
  if (l.smem_bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(l.smem_bytes));
    if (e != cudaSuccess) return e;
  }
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec_k =
      a.dk % 4 == 0 && a.k_row % 4 == 0 && a.k_head_offset % 4 == 0 && aligned(a.k_cache);
  const bool vec_v =
      a.dv % 4 == 0 && a.v_row % 4 == 0 && a.v_head_offset % 4 == 0 && aligned(a.v_cache);
  const dim3 grid(static_cast<unsigned>(a.T * a.num_kv_heads * l.chunks),
                  static_cast<unsigned>(l.splits));
  kernel<<<grid, l.hpb * 32, l.smem_bytes, s>>>(a, l, vec_k, vec_v);
  return cudaGetLastError();
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

// ---- router ----------------------------------------------------------------------
//
// One warp per token. Scores, selection scores and the candidate mask sit in
// shared memory; the softmax denominator is summed in expert order (as the
// CPU reference does) by lane 0; each of the K picks is a warp argmax with
// ties to the lower index.

constexpr int kRouteMaxE = 512;
constexpr int kRouteMaxK = 16;
constexpr int kRouteMaxG = 16;
constexpr int kRouteWarps = 4;

// Warp argmax of (v, i) pairs (i < 0: none); ties to the lower index.
__device__ __forceinline__ void WarpArgMax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
      v = ov;
      i = oi;
    }
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32)
    RouteKernel(const float* logits, int64_t T, RouteParams p, const float* bias, int32_t* ids,
                float* weights) {
  __shared__ float scores_sh[kRouteWarps][kRouteMaxE];
  __shared__ float choice_sh[kRouteWarps][kRouteMaxE];
  __shared__ unsigned char allowed_sh[kRouteWarps][kRouteMaxE];
  __shared__ int pick_sh[kRouteWarps][kRouteMaxK];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* scores = scores_sh[warp];
  float* choice = choice_sh[warp];
  unsigned char* allowed = allowed_sh[warp];
  int* pick = pick_sh[warp];
  const int E = p.num_experts, K = p.top_k;
  const int G = p.n_group > 1 ? p.n_group : 1, per = E / G;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp; t < T;
       t += static_cast<int64_t>(gridDim.x) * kRouteWarps) {
    const float* l = logits + t * E;
    if (p.sigmoid) {
      for (int e = lane; e < E; e += 32) scores[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
      float mx = -INFINITY;
      for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
      mx = WarpMax(mx);
      for (int e = lane; e < E; e += 32) scores[e] = expf(l[e] - mx);
      __syncwarp();
      float sum = 0.0f;
      if (lane == 0)
        for (int e = 0; e < E; ++e) sum += scores[e];
      sum = __shfl_sync(kFull, sum, 0);
      for (int e = lane; e < E; e += 32) scores[e] /= sum;
    }
    for (int e = lane; e < E; e += 32) choice[e] = scores[e] + (bias ? bias[e] : 0.0f);
    __syncwarp();
    if (p.method != 0 && G > 1) {
      float gv = -INFINITY;
      int gi = -1;
      if (lane < G) {
        const float* c = choice + lane * per;
        if (p.method == 2) {
          float x = -INFINITY, y = -INFINITY;
          for (int j = 0; j < per; ++j) {
            if (c[j] > x) {
              y = x;
              x = c[j];
            } else if (c[j] > y) {
              y = c[j];
            }
          }
          gv = x + y;
        } else {
          gv = c[0];
          for (int j = 1; j < per; ++j) gv = fmaxf(gv, c[j]);
        }
        gi = lane;
      }
      unsigned mask = 0;
      for (int k = 0; k < p.topk_group; ++k) {
        float v = gv;
        int i = gi;
        WarpArgMax(v, i);
        if (i < 0) break;
        mask |= 1u << i;
        if (lane == i) gi = -1;
      }
      for (int e = lane; e < E; e += 32) {
        const int grp = e / per;
        allowed[e] = grp < G && ((mask >> grp) & 1u) != 0;
      }
    } else {
      for (int e = lane; e < E; e += 32) allowed[e] = 1;
    }
    __syncwarp();
    for (int k = 0; k < K; ++k) {
      float v = -INFINITY;
      int i = -1;
      for (int e = lane; e < E; e += 32) {
        if (allowed[e] && (i < 0 || choice[e] > v)) {
          v = choice[e];
          i = e;
        }
      }
      WarpArgMax(v, i);
      if (lane == 0) {
        pick[k] = i;
        if (i >= 0) allowed[i] = 0;
      }
      __syncwarp();
    }
    if (lane == 0) {
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) sum += pick[k] >= 0 ? scores[pick[k]] : 0.0f;
      for (int k = 0; k < K; ++k) {
        float w = pick[k] >= 0 ? scores[pick[k]] : 0.0f;
        if (p.norm) w /= (sum + p.norm_eps);
        w *= p.scale;
        ids[t * K + k] = pick[k];
        weights[t * K + k] = w;
      }
    }
    __syncwarp();
  }
}

// One thread per token: the rank of slot j among the token's K weights
// (ascending, ties: the later slot first) decides where it goes.
__global__ void SplitDeferredKernel(const int32_t* ids, const float* w, int64_t T, int K, int n,
                                    int32_t* ids_now, float* w_now, int32_t* ids_later,
                                    float* w_later) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int32_t* id = ids + t * K;
  const float* wt = w + t * K;
  int kept = 0;
  for (int j = 0; j < K; ++j) {
    int rank = 0;
    for (int i = 0; i < K; ++i) rank += (wt[i] < wt[j] || (wt[i] == wt[j] && i > j)) ? 1 : 0;
    if (rank < n) {
      ids_later[t * n + rank] = id[j];
      w_later[t * n + rank] = wt[j];
    } else {
      ids_now[t * (K - n) + kept] = id[j];
      w_now[t * (K - n) + kept] = wt[j];
      ++kept;
    }
  }
}

// ---- hot experts ----------------------------------------------------------

// The expert service's int8 activation quantization (packed.h Int8InvScale).
__device__ float Int8InvScaleDev(float s) { return s >= 1.17549435e-38f ? 1.0f / s : 0.0f; }

// Block-wide max of |v| and any-NaN over blockDim.x threads (<= 1024).
__device__ float BlockAmax(float v, bool nan, bool* any_nan) {
  __shared__ float m[32];
  __shared__ int n[32];
  float a = fabsf(v);
  int isn = nan ? 1 : 0;
  for (int o = 16; o > 0; o >>= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    isn |= __shfl_xor_sync(0xffffffffu, isn, o);
  }
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  if (l == 0) {
    m[w] = a;
    n[w] = isn;
  }
  __syncthreads();
  if (w == 0) {
    const int nw = (blockDim.x + 31) / 32;
    a = l < nw ? m[l] : 0.0f;
    isn = l < nw ? n[l] : 0;
    for (int o = 16; o > 0; o >>= 1) {
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
      isn |= __shfl_xor_sync(0xffffffffu, isn, o);
    }
    if (l == 0) {
      m[0] = a;
      n[0] = isn;
    }
  }
  __syncthreads();
  *any_nan = n[0] != 0;
  return m[0];
}

// Row r of src (bf16 when src16, else f32) [rows][n] -> q [rows][n] int8 and
// scale [rows]: s = amax / 127 (NaN if the row has one), q = rint(x * inv)
// clamped to [-127, 127], NaN -> 0. Rows with active[r] == 0 are skipped.
__global__ void QuantRowsKernel(const uint16_t* src16, const float* src32, int64_t n,
                                const int32_t* active, int64_t K, int8_t* q, float* scale) {
  const int64_t r = blockIdx.x;
  if (active != nullptr && active[r] < 0) return;
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = src16 ? Bf16ToF(src16[r * n + i]) : src32[r * n + i];
    amax = fmaxf(amax, fabsf(v));
    nan |= isnan(v);
  }
  bool any_nan = false;
  amax = BlockAmax(amax, nan, &any_nan);
  const float sc = any_nan ? __int_as_float(0x7fc00000) : amax / 127.0f;
  const float inv = Int8InvScaleDev(sc);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = src16 ? Bf16ToF(src16[r * n + i]) : src32[r * n + i];
    const float t = rintf(v * inv);
    q[r * n + i] = isnan(t) ? int8_t{0} : static_cast<int8_t>(fminf(fmaxf(t, -127.0f), 127.0f));
  }
  if (threadIdx.x == 0) scale[r] = sc;
  (void)K;
}

// Eight int4 weights (one 32-bit word: byte j holds columns 2j, low
// nibble, and 2j + 1) against eight int8 activations (aa: columns 0-3, ab:
// 4-7), added to c: exact integer products.
__device__ __forceinline__ int Dot8Int4(uint32_t w, uint32_t aa, uint32_t ab, int c) {
  // Nibbles to signed bytes: (v ^ 8) - 8 per byte.
  const uint32_t lo = __vsub4((w & 0x0F0F0F0Fu) ^ 0x08080808u, 0x08080808u);
  const uint32_t hi = __vsub4(((w >> 4) & 0x0F0F0F0Fu) ^ 0x08080808u, 0x08080808u);
  const uint32_t even = __byte_perm(aa, ab, 0x6420), odd = __byte_perm(aa, ab, 0x7531);
  c = __dp4a(static_cast<int>(lo), static_cast<int>(even), c);
  return __dp4a(static_cast<int>(hi), static_cast<int>(odd), c);
}

__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Lane-partial dot of matrix row r with an activation row; the warp sums it.
// int8 / int4: exact integer products (int4: per 32-column piece of a
// group), combined in double with the weight scales (an int times a float
// is exact in double); times a_s at the end. bf16: double sum of f32
// products. Rows whose bytes and activations are 16-byte aligned (int4:
// cols and group multiples of 32; int8: cols of 16; bf16: cols of 8) are
// read 16 bytes per lane, coalesced; others element by element.
__device__ double RowDot(const DevQuantMatrix& W, int64_t r, const float* a_f, const int8_t* a_q,
                         float a_s) {
  const int lane = threadIdx.x % 32;
  double acc = 0.0;
  if (W.format == WeightFormat::kBf16) {
    const uint16_t* w = static_cast<const uint16_t*>(W.w) + r * W.cols;
    if (W.cols % 8 == 0 && Aligned16(w)) {
      const uint4* w4 = reinterpret_cast<const uint4*>(w);
      for (int64_t k = lane; k < W.cols / 8; k += 32) {
        const uint4 v = w4[k];
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
        const float* a = a_f + 8 * k;
        for (int j = 0; j < 4; ++j) {
          acc += static_cast<double>(a[2 * j]) * static_cast<double>(__uint_as_float(u[j] << 16));
          acc += static_cast<double>(a[2 * j + 1]) *
                 static_cast<double>(__uint_as_float(u[j] & 0xFFFF0000u));
        }
      }
    } else {
      for (int64_t c = lane; c < W.cols; c += 32)
        acc += static_cast<double>(a_f[c]) * static_cast<double>(Bf16ToF(w[c]));
    }
  } else if (W.format == WeightFormat::kInt8) {
    const int8_t* w = static_cast<const int8_t*>(W.w) + r * W.cols;
    int isum = 0;
    if (W.cols % 16 == 0 && Aligned16(w) && Aligned16(a_q)) {
      const uint4* w4 = reinterpret_cast<const uint4*>(w);
      const uint4* a4 = reinterpret_cast<const uint4*>(a_q);
      for (int64_t k = lane; k < W.cols / 16; k += 32) {
        const uint4 v = w4[k], a = a4[k];
        isum = __dp4a(static_cast<int>(v.x), static_cast<int>(a.x), isum);
        isum = __dp4a(static_cast<int>(v.y), static_cast<int>(a.y), isum);
        isum = __dp4a(static_cast<int>(v.z), static_cast<int>(a.z), isum);
        isum = __dp4a(static_cast<int>(v.w), static_cast<int>(a.w), isum);
      }
    } else {
      for (int64_t c = lane; c < W.cols; c += 32) isum += int{a_q[c]} * int{w[c]};
    }
    for (int o = 16; o > 0; o >>= 1) isum += __shfl_xor_sync(0xffffffffu, isum, o);
    return lane == 0 ? static_cast<double>(isum) * W.scale[r] * a_s : 0.0;
  } else {
    const uint8_t* w = static_cast<const uint8_t*>(W.w) + r * ((W.cols + 1) / 2);
    const int64_t ng = (W.cols + W.group - 1) / W.group;
    const float* sc = W.scale + r * ng;
    if (W.cols % 32 == 0 && W.group % 32 == 0 && Aligned16(w) && Aligned16(a_q)) {
      // Lane k takes 32 columns (16 weight bytes, 32 activations) of group
      // 32k / group at a time.
      const uint4* w4 = reinterpret_cast<const uint4*>(w);
      const uint4* a4 = reinterpret_cast<const uint4*>(a_q);
      for (int64_t k = lane; k < W.cols / 32; k += 32) {
        const uint4 v = w4[k], a0 = a4[2 * k], a1 = a4[2 * k + 1];
        int isum = Dot8Int4(v.x, a0.x, a0.y, 0);
        isum = Dot8Int4(v.y, a0.z, a0.w, isum);
        isum = Dot8Int4(v.z, a1.x, a1.y, isum);
        isum = Dot8Int4(v.w, a1.z, a1.w, isum);
        acc += static_cast<double>(isum) * static_cast<double>(sc[(32 * k) / W.group]);
      }
    } else {
      // Lane l owns groups l, l + 32, ...: each group's integer sum is exact.
      for (int64_t g = lane; g < ng; g += 32) {
        int isum = 0;
        const int64_t c1 = min(W.cols, (g + 1) * W.group);
        for (int64_t c = g * W.group; c < c1; ++c) {
          const int b = w[c / 2];
          const int v = (c % 2 == 0) ? (b & 0xF) : (b >> 4);
          isum += int{a_q[c]} * (v >= 8 ? v - 16 : v);
        }
        acc += static_cast<double>(isum) * sc[g];
      }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return lane == 0 ? acc * a_s : 0.0;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return lane == 0 ? acc : 0.0;
}

__device__ const DevExpert* HotExpertOf(const HotExpertsArgs& a, int64_t slot) {
  const int32_t e = a.ids[slot];
  if (e < 0 || e >= a.E) return nullptr;
  const DevExpert* ex = a.experts + e;
  return ex->gate.w != nullptr ? ex : nullptr;
}

__global__ void SplitHotIdsKernel(const int32_t* ids, int64_t n, const uint8_t* mask, int64_t E,
                                  int32_t* cold, int32_t* hot) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t e = ids[i];
  const bool h = e >= 0 && e < E && mask[e] != 0;
  hot[i] = h ? e : -1;
  cold[i] = h ? -1 : e;
}

// Marks each slot hot (its expert id) or not (-1), and each token with any hot slot.
__global__ void HotSlotsKernel(HotExpertsArgs a, int32_t* slot_expert, int32_t* token_active) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.T) return;
  int any = -1;
  for (int64_t j = 0; j < a.K; ++j) {
    const int64_t s = t * a.K + j;
    const bool hot = HotExpertOf(a, s) != nullptr;
    slot_expert[s] = hot ? a.ids[s] : -1;
    any = hot ? 1 : any;
  }
  token_active[t] = any;
}

// Block (slot, row chunk): gate and up rows -> h = silu(g) * u [slot][I]
// (bf16-rounded for bf16 weights).
__global__ void HotGateUpKernel(HotExpertsArgs a, const int32_t* slot_expert, const int8_t* xq,
                                const float* xs, float* h) {
  const int64_t slot = blockIdx.x;
  if (slot_expert[slot] < 0) return;
  const DevExpert& ex = a.experts[slot_expert[slot]];
  const int64_t t = slot / a.K;
  // f32 activations (bf16 weights): widened per thread from x.
  extern __shared__ float xf[];
  const bool f32_act = ex.gate.format == WeightFormat::kBf16;
  if (f32_act)
    for (int64_t c = threadIdx.x; c < a.H; c += blockDim.x) xf[c] = Bf16ToF(a.x[t * a.H + c]);
  __syncthreads();
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t rows_per_block = (a.I + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * rows_per_block, r1 = min(a.I, r0 + rows_per_block);
  for (int64_t r = r0 + warp; r < r1; r += warps) {
    const double g = RowDot(ex.gate, r, xf, xq + t * a.H, xs[t]);
    const double u = RowDot(ex.up, r, xf, xq + t * a.H, xs[t]);
    if (threadIdx.x % 32 == 0) {
      const float gf = static_cast<float>(g);
      float v = gf / (1.0f + expf(-gf)) * static_cast<float>(u);
      if (f32_act) v = Bf16ToF(FToBf16(v));
      h[slot * a.I + r] = v;
    }
  }
}

// Block (slot, row chunk): down rows -> ys[slot][H] = weight * y.
__global__ void HotDownKernel(HotExpertsArgs a, const int32_t* slot_expert, const float* h,
                              const int8_t* hq, const float* hs, float* ys) {
  const int64_t slot = blockIdx.x;
  if (slot_expert[slot] < 0) return;
  const DevExpert& ex = a.experts[slot_expert[slot]];
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t rows_per_block = (a.H + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = blockIdx.y * rows_per_block, r1 = min(a.H, r0 + rows_per_block);
  const float wt = a.weights[slot];
  for (int64_t r = r0 + warp; r < r1; r += warps) {
    const double y = RowDot(ex.down, r, h + slot * a.I, hq + slot * a.I, hs[slot]);
    if (threadIdx.x % 32 == 0) ys[slot * a.H + r] = wt * static_cast<float>(y);
  }
}

// out[t][c] = sum over hot slots j ascending of ys[t*K + j][c].
__global__ void HotSumKernel(HotExpertsArgs a, const int32_t* slot_expert, const float* ys) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.T * a.H) return;
  const int64_t t = i / a.H, c = i % a.H;
  float o = 0.0f;
  for (int64_t j = 0; j < a.K; ++j)
    if (slot_expert[t * a.K + j] >= 0) o += ys[(t * a.K + j) * a.H + c];
  a.out[i] = o;
}

// ---- streamed experts (hybrid prefill) --------------------------------------------

// out[r][c] = bf16(W[r][c]) dequantized: bf16 as is, int8 q * scale[r],
// int4 q * scale[r][c / group] (rounded to bf16 once).
__global__ void DequantToBf16Kernel(DevQuantMatrix W, uint16_t* out) {
  const int64_t n = W.rows * W.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / W.cols, c = i % W.cols;
    if (W.format == WeightFormat::kBf16) {
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

__global__ void TrapKernel() { __trap(); }

__device__ uint64_t GlobalNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Grid-stride copies (16-byte vectors for the hidden rows when aligned),
// each thread's writes fenced, then the last block to finish sends.
__global__ void SendExpertCallKernel(const uint16_t* hidden, int64_t hidden_elems, bool vec16,
                                     const int32_t* ids, const float* weights, int64_t tk,
                                     uint16_t* dst_hidden, int32_t* dst_ids, float* dst_weights,
                                     uint32_t* state, uint32_t request, const uint32_t* armed,
                                     const uint32_t* abort, unsigned int* counter) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (vec16) {
    const int64_t n = hidden_elems / 8;
    const uint4* src = reinterpret_cast<const uint4*>(hidden);
    uint4* dst = reinterpret_cast<uint4*>(dst_hidden);
    for (int64_t i = tid; i < n; i += stride) dst[i] = src[i];
  } else {
    for (int64_t i = tid; i < hidden_elems; i += stride) dst_hidden[i] = hidden[i];
  }
  for (int64_t i = tid; i < tk; i += stride) {
    dst_ids[i] = ids[i];
    dst_weights[i] = weights[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(counter, 1u) != gridDim.x - 1) return;
  __threadfence_system();
  if (LoadAcquireSys(armed) != 0 && (abort == nullptr || LoadAcquireSys(abort) == 0))
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(state), "r"(request) : "memory");
  *reinterpret_cast<volatile unsigned int*>(counter) = 0;
}

__global__ void WaitHostWordKernel(const uint32_t* word, uint32_t lo, uint32_t hi, uint32_t* abort,
                                   uint64_t timeout_ns, unsigned long long* wait_ns) {
  const uint64_t t0 = GlobalNs();
  for (;;) {
    const uint32_t v = LoadAcquireSys(word);
    if (v < lo || v > hi) break;
    if (LoadAcquireSys(abort) != 0) break;
    if (GlobalNs() - t0 >= timeout_ns) {
      *reinterpret_cast<volatile uint32_t*>(abort) = 1;
      break;
    }
    __nanosleep(100);
  }
  __threadfence_system();
  if (wait_ns != nullptr)
    *reinterpret_cast<volatile unsigned long long*>(wait_ns) += GlobalNs() - t0;
}

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

cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          float* cache, cudaStream_t s) {
  if (T <= 0 || r + rope <= 0) return cudaSuccess;
  WriteMlaCacheKernel<<<BlocksFor(T), kThreads, 0, s>>>(kva, T, r, rope, norm_w, eps, cs,
                                                        interleaved, slot, cache);
  return cudaGetLastError();
}

cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, int64_t row,
                         const int32_t* slot, float* kcache, float* vcache, cudaStream_t s) {
  if (T <= 0 || row <= 0) return cudaSuccess;
  WriteKvCacheKernel<<<BlocksFor(T), kThreads, 0, s>>>(k, v, T, row, slot, kcache, vcache);
  return cudaGetLastError();
}

int64_t PagedAttentionScratchFloats(const PagedAttentionArgs& a) {
  if (a.T <= 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0)
    return 0;
  const AttnLayout l = LayoutFor(a);
  return l.splits > 1 ? a.T * a.num_heads * l.splits * (a.dv + 2) : 0;
}

cudaError_t PagedAttention(const PagedAttentionArgs& args, cudaStream_t s) {
  if (args.T <= 0 || args.num_heads <= 0) return cudaSuccess;
  if (args.num_kv_heads <= 0 || args.num_heads % args.num_kv_heads != 0 || args.dk <= 0 ||
      args.dk > kMaxDk || args.dv <= 0 || args.dv > kMaxDv || args.block_tokens <= 0)
    return cudaErrorInvalidValue;
  PagedAttentionArgs a = args;
  AttnLayout l = LayoutFor(a);
  if (a.T * a.num_kv_heads * l.chunks > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  if (l.splits > 1) {
    if (a.scratch == nullptr) {
      l.splits = 1;
    } else if (a.scratch_floats < a.T * a.num_heads * l.splits * (a.dv + 2)) {
      return cudaErrorInvalidValue;
    }
  }
  cudaError_t e;
  if (a.dv <= 128) {
    e = LaunchAttention<4>(a, l, s);
  } else if (a.dv <= 256) {
    e = LaunchAttention<8>(a, l, s);
  } else {
    e = LaunchAttention<16>(a, l, s);
  }
  if (e != cudaSuccess || l.splits == 1) return e;
  AttentionMergeKernel<<<BlocksFor(a.T * a.num_heads), 128, 0, s>>>(a, l.splits);
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

cudaError_t RouteTokens(const float* logits, int64_t T, const RouteParams& p, const float* bias,
                        int32_t* ids, float* weights, cudaStream_t s) {
  if (T <= 0) return cudaSuccess;
  if (p.num_experts <= 0 || p.num_experts > kRouteMaxE || p.top_k <= 0 || p.top_k > kRouteMaxK ||
      p.n_group > kRouteMaxG || p.n_group < 1 || p.topk_group < 1 || p.topk_group > p.n_group)
    return cudaErrorInvalidValue;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>(CeilDiv(T, kRouteWarps), int64_t{1} << 20));
  RouteKernel<<<blocks, kRouteWarps * 32, 0, s>>>(logits, T, p, bias, ids, weights);
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

cudaError_t GatherPagedRows(const float* cache, int64_t row_floats, const int32_t* table,
                            int64_t block_tokens, int64_t p0, int64_t n, float* out,
                            cudaStream_t s) {
  if (n <= 0 || row_floats <= 0) return cudaSuccess;
  if (block_tokens <= 0 || p0 < 0) return cudaErrorInvalidValue;
  const bool vec = row_floats % 4 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  GatherPagedRowsKernel<<<BlocksFor(n), 128, 0, s>>>(cache, row_floats, table, block_tokens, p0, n,
                                                     out, vec);
  return cudaGetLastError();
}

cudaError_t MaskedSoftmaxRows(float* scores, int64_t rows, int64_t cols, int64_t group_rows,
                              int64_t q_pos0, int64_t k_pos0, int64_t window, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (group_rows <= 0) return cudaErrorInvalidValue;
  MaskedSoftmaxRowsKernel<<<BlocksFor(rows), kThreads, 0, s>>>(scores, rows, cols, group_rows,
                                                               q_pos0, k_pos0, window);
  return cudaGetLastError();
}

cudaError_t SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                          int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later,
                          cudaStream_t s) {
  if (T <= 0) return cudaSuccess;
  if (K <= 0 || K > 64 || n < 0 || n >= K) return cudaErrorInvalidValue;
  SplitDeferredKernel<<<GridFor(T), kThreads, 0, s>>>(
      ids, w, T, static_cast<int>(K), static_cast<int>(n), ids_now, w_now, ids_later, w_later);
  return cudaGetLastError();
}

cudaError_t WaitHostWord(const uint32_t* word, uint32_t busy_lo, uint32_t busy_hi, uint32_t* abort,
                         uint64_t timeout_ns, unsigned long long* wait_ns, cudaStream_t s) {
  if (word == nullptr || abort == nullptr || busy_lo > busy_hi) return cudaErrorInvalidValue;
  WaitHostWordKernel<<<1, 1, 0, s>>>(word, busy_lo, busy_hi, abort, timeout_ns, wait_ns);
  return cudaGetLastError();
}

cudaError_t SendExpertCall(const uint16_t* hidden, int64_t T, int64_t H, const int32_t* ids,
                           const float* weights, int64_t k, uint16_t* dst_hidden, int32_t* dst_ids,
                           float* dst_weights, uint32_t* state, uint32_t request,
                           const uint32_t* armed, const uint32_t* abort, unsigned int* counter,
                           cudaStream_t s) {
  if (T < 0 || H <= 0 || k <= 0 || state == nullptr || armed == nullptr || counter == nullptr)
    return cudaErrorInvalidValue;
  const int64_t elems = T * H, tk = T * k;
  const bool vec16 = elems % 8 == 0 && reinterpret_cast<uintptr_t>(hidden) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst_hidden) % 16 == 0;
  // About 16 KiB of request per block, at most 64 blocks.
  const int64_t bytes = elems * 2 + tk * 8;
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>((bytes + 16383) / 16384, 1, 64));
  SendExpertCallKernel<<<blocks, kThreads, 0, s>>>(hidden, elems, vec16, ids, weights, tk,
                                                   dst_hidden, dst_ids, dst_weights, state, request,
                                                   armed, abort, counter);
  return cudaGetLastError();
}

namespace {
struct HotScratch {
  int32_t* slot_expert;
  int32_t* token_active;
  float* xs;
  float* hs;
  int8_t* xq;
  int8_t* hq;
  float* h;
  float* ys;
  int64_t bytes;
};
HotScratch CarveHot(void* base, int64_t T, int64_t H, int64_t I, int64_t K) {
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += (bytes + 255) / 256 * 256;
    return static_cast<char*>(base) + at;
  };
  HotScratch s{};
  s.slot_expert = reinterpret_cast<int32_t*>(take(T * K * 4));
  s.token_active = reinterpret_cast<int32_t*>(take(T * 4));
  s.xs = reinterpret_cast<float*>(take(T * 4));
  s.hs = reinterpret_cast<float*>(take(T * K * 4));
  s.xq = reinterpret_cast<int8_t*>(take(T * H));
  s.hq = reinterpret_cast<int8_t*>(take(T * K * I));
  s.h = reinterpret_cast<float*>(take(T * K * I * 4));
  s.ys = reinterpret_cast<float*>(take(T * K * H * 4));
  s.bytes = off;
  return s;
}
}  // namespace

cudaError_t SplitHotIds(const int32_t* ids, int64_t n, const uint8_t* mask, int64_t E,
                        int32_t* cold, int32_t* hot, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  if (ids == nullptr || mask == nullptr || cold == nullptr || hot == nullptr || E <= 0)
    return cudaErrorInvalidValue;
  SplitHotIdsKernel<<<GridFor(n), kThreads, 0, s>>>(ids, n, mask, E, cold, hot);
  return cudaGetLastError();
}

int64_t HotExpertsScratchBytes(int64_t T, int64_t H, int64_t I, int64_t K) {
  return CarveHot(nullptr, T, H, I, K).bytes;
}

cudaError_t HotExperts(const HotExpertsArgs& a, cudaStream_t s) {
  if (a.T == 0) return cudaSuccess;
  if (a.T < 0 || a.H <= 0 || a.I <= 0 || a.K <= 0 || a.E < 0 || a.x == nullptr ||
      a.ids == nullptr || a.weights == nullptr || a.out == nullptr || a.scratch == nullptr ||
      (a.E > 0 && a.experts == nullptr) ||
      a.scratch_bytes < HotExpertsScratchBytes(a.T, a.H, a.I, a.K) || a.H > 12288)
    return cudaErrorInvalidValue;
  const HotScratch w = CarveHot(a.scratch, a.T, a.H, a.I, a.K);
  HotSlotsKernel<<<GridFor(a.T), kThreads, 0, s>>>(a, w.slot_expert, w.token_active);
  QuantRowsKernel<<<static_cast<unsigned>(a.T), kThreads, 0, s>>>(a.x, nullptr, a.H, w.token_active,
                                                                  1, w.xq, w.xs);
  // Row chunks of 16 (8 warps, 2 rows each): enough loads in flight for HBM
  // at batch 1, with a few hot slots per layer.
  const unsigned gu_chunks = static_cast<unsigned>(std::clamp<int64_t>(a.I / 16, 1, 4096));
  HotGateUpKernel<<<dim3(static_cast<unsigned>(a.T * a.K), gu_chunks), kThreads,
                    static_cast<size_t>(a.H) * 4, s>>>(a, w.slot_expert, w.xq, w.xs, w.h);
  QuantRowsKernel<<<static_cast<unsigned>(a.T * a.K), kThreads, 0, s>>>(
      nullptr, w.h, a.I, w.slot_expert, 1, w.hq, w.hs);
  const unsigned dn_chunks = static_cast<unsigned>(std::clamp<int64_t>(a.H / 16, 1, 4096));
  HotDownKernel<<<dim3(static_cast<unsigned>(a.T * a.K), dn_chunks), kThreads, 0, s>>>(
      a, w.slot_expert, w.h, w.hq, w.hs, w.ys);
  HotSumKernel<<<GridFor(a.T * a.H), kThreads, 0, s>>>(a, w.slot_expert, w.ys);
  return cudaGetLastError();
}

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

cudaError_t InjectStickyError(cudaStream_t s) {
  TrapKernel<<<1, 1, 0, s>>>();
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
