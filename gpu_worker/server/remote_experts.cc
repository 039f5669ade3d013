#include "gpu_worker/server/remote_experts.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"

namespace hmoe {

// Whatever went wrong between the worker and the expert service, other than
// a call the worker itself got wrong (INVALID_ARGUMENT), is UNAVAILABLE to
// the client, as api.proto says; the message keeps the transport's words.
// The expert call's deadline is the worker's own --expert-timeout-ms: a miss
// is not the client's DEADLINE_EXCEEDED.
absl::Status PoolRoutedExperts::ExpertFailure(const absl::Status& st) const {
  if (st.ok() || absl::IsInvalidArgument(st) || absl::IsUnavailable(st)) return st;
  if (absl::IsDeadlineExceeded(st)) {
    return absl::UnavailableError(absl::StrCat("expert service did not answer within ",
                                               absl::FormatDuration(timeout_), ": ",
                                               std::string(st.message())));
  }
  return absl::UnavailableError(absl::StrCat(
      "expert service: ", absl::StatusCodeToString(st.code()), ": ", std::string(st.message())));
}

absl::StatusOr<std::unique_ptr<PoolRoutedExperts>> PoolRoutedExperts::Create(
    const ModelConfig& c, ExpertPool* pool, absl::Duration call_timeout) {
  const ShardInfo& m = pool->model();
  auto mismatch = [&](const char* what, int64_t ours, int64_t theirs) {
    return absl::FailedPreconditionError(
        absl::StrCat("expert service serves a different model: ", what, " ", theirs, " there, ",
                     ours, " in ", c.model_type, " config"));
  };
  if (m.hidden != c.hidden_size) return mismatch("hidden size", c.hidden_size, m.hidden);
  if (m.num_experts != c.moe.num_experts)
    return mismatch("routed experts", c.moe.num_experts, m.num_experts);
  if (m.intermediate != c.moe.intermediate_size)
    return mismatch("expert intermediate size", c.moe.intermediate_size, m.intermediate);
  if (m.top_k < c.moe.experts_per_token) return mismatch("top-k", c.moe.experts_per_token, m.top_k);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.layers[static_cast<size_t>(l)].moe) continue;
    if (std::find(m.moe_layers.begin(), m.moe_layers.end(), l) == m.moe_layers.end())
      return absl::FailedPreconditionError(
          absl::StrCat("expert service does not serve MoE layer ", l));
  }
  return std::unique_ptr<PoolRoutedExperts>(new PoolRoutedExperts(c, pool, call_timeout));
}

absl::StatusOr<uint64_t> PoolRoutedExperts::Submit(const ExpertBatch& b, float* out) {
  RETURN_IF_ERROR(ValidateExpertBatch(config_, b));
  // bf16 copy for the wire; the transport has consumed it when Submit returns.
  std::vector<uint16_t> hidden(static_cast<size_t>(b.num_tokens * b.hidden_size));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = F32ToBf16(b.hidden[i]);
  const MoeCall call = MoeCall::Make(b.layer, static_cast<int32_t>(b.num_tokens), b.top_k,
                                     b.hidden_size, hidden.data(), b.expert_ids, b.weights);
  // The call's deadline starts before Submit: a reconnect inside it counts.
  const absl::Time deadline = absl::Now() + timeout_;
  auto submitted = pool_->Submit(call, out, deadline);
  if (!submitted.ok()) return ExpertFailure(submitted.status());
  const uint64_t handle = *submitted;
  std::lock_guard<std::mutex> lock(mu_);
  deadlines_[handle] = deadline;
  return handle;
}

absl::Status PoolRoutedExperts::Wait(uint64_t ticket) {
  absl::Time deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = deadlines_.find(ticket);
    if (it == deadlines_.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown expert ticket ", ticket));
    deadline = it->second;
    deadlines_.erase(it);
  }
  return ExpertFailure(pool_->Wait(ticket, deadline));
}

absl::Status PoolRoutedExperts::Forward(const ExpertBatch& b, float* out) {
  if (b.num_tokens == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint64_t t, Submit(b, out));
  return Wait(t);
}

}  // namespace hmoe
