#include "gpu_worker/driver/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/driver/router_kinds.h"

namespace hmoe {

namespace {

// The router table: one row per RouterKind (router_kinds.h).
constexpr RouterOps kRouters[] = {
    {RouterKind::kSoftmaxTopk, &SoftmaxTopkSpec, &SoftmaxTopkRoute},
    {RouterKind::kSigmoidGroupedTopk, &SigmoidGroupedTopkSpec, &SigmoidGroupedTopkRoute},
};

const RouterOps* FindRouter(RouterKind kind) {
  for (const RouterOps& r : kRouters)
    if (r.kind == kind) return &r;
  return nullptr;
}

}  // namespace

absl::StatusOr<const RouterOps*> RouterOpsFor(RouterKind kind) {
  const RouterOps* r = FindRouter(kind);
  if (r == nullptr)
    return absl::UnimplementedError(absl::StrCat("router kind ", static_cast<int>(kind), " (",
                                                 RouterKindName(kind), ") has no implementation"));
  return r;
}

absl::StatusOr<GateSpec> GateSpecFor(const ModelConfig& config, int layer) {
  if (layer < 0 || layer >= static_cast<int>(config.layers.size()))
    return absl::InvalidArgumentError(
        absl::StrCat("GateSpecFor: layer ", layer, " outside [0, ", config.layers.size(), ")"));
  const RouterKind kind = config.layers[static_cast<size_t>(layer)].router;
  absl::StatusOr<const RouterOps*> r = RouterOpsFor(kind);
  if (!r.ok()) return Annotate(r.status(), absl::StrCat("layer ", layer));
  return (*r)->spec(config);
}

GateSpec GateSpecFor(const ModelConfig& config) {
  const RouterOps* r = FindRouter(KindsOf(config.arch).router);
  return r != nullptr ? r->spec(config) : BaseGateSpec(config, KindsOf(config.arch).router);
}

void Route(const GateSpec& g, const float* logits, int64_t T, const float* bias, int32_t* ids,
           float* weights) {
  const RouterOps* r = FindRouter(g.kind);
  if (r != nullptr) return r->route(g, logits, T, bias, ids, weights);
  std::fill(ids, ids + T * g.top_k, kNoExpert);
  std::fill(weights, weights + T * g.top_k, 0.0f);
}

GateSpec BaseGateSpec(const ModelConfig& c, RouterKind kind) {
  GateSpec g;
  g.kind = kind;
  g.num_experts = c.moe.num_experts;
  g.top_k = c.moe.experts_per_token;
  g.routed_scaling_factor = static_cast<float>(c.moe.routed_scaling_factor);
  return g;
}

void TopkFromScores(const GateSpec& g, ScoreRow score_row, const float* logits, int64_t T,
                    const float* bias, int32_t* ids, float* weights) {
  const int64_t E = g.num_experts, K = g.top_k;
  const int64_t G = std::max<int64_t>(1, g.n_group), per = E / G;
  std::vector<float> scores(E), choice(E), gscore(G);
  std::vector<int64_t> order(std::max(E, G));
  std::vector<char> allowed(E);
  // Indices sorted by descending value, ties to the lower index.
  auto by_value = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  for (int64_t t = 0; t < T; ++t) {
    score_row(logits + t * E, E, scores.data());
    for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + (bias ? bias[e] : 0.0f);
    std::fill(allowed.begin(), allowed.end(), 1);
    if (g.method != TopkMethod::kGreedy && G > 1) {
      for (int64_t gi = 0; gi < G; ++gi) {
        const float* c = choice.data() + gi * per;
        if (g.method == TopkMethod::kNoauxTc) {  // sum of the group's top 2
          float a = -INFINITY, b = -INFINITY;
          for (int64_t j = 0; j < per; ++j) {
            if (c[j] > a) {
              b = a;
              a = c[j];
            } else if (c[j] > b) {
              b = c[j];
            }
          }
          gscore[gi] = a + b;
        } else {  // group_limited_greedy: the group's max
          gscore[gi] = *std::max_element(c, c + per);
        }
      }
      std::iota(order.begin(), order.begin() + G, 0);
      std::partial_sort(order.begin(), order.begin() + g.topk_group, order.begin() + G,
                        by_value(gscore));
      std::fill(allowed.begin(), allowed.end(), 0);
      for (int64_t i = 0; i < g.topk_group; ++i)
        std::fill(allowed.begin() + order[i] * per, allowed.begin() + (order[i] + 1) * per, 1);
    }
    std::vector<int64_t> cand;
    cand.reserve(E);
    for (int64_t e = 0; e < E; ++e)
      if (allowed[e]) cand.push_back(e);
    std::partial_sort(cand.begin(), cand.begin() + K, cand.end(), by_value(choice));
    float sum = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      ids[t * K + j] = static_cast<int32_t>(cand[j]);
      weights[t * K + j] = scores[cand[j]];
      sum += scores[cand[j]];
    }
    for (int64_t j = 0; j < K; ++j) {
      float& w = weights[t * K + j];
      if (g.norm_topk_prob) w /= (sum + g.norm_eps);
      w *= g.routed_scaling_factor;
    }
  }
}

void SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                   int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later) {
  std::vector<int64_t> order(static_cast<size_t>(K));
  std::vector<char> deferred(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    const float* wt = w + t * K;
    const int32_t* id = ids + t * K;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return wt[a] < wt[b] || (wt[a] == wt[b] && a > b); });
    std::fill(deferred.begin(), deferred.end(), 0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = order[static_cast<size_t>(j)];
      deferred[static_cast<size_t>(slot)] = 1;
      ids_later[t * n + j] = id[slot];
      w_later[t * n + j] = wt[slot];
    }
    int64_t kept = 0;
    for (int64_t j = 0; j < K; ++j) {
      if (deferred[static_cast<size_t>(j)]) continue;
      ids_now[t * (K - n) + kept] = id[j];
      w_now[t * (K - n) + kept] = wt[j];
      ++kept;
    }
  }
}

int64_t SplitHot(const int32_t* ids, int64_t n, const uint8_t* hot, int64_t num_experts,
                 int32_t* cold_ids, int32_t* hot_ids) {
  int64_t hot_slots = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    const bool h = e >= 0 && e < num_experts && hot[e] != 0;
    hot_ids[i] = h ? e : kNoExpert;
    cold_ids[i] = h ? kNoExpert : e;
    hot_slots += h ? 1 : 0;
  }
  return hot_slots;
}

}  // namespace hmoe
