#include "common/routing_stats.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace hmoe {

uint64_t RoutingTable::routed_tokens() const {
  if (experts_per_token <= 0) return 0;
  uint64_t most = 0;
  for (const Layer& l : layers) {
    uint64_t sum = 0;
    for (uint64_t c : l.tokens) sum += c;
    most = std::max(most, sum);
  }
  return most / static_cast<uint64_t>(experts_per_token);
}

std::string RoutingTableJson(const RoutingTable& t) {
  nlohmann::json j;
  j["format"] = "hmoe-routing-stats-1";
  j["model_type"] = t.model_type;
  j["num_experts"] = t.num_experts;
  j["experts_per_token"] = t.experts_per_token;
  j["tokens"] = t.routed_tokens();
  nlohmann::json layers = nlohmann::json::array();
  for (const RoutingTable::Layer& l : t.layers)
    layers.push_back({{"layer", l.layer}, {"tokens", l.tokens}});
  j["layers"] = std::move(layers);
  return j.dump() + "\n";
}

absl::StatusOr<RoutingTable> ParseRoutingTable(const std::string& text) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("routing stats: ", what));
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (j.value("format", "") != "hmoe-routing-stats-1")
    return bad("format: expected \"hmoe-routing-stats-1\"");
  RoutingTable t;
  if (!j.contains("num_experts") || !j["num_experts"].is_number_integer() ||
      j["num_experts"].get<int64_t>() <= 0)
    return bad("num_experts: a positive integer expected");
  t.num_experts = j["num_experts"].get<int64_t>();
  if (!j.contains("experts_per_token") || !j["experts_per_token"].is_number_integer() ||
      j["experts_per_token"].get<int64_t>() <= 0)
    return bad("experts_per_token: a positive integer expected");
  t.experts_per_token = j["experts_per_token"].get<int64_t>();
  if (j.contains("model_type") && j["model_type"].is_string())
    t.model_type = j["model_type"].get<std::string>();
  if (!j.contains("layers") || !j["layers"].is_array()) return bad("layers: an array expected");
  std::set<int32_t> seen;
  for (const auto& l : j["layers"]) {
    if (!l.is_object() || !l.contains("layer") || !l["layer"].is_number_integer() ||
        l["layer"].get<int64_t>() < 0)
      return bad("layers[].layer: a layer index expected");
    RoutingTable::Layer out;
    out.layer = l["layer"].get<int32_t>();
    if (!seen.insert(out.layer).second) return bad(absl::StrCat("layer ", out.layer, " twice"));
    if (!l.contains("tokens") || !l["tokens"].is_array() ||
        static_cast<int64_t>(l["tokens"].size()) != t.num_experts)
      return bad(absl::StrCat("layer ", out.layer, ": tokens must hold num_experts (",
                              t.num_experts, ") counts"));
    for (const auto& c : l["tokens"]) {
      if (!c.is_number_unsigned() && !(c.is_number_integer() && c.get<int64_t>() >= 0))
        return bad(absl::StrCat("layer ", out.layer, ": counts must be integers >= 0"));
      out.tokens.push_back(c.get<uint64_t>());
    }
    t.layers.push_back(std::move(out));
  }
  return t;
}

RoutingCounters::RoutingCounters(std::vector<int32_t> moe_layers, int64_t num_experts)
    : layers_(std::move(moe_layers)), experts_(num_experts) {
  std::sort(layers_.begin(), layers_.end());
  const int32_t top = layers_.empty() ? -1 : layers_.back();
  row_.assign(static_cast<size_t>(top + 1), -1);
  for (size_t i = 0; i < layers_.size(); ++i)
    row_[static_cast<size_t>(layers_[i])] = static_cast<int>(i);
  const size_t n = layers_.size() * static_cast<size_t>(std::max<int64_t>(0, experts_));
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(n);
  for (size_t i = 0; i < n; ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void RoutingCounters::Add(int32_t layer, const int32_t* ids, int64_t n) {
  if (layer < 0 || static_cast<size_t>(layer) >= row_.size() ||
      row_[static_cast<size_t>(layer)] < 0)
    return;
  std::atomic<uint64_t>* row =
      counts_.get() + static_cast<int64_t>(row_[static_cast<size_t>(layer)]) * experts_;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = ids[i];
    if (e >= 0 && e < experts_) row[e].fetch_add(1, std::memory_order_relaxed);
  }
}

void RoutingCounters::MoveTo(RoutingCounters* to) {
  const size_t n = layers_.size() * static_cast<size_t>(std::max<int64_t>(0, experts_));
  for (size_t i = 0; i < n; ++i) {
    // Most of a pass's counts are 0: read before writing.
    const uint64_t v = counts_[i].load(std::memory_order_relaxed);
    if (v == 0) continue;
    counts_[i].store(0, std::memory_order_relaxed);
    to->counts_[i].fetch_add(v, std::memory_order_relaxed);
  }
}

void RoutingCounters::Clear() {
  const size_t n = layers_.size() * static_cast<size_t>(std::max<int64_t>(0, experts_));
  for (size_t i = 0; i < n; ++i) counts_[i].store(0, std::memory_order_relaxed);
}

RoutingTable RoutingCounters::Snapshot(const std::string& model_type,
                                       int64_t experts_per_token) const {
  RoutingTable t;
  t.model_type = model_type;
  t.num_experts = experts_;
  t.experts_per_token = experts_per_token;
  for (size_t i = 0; i < layers_.size(); ++i) {
    RoutingTable::Layer l;
    l.layer = layers_[i];
    for (int64_t e = 0; e < experts_; ++e)
      l.tokens.push_back(
          counts_[static_cast<int64_t>(i) * experts_ + e].load(std::memory_order_relaxed));
    t.layers.push_back(std::move(l));
  }
  return t;
}

}  // namespace hmoe
