// Routing statistics: tokens routed to each routed expert of each MoE layer,
// as the model counts them (gpu_worker) and as they travel (the Stats RPC,
// `hmoe stats --save`, the worker's --routing-stats-out) to what places hot
// experts. One JSON form:
//
//   {"format": "hmoe-routing-stats-1", "model_type": "qwen3_moe",
//    "num_experts": 128, "experts_per_token": 8, "tokens": 1234,
//    "layers": [{"layer": 0, "tokens": [c_0, ..., c_127]}, ...]}
//
// "tokens" at the top is the number of token rows routed per MoE layer (the
// largest layer sum divided by experts_per_token); a layer's counts are how
// many of them chose each expert.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe {

struct RoutingTable {
  std::string model_type;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  struct Layer {
    int32_t layer = 0;
    std::vector<uint64_t> tokens;  // [num_experts]
  };
  std::vector<Layer> layers;  // ascending layer index from Snapshot; a file's order from Parse
  // Token rows routed per MoE layer (max over layers of sum / experts_per_token).
  uint64_t routed_tokens() const;
};

std::string RoutingTableJson(const RoutingTable& t);
// INVALID_ARGUMENT naming the field for anything but the form above
// (counts of the wrong length, a layer twice, a wrong format tag).
absl::StatusOr<RoutingTable> ParseRoutingTable(const std::string& json);

// The live counters: lock-free adds from any thread (a pass, a CUDA host
// node), snapshots from any other.
class RoutingCounters {
 public:
  // One row of counters per entry of `moe_layers` (decoder layer indices).
  RoutingCounters(std::vector<int32_t> moe_layers, int64_t num_experts);
  // Counts `n` expert ids routed in decoder layer `layer`; a layer that is
  // not counted and ids out of range are ignored.
  void Add(int32_t layer, const int32_t* ids, int64_t n);
  // The counts now, with the model's identity filled in by the caller.
  RoutingTable Snapshot(const std::string& model_type, int64_t experts_per_token) const;
  // Adds these counts to `to` (made with the same layers and number of
  // experts) and zeroes them here: a pass's tally committed to the totals.
  // Not atomic as a whole: no Add to this object may run meanwhile.
  void MoveTo(RoutingCounters* to);
  // Zeroes every count (a pass's tally dropped). No Add may run meanwhile.
  void Clear();

 private:
  std::vector<int32_t> layers_;
  std::vector<int> row_;  // decoder layer -> row, -1 if not counted
  int64_t experts_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
};

}  // namespace hmoe
