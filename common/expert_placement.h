// Hot-expert placement plan: which routed experts of which MoE layers to keep
// on the GPU, from routing statistics (common/routing_stats.h). Greedy by the
// CPU bytes each expert saves per token, whole experts, until the budget is
// full. Pure logic: nothing is loaded or moved here.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/routing_stats.h"

namespace hmoe {

struct PlacementOptions {
  int64_t budget_bytes = 0;  // GPU memory the hot experts may take (>= 0)
  int64_t expert_bytes = 0;  // bytes one routed expert takes on the GPU (> 0; all the same size)
};

struct Placement {
  std::string model_type;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  // Per MoE decoder layer that has hot experts: their ids, ascending.
  std::map<int32_t, std::vector<int32_t>> hot;
  int64_t num_hot = 0;  // experts placed
  int64_t bytes = 0;    // num_hot * expert_bytes (<= budget)
  // Under the stats: the share of routed (layer, expert) selections the hot
  // experts serve, in [0, 1] (sum over placed of count / sum of all counts).
  double hot_fraction = 0;
  // Expected CPU-side bytes read per token saved: sum over placed (l, e) of
  // count(l, e) / tokens_of_layer(l) * expert_bytes, where tokens_of_layer(l)
  // is the sum of layer l's counts / experts_per_token.
  double saved_bytes_per_token = 0;

  bool is_hot(int32_t layer, int32_t expert) const;
  // One line for logs: "N hot experts in L layers, X GiB, Y% of routed traffic".
  std::string Describe() const;
};

// Checks that `stats` describes `config`: the same model_type, num_experts and
// experts_per_token, every layer index an MoE layer of `config` and none
// repeated; else FAILED_PRECONDITION naming the differing field and both
// values. Then places greedily: every (layer, expert) with a count > 0, ranked
// by count / tokens_of_layer (the expected bytes saved per token, over
// expert_bytes), ties to the lower layer, then the lower expert id; taken in
// that order while they fit the budget. Never-routed experts are never placed;
// a layer with all-zero counts contributes nothing. A table with no layers (of
// the right model) or a zero budget gives an empty placement.
// INVALID_ARGUMENT for budget_bytes < 0 or expert_bytes <= 0 (checked before
// the stats), and for a layer whose counts are not num_experts long.
absl::StatusOr<Placement> PlanPlacement(const RoutingTable& stats, const ModelConfig& config,
                                        const PlacementOptions& opts);

// Whether `p` can be used with `config`: the same model_type and expert
// count, every hot layer an MoE layer, every expert id in range;
// FAILED_PRECONDITION naming what differs otherwise. (PlanPlacement's results
// pass; a placement built by hand or for another model may not.)
absl::Status CheckPlacementFits(const Placement& p, const ModelConfig& config);

// Reads a routing-stats file (RoutingTableJson's form) and plans as above.
// Errors name `path`: NOT_FOUND for a missing file (another read error keeps
// its own code), INVALID_ARGUMENT for a malformed one, FAILED_PRECONDITION for
// stats of another model.
absl::StatusOr<Placement> PlanPlacementFromFile(const std::string& path, const ModelConfig& config,
                                                const PlacementOptions& opts);

}  // namespace hmoe
