// MoE routing semantics: which experts a token goes to and with what weight,
// per architecture. Route is the reference every backend's router op
// (cpu: this function; cuda: a kernel tested against it) implements.
#pragma once

#include <cstdint>

#include "common/model_config.h"

namespace hmoe {

struct GateSpec {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  ScoringFunc scoring = ScoringFunc::kSoftmax;
  TopkMethod method = TopkMethod::kGreedy;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = false;
  float norm_eps = 0.0f;  // added to the top-k sum before normalizing
  float routed_scaling_factor = 1.0f;
};
// The router semantics of `config`'s architecture as transformers 5 runs it:
//   deepseek_v3: sigmoid, noaux_tc (bias for selection, groups by top-2 sum),
//                norm_topk_prob with +1e-20, x routed_scaling_factor;
//   deepseek_v2: softmax, greedy or group_limited_greedy (groups by max),
//                never normalized (transformers ignores norm_topk_prob),
//                x routed_scaling_factor;
//   qwen3_moe:   softmax, top-k, normalized iff norm_topk_prob;
//   mixtral:     softmax, top-k, always normalized.
GateSpec GateSpecFor(const ModelConfig& config);
// Routes T tokens from router logits [T, E]: ids/weights [T, k]. `bias`
// ([E] or null) is added to the scores for selection only. Ties go to the
// lower expert / group index. Ids come out in descending selection score.
void Route(const GateSpec& g, const float* logits, int64_t T, const float* bias, int32_t* ids,
           float* weights);
// Expert Deferral's split of routed work ids/w [T, K]: per token, the n
// lowest weights (ties: the later slot first) go to ids_later/w_later
// [T, n] in that order; the other K - n keep their order in ids_now/w_now
// [T, K - n]. 0 <= n < K. (The cuda backend's kernel is tested against it.)
void SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                   int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later);
// Hot experts' split of one layer's routed ids [n] (T * K slots, shape kept):
// slot i goes to hot_ids (cold_ids[i] = kNoExpert) when hot[ids[i]] != 0,
// else to cold_ids (hot_ids[i] = kNoExpert); a kNoExpert slot stays empty in
// both. hot: [num_experts] flags. Returns the number of hot slots.
int64_t SplitHot(const int32_t* ids, int64_t n, const uint8_t* hot, int64_t num_experts,
                 int32_t* cold_ids, int32_t* hot_ids);

}  // namespace hmoe
