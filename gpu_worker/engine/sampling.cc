#include "gpu_worker/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  auto bad = [](const char* field, float v, const char* rule) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be ", rule, ", got ", v));
  };
  if (!std::isfinite(p.temperature) || p.temperature < 0)
    return bad("temperature", p.temperature, "finite and >= 0");
  if (p.top_k < 0)
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return bad("top_p", p.top_p, "in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return bad("min_p", p.min_p, "in [0, 1]");
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0)
    return bad("repetition_penalty", p.repetition_penalty, "finite and > 0");
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    return bad("presence_penalty", p.presence_penalty, "in [-2, 2]");
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    return bad("frequency_penalty", p.frequency_penalty, "in [-2, 2]");
  return absl::OkStatus();
}

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  return best;
}

Sampler::Sampler(const SamplingParams& params, uint64_t fallback_seed)
    : params_(params), rng_(params.has_seed ? params.seed : fallback_seed) {}

absl::StatusOr<int32_t> Sampler::Sample(absl::Span<const float> logits,
                                        absl::Span<const int32_t> prompt,
                                        absl::Span<const int32_t> output) {
  const SamplingParams& p = params_;
  const int32_t V = static_cast<int32_t>(logits.size());
  bool any_finite = false;
  for (int32_t t = 0; t < V; ++t) {
    const float l = logits[static_cast<size_t>(t)];
    if (std::isnan(l) || l == std::numeric_limits<float>::infinity()) {
      return absl::InternalError(
          absl::StrCat("the forward pass gave token ", t, " the logit ", l, "; nothing to sample"));
    }
    any_finite |= std::isfinite(l);
  }
  if (!any_finite) {
    return absl::InternalError(
        absl::StrCat("the forward pass gave none of the ", V, " tokens a finite logit"));
  }
  work_.assign(logits.begin(), logits.end());
  auto in_range = [&](int32_t t) { return t >= 0 && t < V; };

  if (p.repetition_penalty != 1.0f) {
    std::unordered_set<int32_t> seen;
    for (int32_t t : prompt) seen.insert(t);
    for (int32_t t : output) seen.insert(t);
    for (int32_t t : seen) {
      if (!in_range(t)) continue;
      float& l = work_[static_cast<size_t>(t)];
      if (!std::isfinite(l)) continue;  // -inf stays masked
      // A tiny penalty must not turn a logit into +-inf.
      l = std::clamp(l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty,
                     -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    for (int32_t t : output) ++counts[t];
    for (auto [t, n] : counts) {
      if (!in_range(t)) continue;
      work_[static_cast<size_t>(t)] -=
          p.presence_penalty + p.frequency_penalty * static_cast<float>(n);
    }
  }
  if (p.temperature == 0.0f) return Argmax(work_);

  // Candidates sorted by logit, descending (ties: lower id first).
  order_.resize(static_cast<size_t>(V));
  std::iota(order_.begin(), order_.end(), 0);
  size_t keep = static_cast<size_t>(V);
  if (p.top_k > 0 && p.top_k < V) keep = static_cast<size_t>(p.top_k);
  auto cmp = [&](int32_t a, int32_t b) {
    const float x = work_[static_cast<size_t>(a)], y = work_[static_cast<size_t>(b)];
    return x != y ? x > y : a < b;
  };
  std::partial_sort(order_.begin(), order_.begin() + static_cast<long>(keep), order_.end(), cmp);
  order_.resize(keep);

  // Softmax over the kept candidates at this temperature (f64 for stability).
  const double max_l = work_[static_cast<size_t>(order_[0])];
  std::vector<double> prob(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    prob[i] = std::exp((static_cast<double>(work_[static_cast<size_t>(order_[i])]) - max_l) /
                       p.temperature);
    sum += prob[i];
  }
  for (double& x : prob) x /= sum;
  if (p.top_p < 1.0f) {
    double acc = 0;
    size_t n = 0;
    while (n < keep) {
      acc += prob[n++];
      if (acc >= p.top_p) break;
    }
    keep = n;
  }
  if (p.min_p > 0.0f) {
    const double floor = p.min_p * prob[0];
    size_t n = 1;
    while (n < keep && prob[n] >= floor) ++n;
    keep = n;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += prob[i];
  // Uniform in [0, total) from 53 random bits: the same on every platform.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (u < acc) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace hmoe
