#include "gpu_worker/hot_experts.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/driver/routing.h"

namespace hmoe {

absl::StatusOr<std::unique_ptr<HotColdExperts>> HotColdExperts::Create(const ModelConfig& config,
                                                                       const Placement& placement,
                                                                       RoutedExperts* hot,
                                                                       RoutedExperts* cold) {
  if (hot == nullptr || cold == nullptr)
    return absl::InvalidArgumentError("hot/cold experts: both sides are needed");
  RETURN_IF_ERROR(CheckPlacementFits(placement, config));
  std::unique_ptr<HotColdExperts> h(new HotColdExperts(config, hot, cold));
  h->is_hot_.assign(static_cast<size_t>(config.num_layers), {});
  for (const auto& [layer, ids] : placement.hot) {
    auto& mask = h->is_hot_[static_cast<size_t>(layer)];
    mask.assign(static_cast<size_t>(config.moe.num_experts), 0);
    for (int32_t e : ids) mask[static_cast<size_t>(e)] = 1;
  }
  return h;
}

absl::Status HotColdExperts::Forward(const ExpertBatch& batch, float* out) {
  ASSIGN_OR_RETURN(uint64_t t, Submit(batch, out));
  return Wait(t);
}

absl::StatusOr<uint64_t> HotColdExperts::Submit(const ExpertBatch& b, float* out) {
  RETURN_IF_ERROR(ValidateExpertBatch(config_, b));
  const int64_t n = b.num_tokens * b.top_k, H = b.hidden_size;
  Pending p;
  p.out = out;
  const auto& mask = is_hot_[static_cast<size_t>(b.layer)];
  std::vector<int32_t> cold_ids(static_cast<size_t>(n)), hot_ids(static_cast<size_t>(n));
  int64_t hot_n = 0, cold_n = 0;
  if (mask.empty()) {
    std::copy_n(b.expert_ids, n, cold_ids.begin());
  } else {
    hot_n = SplitHot(b.expert_ids, n, mask.data(), config_.moe.num_experts, cold_ids.data(),
                     hot_ids.data());
  }
  for (int64_t i = 0; i < n; ++i) cold_n += cold_ids[static_cast<size_t>(i)] != kNoExpert ? 1 : 0;
  hot_slots_.fetch_add(static_cast<uint64_t>(hot_n));
  cold_slots_.fetch_add(static_cast<uint64_t>(cold_n));
  if (cold_n > 0) {
    ExpertBatch cb = b;
    cb.expert_ids = cold_ids.data();
    // The cold side reads its ids until Wait: they move into the pending entry.
    ASSIGN_OR_RETURN(p.cold_ticket, cold_->Submit(cb, out));
    p.cold = true;
  } else {
    std::fill(out, out + b.num_tokens * H, 0.0f);
  }
  absl::Status hot_st;
  if (hot_n > 0) {
    ExpertBatch hb = b;
    hb.expert_ids = hot_ids.data();
    p.hot_sum.resize(static_cast<size_t>(b.num_tokens * H));
    hot_st = hot_->Forward(hb, p.hot_sum.data());
  }
  if (!hot_st.ok()) {
    if (p.cold) cold_->Wait(p.cold_ticket).IgnoreError();
    return Annotate(hot_st, "hot experts");
  }
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t t = next_++;
  p.cold_ids = std::move(cold_ids);  // the buffer the cold side reads stays put
  pending_.emplace(t, std::move(p));
  return t;
}

absl::Status HotColdExperts::Wait(uint64_t ticket) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(ticket);
    if (it == pending_.end())
      return absl::InvalidArgumentError(absl::StrCat("hot/cold experts: unknown ticket ", ticket));
    p = std::move(it->second);
    pending_.erase(it);
  }
  RETURN_IF_ERROR(p.cold ? cold_->Wait(p.cold_ticket) : absl::OkStatus());
  for (size_t i = 0; i < p.hot_sum.size(); ++i) p.out[i] += p.hot_sum[i];
  return absl::OkStatus();
}

}  // namespace hmoe
