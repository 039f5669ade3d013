// RouterKind::kSigmoidGroupedTopk (DeepSeek-V3's noaux_tc): sigmoid scores,
// selection on scores + the correction bias within the best groups.
#include <cmath>

#include "gpu_worker/driver/router_kinds.h"

namespace hmoe {
namespace {

void SigmoidRow(const float* l, int64_t E, float* scores) {
  for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
}

}  // namespace

GateSpec SigmoidGroupedTopkSpec(const ModelConfig& c) {
  GateSpec g = BaseGateSpec(c, RouterKind::kSigmoidGroupedTopk);
  const MoeConfig& m = c.moe;
  g.method = TopkMethod::kNoauxTc;
  g.n_group = m.n_group;
  g.topk_group = m.topk_group;
  g.norm_topk_prob = m.norm_topk_prob;
  g.norm_eps = 1e-20f;
  return g;
}

void SigmoidGroupedTopkRoute(const GateSpec& g, const float* logits, int64_t T, const float* bias,
                             int32_t* ids, float* weights) {
  TopkFromScores(g, &SigmoidRow, logits, T, bias, ids, weights);
}

}  // namespace hmoe
