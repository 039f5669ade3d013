#include "gpu_worker/routed_experts.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"

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

namespace {

// Slots whose calls are RoutedExperts::Submit / Wait in this process.
class InProcessSlots final : public HostMemorySlots {
 public:
  InProcessSlots(RoutedExperts* experts, int64_t hidden, const ExpertSlotsOptions& opts)
      : HostMemorySlots(hidden, opts),
        experts_(experts),
        tickets_(static_cast<size_t>(opts.num_slots)),
        wide_(static_cast<size_t>(opts.num_slots)) {}
  const char* kind() const override { return "in-process"; }

 private:
  absl::Status DoSubmit(int slot, int32_t layer, int32_t tokens, int32_t top_k,
                        absl::Time) override {
    const SlotView v = view(slot);
    std::vector<float>& f = wide_[static_cast<size_t>(slot)];
    const int64_t n = static_cast<int64_t>(tokens) * hidden();
    f.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) f[static_cast<size_t>(i)] = Bf16ToF32(v.hidden[i]);
    const ExpertBatch b{.layer = layer,
                        .num_tokens = tokens,
                        .hidden_size = hidden(),
                        .hidden = f.data(),
                        .top_k = top_k,
                        .expert_ids = v.ids,
                        .weights = v.weights};
    ASSIGN_OR_RETURN(tickets_[static_cast<size_t>(slot)],
                     experts_->Submit(b, const_cast<float*>(v.out)));
    return absl::OkStatus();
  }
  absl::Status DoWait(int slot, absl::Time) override {
    return experts_->Wait(tickets_[static_cast<size_t>(slot)]);
  }
  RoutedExperts* experts_;
  std::vector<uint64_t> tickets_;
  std::vector<std::vector<float>> wide_;  // per slot: hidden as f32, alive until Wait
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertSlots>> RoutedExperts::MakeSlots(
    const ExpertSlotsOptions& opts) {
  if (opts.hidden <= 0) return absl::InvalidArgumentError("expert slots: hidden size <= 0");
  if (opts.num_slots <= 0 || opts.max_tokens <= 0 || opts.top_k <= 0)
    return absl::InvalidArgumentError("expert slots: num_slots, max_tokens and top_k must be > 0");
  auto s = std::make_unique<InProcessSlots>(this, opts.hidden, opts);
  RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<ExpertSlots>(std::move(s));
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
    if ((id < 0 && id != kNoExpert) || id >= config.moe.num_experts)
      return bad(absl::StrCat("expert id ", id, " (token ", i / b.top_k, ") outside [0, ",
                              config.moe.num_experts, ") and not ", kNoExpert, " (no expert)"));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
