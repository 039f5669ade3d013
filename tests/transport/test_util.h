// Shared helpers for the transport tests: random MoE calls and the in-process
// reference result.
#pragma once

#include <dirent.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/transport/moe_call.h"

namespace hmoe::testing {

struct RandomCall {
  int32_t layer = 0, tokens = 0, top_k = 0;
  int64_t hidden_dim = 0;
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  MoeCall call() const {
    return MoeCall::Make(layer, tokens, top_k, hidden_dim, hidden.data(), ids.data(),
                         weights.data());
  }
};

inline RandomCall MakeRandomCall(const ShardInfo& info, int32_t layer, int32_t tokens,
                                 uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.05f, 1.f);
  RandomCall r;
  r.layer = layer;
  r.tokens = tokens;
  r.top_k = static_cast<int32_t>(info.top_k);
  r.hidden_dim = info.hidden;
  r.hidden.resize(static_cast<size_t>(tokens * info.hidden));
  for (auto& h : r.hidden) h = F32ToBf16(nd(rng));
  for (int32_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(info.num_experts));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < r.top_k; ++j) {
      r.ids.push_back(all[static_cast<size_t>(j)]);
      r.weights.push_back(ud(rng));
    }
  }
  return r;
}

// max |a - b| / (1 + |b|)
inline double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]) / (1.0 + std::fabs(b[i])));
  }
  return a.size() == b.size() ? m : 1e30;
}

inline int ThreadCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// A shard without weights, for transport tests that need no model: every
// call is validated like a real shard's, then row t of the answer is t + 1
// in every column.
class RowHandler : public MoeHandler {
 public:
  RowHandler() {
    info_.hidden = 32;
    info_.top_k = 2;
    info_.num_experts = 4;
    info_.expert_end = 4;
    info_.max_tokens = 8;
    info_.moe_layers = {0};
  }
  const ShardInfo& info() const override { return info_; }
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override {
    if (absl::Status st = ValidateMoeCall(info_, call); !st.ok()) return st;
    for (int64_t t = 0; t < call.tokens; ++t)
      for (int64_t h = 0; h < info_.hidden; ++h)
        out[t * info_.hidden + h] = static_cast<float>(t + 1);
    if (compute_ns) *compute_ns = 0;
    return absl::OkStatus();
  }

 private:
  ShardInfo info_;
};

}  // namespace hmoe::testing
