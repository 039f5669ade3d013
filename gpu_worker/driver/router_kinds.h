// The router kinds' implementations, one file each, and what they share.
// Internal to gpu_worker/driver/: the router table (routing.cc) lists them.
#pragma once

#include <cstdint>

#include "common/model_config.h"
#include "gpu_worker/driver/routing.h"

namespace hmoe {

// softmax_router.cc: RouterKind::kSoftmaxTopk.
GateSpec SoftmaxTopkSpec(const ModelConfig& config);
void SoftmaxTopkRoute(const GateSpec& g, const float* logits, int64_t T, const float* bias,
                      int32_t* ids, float* weights);

// sigmoid_router.cc: RouterKind::kSigmoidGroupedTopk.
GateSpec SigmoidGroupedTopkSpec(const ModelConfig& config);
void SigmoidGroupedTopkRoute(const GateSpec& g, const float* logits, int64_t T, const float* bias,
                             int32_t* ids, float* weights);

// Shared by the kinds (routing.cc).
// A gate of `kind` with config's expert count, top-k and scaling factor.
GateSpec BaseGateSpec(const ModelConfig& config, RouterKind kind);
// One token's scores [E] from its router logits [E].
using ScoreRow = void (*)(const float* logits, int64_t E, float* scores);
// Per token: scores from `score_row`; selection on scores + bias (bias [E]
// or null), within the topk_group best groups when g.method is not greedy
// and n_group > 1 (group_limited_greedy: groups ranked by their max;
// noaux_tc: by the sum of their top 2); weights = the chosen scores,
// divided by (their sum + norm_eps) when norm_topk_prob, times
// routed_scaling_factor.
void TopkFromScores(const GateSpec& g, ScoreRow score_row, const float* logits, int64_t T,
                    const float* bias, int32_t* ids, float* weights);

}  // namespace hmoe
