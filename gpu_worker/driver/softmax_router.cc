// RouterKind::kSoftmaxTopk: softmax scores, plain or group-limited top-k.
#include <algorithm>
#include <cmath>

#include "gpu_worker/driver/router_kinds.h"

namespace hmoe {
namespace {

void SoftmaxRow(const float* l, int64_t E, float* scores) {
  const float mx = *std::max_element(l, l + E);
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(l[e] - mx));
  for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
}

}  // namespace

GateSpec SoftmaxTopkSpec(const ModelConfig& c) {
  GateSpec g = BaseGateSpec(c, RouterKind::kSoftmaxTopk);
  const MoeConfig& m = c.moe;
  switch (c.arch) {
    case Architecture::kDeepseekV3:
    case Architecture::kDeepseekV32:
    case Architecture::kGlmMoeDsa:
    case Architecture::kDeepseekV2:
    case Architecture::kGlm4Moe:
    case Architecture::kDeepseekV4:  // routes with hash / sqrtsoftplus_topk, never this
      g.method = m.topk_method;
      g.n_group = m.n_group;
      g.topk_group = m.topk_group;
      g.norm_topk_prob = false;  // transformers' V2 never renormalizes
      break;
    case Architecture::kQwen3Moe:
      g.norm_topk_prob = m.norm_topk_prob;
      g.routed_scaling_factor = 1.0f;
      break;
    case Architecture::kMixtral:
      g.norm_topk_prob = true;
      g.routed_scaling_factor = 1.0f;
      break;
  }
  if (g.method == TopkMethod::kGreedy) g.n_group = g.topk_group = 1;
  return g;
}

void SoftmaxTopkRoute(const GateSpec& g, const float* logits, int64_t T, const float* bias,
                      int32_t* ids, float* weights) {
  TopkFromScores(g, &SoftmaxRow, logits, T, bias, ids, weights);
}

}  // namespace hmoe
