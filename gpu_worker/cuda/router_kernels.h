// Routing kernels: router top-k and Expert Deferral's split. Launcher
// conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// Router parameters (hmoe::Route's GateSpec). method: 0 greedy,
// 1 group_limited_greedy (groups by their max), 2 noaux_tc (groups by the sum
// of their top 2).
struct RouteParams {
  int num_experts = 0, top_k = 0;
  bool sigmoid = false;
  int method = 0;
  int n_group = 1, topk_group = 1;
  bool norm = false;
  float norm_eps = 0, scale = 1;
};
// logits [T, E] -> ids/weights [T, K], as hmoe::Route: scores = sigmoid or
// softmax of the logits; selection on scores + bias (bias [E], nullable),
// restricted to the topk_group best groups when method != 0 and n_group > 1;
// ties go to the lower index; ids in descending selection score; weights =
// scores, divided by (their sum + norm_eps) when norm, times scale.
// E <= 512, K <= 16, n_group <= 16 (else cudaErrorInvalidValue).
cudaError_t RouteTokens(const float* logits, int64_t T, const RouteParams& p, const float* bias,
                        int32_t* ids, float* weights, cudaStream_t s);

// Expert Deferral's split, as hmoe::SplitDeferred (driver/routing.h):
// ids/w [T, K] -> the n lowest-weighted per token (ties: the later slot
// first) into ids_later/w_later [T, n], the rest in order into ids_now/w_now
// [T, K - n]. 0 <= n < K <= 64.
cudaError_t SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                          int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later,
                          cudaStream_t s);

}  // namespace hmoe::cuda
