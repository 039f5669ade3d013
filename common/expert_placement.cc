#include "common/expert_placement.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/small_file.h"
#include "common/status.h"

namespace hmoe {

bool Placement::is_hot(int32_t layer, int32_t expert) const {
  auto it = hot.find(layer);
  return it != hot.end() && std::binary_search(it->second.begin(), it->second.end(), expert);
}

std::string Placement::Describe() const {
  return absl::StrFormat("%d hot experts in %d layers, %.2f GiB, %.1f%% of routed traffic", num_hot,
                         hot.size(), static_cast<double>(bytes) / (1ull << 30),
                         hot_fraction * 100.0);
}

namespace {

using u128 = unsigned __int128;

absl::Status CheckDescribes(const RoutingTable& stats, const ModelConfig& config) {
  auto foreign = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(
        "routing stats for model_type ", stats.model_type.empty() ? "(none)" : stats.model_type,
        " (", stats.num_experts, " experts, top-", stats.experts_per_token,
        ") do not describe this model: ", what));
  };
  if (stats.model_type != config.model_type)
    return foreign(absl::StrCat("model_type is ", config.model_type, ", not ",
                                stats.model_type.empty() ? "(none)" : stats.model_type));
  if (stats.num_experts != config.moe.num_experts)
    return foreign(
        absl::StrCat("num_experts is ", config.moe.num_experts, ", not ", stats.num_experts));
  if (stats.experts_per_token != config.moe.experts_per_token)
    return foreign(absl::StrCat("experts_per_token is ", config.moe.experts_per_token, ", not ",
                                stats.experts_per_token));
  std::set<int32_t> seen;
  for (const RoutingTable::Layer& l : stats.layers) {
    if (l.layer < 0 || static_cast<size_t>(l.layer) >= config.layers.size())
      return foreign(
          absl::StrCat("layer ", l.layer, " is out of range (num_layers ", config.num_layers, ")"));
    if (!config.layers[static_cast<size_t>(l.layer)].moe)
      return foreign(absl::StrCat("layer ", l.layer, " is a dense layer, not an MoE layer"));
    if (!seen.insert(l.layer).second)
      return foreign(absl::StrCat("layer ", l.layer, " appears twice"));
    if (static_cast<int64_t>(l.tokens.size()) != stats.num_experts)
      return absl::InvalidArgumentError(absl::StrCat("routing stats: layer ", l.layer, " holds ",
                                                     l.tokens.size(), " counts, not num_experts (",
                                                     stats.num_experts, ")"));
  }
  return absl::OkStatus();
}

struct Candidate {
  int32_t layer;
  int32_t expert;
  uint64_t count;
  u128 layer_sum;  // > 0
};

// count_a / sum_a > count_b / sum_b, exactly; then lower layer, lower expert.
bool Before(const Candidate& a, const Candidate& b) {
  const u128 lhs = static_cast<u128>(a.count) * b.layer_sum;
  const u128 rhs = static_cast<u128>(b.count) * a.layer_sum;
  if (lhs != rhs) return lhs > rhs;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.expert < b.expert;
}

}  // namespace

absl::StatusOr<Placement> PlanPlacement(const RoutingTable& stats, const ModelConfig& config,
                                        const PlacementOptions& opts) {
  if (opts.budget_bytes < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("placement: budget_bytes must be >= 0, got ", opts.budget_bytes));
  if (opts.expert_bytes <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("placement: expert_bytes must be > 0, got ", opts.expert_bytes));
  RETURN_IF_ERROR(CheckDescribes(stats, config));

  Placement p;
  p.model_type = stats.model_type;
  p.num_experts = stats.num_experts;
  p.experts_per_token = stats.experts_per_token;

  std::vector<Candidate> cands;
  u128 total = 0;
  for (const RoutingTable::Layer& l : stats.layers) {
    u128 sum = 0;
    for (uint64_t c : l.tokens) sum += c;
    total += sum;
    for (size_t e = 0; e < l.tokens.size(); ++e)
      if (l.tokens[e] > 0) cands.push_back({l.layer, static_cast<int32_t>(e), l.tokens[e], sum});
  }
  const int64_t fit = opts.budget_bytes / opts.expert_bytes;
  const size_t take = static_cast<size_t>(std::min<int64_t>(fit, cands.size()));
  if (take == 0) return p;
  std::partial_sort(cands.begin(), cands.begin() + static_cast<std::ptrdiff_t>(take), cands.end(),
                    Before);

  u128 served = 0;
  for (size_t i = 0; i < take; ++i) {
    const Candidate& c = cands[i];
    p.hot[c.layer].push_back(c.expert);
    served += c.count;
    // count / (layer_sum / experts_per_token) * expert_bytes
    p.saved_bytes_per_token += static_cast<double>(c.count) /
                               (static_cast<double>(c.layer_sum) / stats.experts_per_token) *
                               static_cast<double>(opts.expert_bytes);
  }
  for (auto& [layer, ids] : p.hot) std::sort(ids.begin(), ids.end());
  p.num_hot = static_cast<int64_t>(take);
  p.bytes = p.num_hot * opts.expert_bytes;
  p.hot_fraction = static_cast<double>(served) / static_cast<double>(total);
  return p;
}

absl::Status CheckPlacementFits(const Placement& p, const ModelConfig& config) {
  auto foreign = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat("hot-expert placement for ", p.model_type,
                                                      " (", p.num_experts,
                                                      " experts) does not fit this model: ", what));
  };
  if (p.model_type != config.model_type)
    return foreign(absl::StrCat("model_type is ", config.model_type));
  if (p.num_experts != config.moe.num_experts)
    return foreign(absl::StrCat("num_experts is ", config.moe.num_experts));
  for (const auto& [layer, ids] : p.hot) {
    if (layer < 0 || layer >= config.num_layers || !config.layers[static_cast<size_t>(layer)].moe)
      return foreign(absl::StrCat("layer ", layer, " is not an MoE layer"));
    for (int32_t e : ids)
      if (e < 0 || e >= config.moe.num_experts)
        return foreign(absl::StrCat("expert ", e, " of layer ", layer, " is out of range"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Placement> PlanPlacementFromFile(const std::string& path, const ModelConfig& config,
                                                const PlacementOptions& opts) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, kMaxIndexJsonBytes);
  if (!text.ok()) return text.status();
  auto stats = ParseRoutingTable(*text);
  if (!stats.ok()) return Annotate(stats.status(), path);
  auto placed = PlanPlacement(*stats, config, opts);
  if (!placed.ok()) return Annotate(placed.status(), path);
  return placed;
}

}  // namespace hmoe
