#include "gpu_worker/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

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

TokenLogprob LogprobOf(absl::Span<const float> logits, int32_t token, int top_n) {
  float max = -std::numeric_limits<float>::infinity();
  for (float l : logits) max = std::max(max, l);
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
  const double log_z = static_cast<double>(max) + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = static_cast<float>(logits[static_cast<size_t>(token)] - log_z);
  if (top_n <= 0) return out;
  // The top_n largest by a small heap: the root is the worst kept one.
  using Entry = std::pair<float, int32_t>;
  auto worse = [](const Entry& a, const Entry& b) {  // a ranks below b
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  auto heap_cmp = [&](const Entry& a, const Entry& b) { return worse(b, a); };
  std::vector<Entry> heap;
  heap.reserve(static_cast<size_t>(top_n) + 1);
  for (size_t i = 0; i < logits.size(); ++i) {
    const Entry e{logits[i], static_cast<int32_t>(i)};
    if (std::isinf(e.first)) continue;  // masked: never an alternative
    if (heap.size() < static_cast<size_t>(top_n)) {
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), heap_cmp);
    } else if (worse(heap.front(), e)) {
      std::pop_heap(heap.begin(), heap.end(), heap_cmp);
      heap.back() = e;
      std::push_heap(heap.begin(), heap.end(), heap_cmp);
    }
  }
  std::sort(heap.begin(), heap.end(), [&](const Entry& a, const Entry& b) { return worse(b, a); });
  for (const Entry& e : heap)
    out.top.emplace_back(e.second, static_cast<float>(static_cast<double>(e.first) - log_z));
  return out;
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
  // A fresh mark per pass over the request's tokens: O(tokens), no hashing,
  // nothing of size V cleared.
  auto next_mark = [&] {
    if (mark_.size() != static_cast<size_t>(V)) {
      mark_.assign(static_cast<size_t>(V), 0);
      count_.assign(static_cast<size_t>(V), 0);
      mark_gen_ = 0;
    }
    if (++mark_gen_ == 0) {
      std::fill(mark_.begin(), mark_.end(), 0);
      mark_gen_ = 1;
    }
  };

  if (p.repetition_penalty != 1.0f) {
    next_mark();
    auto penalize = [&](int32_t t) {
      if (!in_range(t) || mark_[static_cast<size_t>(t)] == mark_gen_) return;
      mark_[static_cast<size_t>(t)] = mark_gen_;
      float& l = work_[static_cast<size_t>(t)];
      if (!std::isfinite(l)) return;  // -inf stays masked
      // A tiny penalty must not turn a logit into +-inf.
      l = std::clamp(l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty,
                     -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
    };
    for (int32_t t : prompt) penalize(t);
    for (int32_t t : output) penalize(t);
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    next_mark();
    for (int32_t t : output) {
      if (!in_range(t)) continue;
      const size_t i = static_cast<size_t>(t);
      if (mark_[i] != mark_gen_) {
        mark_[i] = mark_gen_;
        count_[i] = 0;
      }
      ++count_[i];
    }
    for (int32_t t : output) {
      if (!in_range(t) || count_[static_cast<size_t>(t)] == 0) continue;
      work_[static_cast<size_t>(t)] -=
          p.presence_penalty +
          p.frequency_penalty * static_cast<float>(count_[static_cast<size_t>(t)]);
      count_[static_cast<size_t>(t)] = 0;  // once per distinct token
    }
  }
  if (p.temperature == 0.0f) return Argmax(work_);

  // Candidates: the finite logits; with top_k, those >= the k-th largest
  // (tokens tied with it stay, as transformers' TopKLogitsWarper keeps them).
  // Only what top_p needs is sorted (descending, ties: lower id first): a
  // 129k vocabulary is never sorted whole for one token.
  cands_.clear();
  for (int32_t t = 0; t < V; ++t) {
    const float l = work_[static_cast<size_t>(t)];
    if (std::isfinite(l)) cands_.push_back({l, t, 0.0});
  }
  auto cmp = [](const Candidate& a, const Candidate& b) {
    return a.logit != b.logit ? a.logit > b.logit : a.id < b.id;
  };
  const bool top_k_applied = p.top_k > 0 && static_cast<size_t>(p.top_k) < cands_.size();
  if (top_k_applied) {
    std::nth_element(cands_.begin(), cands_.begin() + (p.top_k - 1), cands_.end(), cmp);
    const float kth = cands_[static_cast<size_t>(p.top_k - 1)].logit;
    cands_.erase(std::partition(cands_.begin(), cands_.end(),
                                [kth](const Candidate& c) { return c.logit >= kth; }),
                 cands_.end());
  }
  float max_l = -std::numeric_limits<float>::infinity();
  for (const Candidate& c : cands_) max_l = std::max(max_l, c.logit);
  // Weights of softmax(l / T), relative to the largest (f64 for stability),
  // once per candidate.
  double sum = 0;
  for (Candidate& c : cands_) {
    c.weight = std::exp((static_cast<double>(c.logit) - max_l) / p.temperature);
    sum += c.weight;
  }
  size_t keep = cands_.size();
  if (p.top_p < 1.0f) {
    const double target = p.top_p * sum;
    // The smallest prefix reaching top_p: sort a few hundred, more if needed.
    size_t m = std::min<size_t>(keep, 256);
    for (;;) {
      std::partial_sort(cands_.begin(), cands_.begin() + static_cast<long>(m), cands_.end(), cmp);
      double acc = 0;
      size_t n = 0;
      while (n < m) {
        acc += cands_[n++].weight;
        if (acc >= target) break;
      }
      if (acc >= target || m == keep) {
        keep = n;
        break;
      }
      m = std::min(keep, m * 8);
    }
  }
  if (p.top_p >= 1.0f && top_k_applied) {
    // top_k's set in nth_element's order, which is the library's: sorted,
    // a seed draws the same token everywhere (without top_k the candidates
    // are in id order already).
    std::sort(cands_.begin(), cands_.begin() + static_cast<long>(keep), cmp);
  }
  if (p.min_p > 0.0f) {
    // The largest weight is 1; keep the order (a sorted prefix stays one).
    const double floor = p.min_p;
    size_t n = 0;
    for (size_t i = 0; i < keep; ++i)
      if (cands_[i].weight >= floor) cands_[n++] = cands_[i];
    keep = n;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += cands_[i].weight;
  // Uniform in [0, total) from 53 random bits: the same on every platform.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += cands_[i].weight;
    if (u < acc) return cands_[i].id;
  }
  return cands_[keep - 1].id;
}

}  // namespace hmoe
