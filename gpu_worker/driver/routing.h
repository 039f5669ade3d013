// MoE routing semantics: which experts a token goes to and with what weight.
// A router kind (RouterKind, per layer in ModelConfig::layers) is one row of
// the router table (routing.cc): its gate as transformers 5 runs it and its
// Route, the reference every backend's router op implements (cpu: Route;
// cuda: a kernel over the same GateSpec, tested against it). A new kind is
// one file defining its row (router_kinds.h) and that row in the table.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace hmoe {

// One layer's gate: its kind and the kind's parameters.
struct GateSpec {
  RouterKind kind = RouterKind::kSoftmaxTopk;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  TopkMethod method = TopkMethod::kGreedy;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = false;
  float norm_eps = 0.0f;  // added to the top-k sum before normalizing
  float routed_scaling_factor = 1.0f;
};

// A router kind's implementation (a row of the router table).
struct RouterOps {
  RouterKind kind;
  // The gate of `config`'s layers of this kind.
  GateSpec (*spec)(const ModelConfig& config);
  // Routes T tokens from router logits [T, E]: ids/weights [T, k]. `bias`
  // ([E] or null) is added to the scores for selection only. Ties go to the
  // lower expert / group index. Ids come out in descending selection score.
  void (*route)(const GateSpec& g, const float* logits, int64_t T, const float* bias, int32_t* ids,
                float* weights);
};
// The table's row for `kind`; UNIMPLEMENTED naming the kind when it has none.
absl::StatusOr<const RouterOps*> RouterOpsFor(RouterKind kind);

// The gate of `config`'s layer `layer` (its RouterKind's row); errors as
// RouterOpsFor. The kinds' gates, as transformers 5 runs them:
//   deepseek_v3 (sigmoid_grouped_topk): sigmoid, noaux_tc (bias for
//                selection, groups by top-2 sum), norm_topk_prob with +1e-20,
//                x routed_scaling_factor;
//   deepseek_v2 (softmax_topk): greedy or group_limited_greedy (groups by
//                max), never normalized (transformers ignores
//                norm_topk_prob), x routed_scaling_factor;
//   qwen3_moe (softmax_topk): top-k, normalized iff norm_topk_prob;
//   mixtral (softmax_topk): top-k, always normalized.
absl::StatusOr<GateSpec> GateSpecFor(const ModelConfig& config, int layer);
// The gate of `config`'s architecture's MoE layers (kind: its default, as
// ParseModelConfig gives every layer).
GateSpec GateSpecFor(const ModelConfig& config);
// Route by g.kind's row (a kind without one routes nothing: ids kNoExpert,
// weights 0; RouterOpsFor reports it).
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
