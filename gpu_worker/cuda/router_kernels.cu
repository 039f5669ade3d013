// CUDA kernels behind gpu_worker/cuda/router_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cmath>
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/router_kernels.h"

namespace hmoe::cuda {
namespace {

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

}  // namespace

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

cudaError_t SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                          int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later,
                          cudaStream_t s) {
  if (T <= 0) return cudaSuccess;
  if (K <= 0 || K > 64 || n < 0 || n >= K) return cudaErrorInvalidValue;
  SplitDeferredKernel<<<GridFor(T), kThreads, 0, s>>>(
      ids, w, T, static_cast<int>(K), static_cast<int>(n), ids_now, w_now, ids_later, w_later);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
