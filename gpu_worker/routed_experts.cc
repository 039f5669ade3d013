#include "gpu_worker/routed_experts.h"

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::StatusOr<uint64_t> RoutedExperts::Submit(const ExpertBatch& batch, float* out) {
  absl::Status s = Forward(batch, out);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  finished_.emplace(ticket, std::move(s));
  return ticket;
}

absl::Status RoutedExperts::Wait(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = finished_.find(ticket);
  if (it == finished_.end())
    return absl::InvalidArgumentError(absl::StrCat("RoutedExperts::Wait: unknown ticket ", ticket));
  absl::Status s = std::move(it->second);
  finished_.erase(it);
  return s;
}

absl::Status ValidateExpertBatch(const ModelConfig& config, const ExpertBatch& b) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("expert batch for layer ", b.layer, ": ", what));
  };
  if (b.layer < 0 || b.layer >= config.num_layers)
    return bad(absl::StrCat("layer outside [0, ", config.num_layers, ")"));
  if (!config.layers[static_cast<size_t>(b.layer)].moe) return bad("layer has no routed experts");
  if (b.num_tokens < 0) return bad(absl::StrCat("negative token count ", b.num_tokens));
  if (b.hidden_size != config.hidden_size)
    return bad(absl::StrCat("hidden size ", b.hidden_size, ", model has ", config.hidden_size));
  if (b.top_k < 1 || b.top_k > config.moe.num_experts)
    return bad(absl::StrCat("top_k ", b.top_k, " outside [1, ", config.moe.num_experts, "]"));
  if (b.num_tokens > 0 && (!b.hidden || !b.expert_ids || !b.weights))
    return bad("null input pointer");
  for (int64_t i = 0; i < b.num_tokens * b.top_k; ++i) {
    const int32_t id = b.expert_ids[i];
    if (id < 0 || id >= config.moe.num_experts)
      return bad(absl::StrCat("expert id ", id, " (token ", i / b.top_k, ") outside [0, ",
                              config.moe.num_experts, ")"));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
