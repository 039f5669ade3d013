// CUDA kernels behind gpu_worker/cuda/paged_attention_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/kv_store.cuh"
#include "gpu_worker/cuda/paged_attention_kernels.h"

namespace hmoe::cuda {
namespace {

__global__ void StoreKvRowsKernel(const float* k, const float* v, int64_t T, const int32_t* slot,
                                  KvRows kc, KvRows vc) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t sl = slot[t];
    if (sl < 0) continue;
    StoreKvRow(k + t * kc.row, kc, sl);
    StoreKvRow(v + t * vc.row, vc, sl);
  }
}

template <KvElem E>
__global__ void GatherKvRowsKernel(KvRows c, const int32_t* table, int64_t bt, int64_t p0,
                                   int64_t n, float* out, bool vec) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t p = p0 + i;
    const int64_t row = static_cast<int64_t>(table[p / bt]) * bt + p % bt;
    float* dst = out + i * c.row;
    if (vec) {
      for (int64_t e = 4 * threadIdx.x; e < c.row; e += 4 * blockDim.x)
        *reinterpret_cast<float4*>(dst + e) =
            KvLoad4<E>(c.data, c.scale, c.row, c.part_len, c.parts, row, e);
    } else {
      for (int64_t e = threadIdx.x; e < c.row; e += blockDim.x)
        dst[e] = KvLoad<E>(c.data, c.scale, c.row, c.part_len, c.parts, row, e);
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
  l.shared_kv = a.v_cache == a.k_cache && a.v_scale == a.k_scale && a.v_row == a.k_row &&
                a.v_head_offset == a.k_head_offset && a.dv <= a.dk;
  l.vs = l.shared_kv ? 0 : PaddedStride(a.dv);
  l.smem_bytes =
      sizeof(float) * (static_cast<size_t>(l.hpb) * l.dkp + kKeyTile * static_cast<size_t>(l.ks) +
                       kKeyTile * static_cast<size_t>(l.vs));
  return l;
}

// Copies the rows of a tile (32 cache rows: n elements from element `off`
// of each, decoded to f32) into shared memory; rows past the visible range
// become zeros.
template <KvElem E>
__device__ __forceinline__ void LoadTile(const void* data, const float* scale, int64_t row_len,
                                         int64_t off, int64_t n, const PagedAttentionArgs& a,
                                         bool vec, int stride, float* dst, int64_t p0, int64_t pos,
                                         const int32_t* table) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t bt = a.block_tokens;
  for (int j = warp; j < kKeyTile; j += nw) {
    const int64_t p = p0 + j;
    float* d = dst + j * stride;
    if (p > pos) {
      for (int64_t i = lane; i < n; i += 32) d[i] = 0.0f;
      continue;
    }
    const int64_t row = static_cast<int64_t>(table[p / bt]) * bt + p % bt;
    if (vec) {
      float4* d4 = reinterpret_cast<float4*>(d);
      for (int64_t i = lane; i < n / 4; i += 32)
        d4[i] = KvLoad4<E>(data, scale, row_len, a.kv_part_len, a.kv_parts, row, off + 4 * i);
    } else {
      for (int64_t i = lane; i < n; i += 32)
        d[i] = KvLoad<E>(data, scale, row_len, a.kv_part_len, a.kv_parts, row, off + i);
    }
  }
}

template <int kDvChunks, KvElem E>
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
    LoadTile<E>(a.k_cache, a.k_scale, a.k_row, g * a.k_head_offset, a.dk, a, vec_k, l.ks, kt, p0,
                pos, table);
    if (!l.shared_kv)
      LoadTile<E>(a.v_cache, a.v_scale, a.v_row, g * a.v_head_offset, a.dv, a, vec_v, l.vs, vt, p0,
                  pos, table);
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

template <int kDvChunks, KvElem E>
cudaError_t LaunchAttention(const PagedAttentionArgs& a, const AttnLayout& l, cudaStream_t s) {
  const auto kernel = PagedAttentionKernel<kDvChunks, E>;
  if (l.smem_bytes > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(l.smem_bytes));
    if (e != cudaSuccess) return e;
  }
  // Four elements at a time: aligned, and (fp8) never across a part's end.
  const auto aligned = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % (4 * KvElemBytes(E)) == 0;
  };
  const bool parts4 = E != KvElem::kFp8 || a.kv_part_len % 4 == 0;
  const bool vec_k =
      parts4 && a.dk % 4 == 0 && a.k_row % 4 == 0 && a.k_head_offset % 4 == 0 && aligned(a.k_cache);
  const bool vec_v =
      parts4 && a.dv % 4 == 0 && a.v_row % 4 == 0 && a.v_head_offset % 4 == 0 && aligned(a.v_cache);
  const dim3 grid(static_cast<unsigned>(a.T * a.num_kv_heads * l.chunks),
                  static_cast<unsigned>(l.splits));
  kernel<<<grid, l.hpb * 32, l.smem_bytes, s>>>(a, l, vec_k, vec_v);
  return cudaGetLastError();
}

template <KvElem E>
cudaError_t LaunchFor(const PagedAttentionArgs& a, const AttnLayout& l, cudaStream_t s) {
  if (a.dv <= 128) return LaunchAttention<4, E>(a, l, s);
  if (a.dv <= 256) return LaunchAttention<8, E>(a, l, s);
  return LaunchAttention<16, E>(a, l, s);
}

}  // namespace

cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, const int32_t* slot,
                         const KvRows& kc, const KvRows& vc, cudaStream_t s) {
  if (T <= 0 || kc.row <= 0) return cudaSuccess;
  if (vc.row != kc.row || (kc.elem == KvElem::kFp8 && (kc.part_len <= 0 || kc.parts <= 0)) ||
      (vc.elem == KvElem::kFp8 && (vc.part_len <= 0 || vc.parts <= 0)))
    return cudaErrorInvalidValue;
  StoreKvRowsKernel<<<BlocksFor(T), kThreads, 0, s>>>(k, v, T, slot, kc, vc);
  return cudaGetLastError();
}

cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, int64_t row,
                         const int32_t* slot, float* kcache, float* vcache, cudaStream_t s) {
  KvRows kc, vc;
  kc.data = kcache;
  kc.row = row;
  vc.data = vcache;
  vc.row = row;
  return WriteKvCache(k, v, T, slot, kc, vc, s);
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
      args.dk > kMaxDk || args.dv <= 0 || args.dv > kMaxDv || args.block_tokens <= 0 ||
      (args.kv == KvElem::kFp8 && (args.kv_part_len <= 0 || args.kv_parts <= 0)))
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
  if (a.kv == KvElem::kBf16) {
    e = LaunchFor<KvElem::kBf16>(a, l, s);
  } else if (a.kv == KvElem::kFp8) {
    e = LaunchFor<KvElem::kFp8>(a, l, s);
  } else {
    e = LaunchFor<KvElem::kF32>(a, l, s);
  }
  if (e != cudaSuccess || l.splits == 1) return e;
  AttentionMergeKernel<<<BlocksFor(a.T * a.num_heads), 128, 0, s>>>(a, l.splits);
  return cudaGetLastError();
}

cudaError_t GatherPagedRows(const float* cache, int64_t row_floats, const int32_t* table,
                            int64_t block_tokens, int64_t p0, int64_t n, float* out,
                            cudaStream_t s) {
  KvRows c;
  c.data = const_cast<float*>(cache);
  c.row = row_floats;
  return GatherPagedRows(c, table, block_tokens, p0, n, out, s);
}

cudaError_t GatherPagedRows(const KvRows& c, const int32_t* table, int64_t block_tokens, int64_t p0,
                            int64_t n, float* out, cudaStream_t s) {
  if (n <= 0 || c.row <= 0) return cudaSuccess;
  if (block_tokens <= 0 || p0 < 0 || (c.elem == KvElem::kFp8 && (c.part_len <= 0 || c.parts <= 0)))
    return cudaErrorInvalidValue;
  const bool vec =
      c.row % 4 == 0 && reinterpret_cast<uintptr_t>(c.data) % (4 * KvElemBytes(c.elem)) == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0 && (c.elem != KvElem::kFp8 || c.part_len % 4 == 0);
  const unsigned blocks = BlocksFor(n);
  if (c.elem == KvElem::kBf16) {
    GatherKvRowsKernel<KvElem::kBf16>
        <<<blocks, 128, 0, s>>>(c, table, block_tokens, p0, n, out, vec);
  } else if (c.elem == KvElem::kFp8) {
    GatherKvRowsKernel<KvElem::kFp8>
        <<<blocks, 128, 0, s>>>(c, table, block_tokens, p0, n, out, vec);
  } else {
    GatherKvRowsKernel<KvElem::kF32>
        <<<blocks, 128, 0, s>>>(c, table, block_tokens, p0, n, out, vec);
  }
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

}  // namespace hmoe::cuda
