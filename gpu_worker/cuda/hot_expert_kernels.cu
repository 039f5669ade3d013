// CUDA kernels behind gpu_worker/cuda/hot_expert_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cmath>
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/hot_expert_kernels.h"
#include "gpu_worker/cuda/native_decode.cuh"

namespace hmoe::cuda {
namespace {

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
  if (IsNativeDev(W.format)) {
    // Native formats: f32 activations against f32(value * scale), as bf16.
    for (int64_t c = lane; c < W.cols; c += 32)
      acc += static_cast<double>(a_f[c]) * static_cast<double>(NativeWeightDev(W, r, c));
  } else if (W.format == WeightFormat::kBf16) {
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
  const bool f32_act = ex.gate.format == WeightFormat::kBf16 || IsNativeDev(ex.gate.format);
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

}  // namespace

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

}  // namespace hmoe::cuda
