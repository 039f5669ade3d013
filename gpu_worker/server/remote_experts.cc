#include "gpu_worker/server/remote_experts.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"

namespace hmoe {

// Whatever went wrong between the worker and the expert service is
// UNAVAILABLE to the client, as api.proto says, except a call the worker
// itself got wrong (the pool's or the service's INVALID_ARGUMENT: NaN router
// weights) or an answer refused for a non-finite value, which is INTERNAL: no client's input is to
// blame (the engine still re-runs the pass request by request, so a NaN from one request fails that
// request only). The message keeps the transport's words. A shard restarted serving something else
// (another format, part, checkpoint or a smaller --max-tokens: the pool's FAILED_PRECONDITION) is
// UNAVAILABLE too. The expert call's deadline is the worker's own --expert-timeout-ms: a miss is
// not the client's DEADLINE_EXCEEDED.
absl::Status PoolRoutedExperts::ExpertFailure(const absl::Status& st) const {
  if (absl::IsInvalidArgument(st)) {
    return absl::InternalError(
        absl::StrCat("the worker's expert call was refused: ", std::string(st.message())));
  }
  // An answer holding a non-finite value (CheckAnswer): INTERNAL too, so that
  // the engine's re-run finds the request whose input produced it.
  if (absl::IsDataLoss(st)) {
    return absl::InternalError(
        absl::StrCat("the expert service's answer was refused: ", std::string(st.message())));
  }
  if (st.ok() || absl::IsUnavailable(st)) return st;
  if (absl::IsDeadlineExceeded(st)) {
    return absl::UnavailableError(absl::StrCat("expert service did not answer within ",
                                               absl::FormatDuration(timeout_), ": ",
                                               std::string(st.message())));
  }
  return absl::UnavailableError(absl::StrCat(
      "expert service: ", absl::StatusCodeToString(st.code()), ": ", std::string(st.message())));
}

absl::StatusOr<std::unique_ptr<PoolRoutedExperts>> PoolRoutedExperts::Create(
    const ModelConfig& c, ExpertPool* pool, absl::Duration call_timeout,
    const std::string& source_fingerprint) {
  const ShardInfo& m = pool->model();
  RETURN_IF_ERROR(CheckServesModel(m, c, "expert service"));
  // Every shard that knows its source (one without a fingerprint, e.g.
  // packed files from before fingerprints, cannot be checked).
  for (const ShardInfo& s : pool->shard_infos()) {
    if (source_fingerprint.empty() || s.source_fingerprint.empty() ||
        source_fingerprint == s.source_fingerprint)
      continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "expert shard ", s.shard_index, "/", s.num_shards,
        " serves the routed experts of another checkpoint (fingerprint ", s.source_fingerprint,
        " there, ", source_fingerprint,
        " in this model's): both sides must load the same model (or hmoe convert of it)"));
  }
  return std::unique_ptr<PoolRoutedExperts>(new PoolRoutedExperts(c, pool, call_timeout));
}

void PoolRoutedExperts::SubmitMore(Pending& p) {
  const int window = pool_->calls_per_ticket();
  const ExpertBatch& b = p.batch;
  while (p.first.ok() && p.next < b.num_tokens && static_cast<int>(p.handles.size()) < window) {
    const int64_t t0 = p.next, n = std::min(p.piece, b.num_tokens - t0);
    const MoeCall call = MoeCall::Make(b.layer, static_cast<int32_t>(n), b.top_k, b.hidden_size,
                                       p.hidden.data() + t0 * b.hidden_size,
                                       b.expert_ids + t0 * b.top_k, b.weights + t0 * b.top_k);
    auto submitted = pool_->Submit(call, p.out + t0 * b.hidden_size, p.deadline);
    if (!submitted.ok()) {
      p.first = submitted.status();
      break;
    }
    p.handles.push_back(*submitted);
    p.next = t0 + n;
  }
}

absl::StatusOr<uint64_t> PoolRoutedExperts::Submit(const ExpertBatch& b, float* out) {
  if (absl::Status st = ValidateExpertBatch(config_, b); !st.ok()) return ExpertFailure(st);
  auto p = std::make_unique<Pending>();
  // bf16 copy for the wire, kept until the last piece is submitted.
  p->hidden.resize(static_cast<size_t>(b.num_tokens * b.hidden_size));
  for (size_t i = 0; i < p->hidden.size(); ++i) p->hidden[i] = F32ToBf16(b.hidden[i]);
  p->batch = b;
  p->out = out;
  p->piece = std::max<int64_t>(1, pool_->model().max_tokens);
  // The call's deadline starts before Submit: a reconnect inside it counts.
  p->deadline = absl::Now() + timeout_;
  SubmitMore(*p);
  if (p->handles.empty() && !p->first.ok()) return ExpertFailure(p->first);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  pending_[ticket] = std::move(p);
  return ticket;
}

absl::Status PoolRoutedExperts::Wait(uint64_t ticket) {
  std::unique_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(ticket);
    if (it == pending_.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown expert ticket ", ticket));
    p = std::move(it->second);
    pending_.erase(it);
  }
  // Oldest piece first; each one waited on frees room for the next piece.
  while (!p->handles.empty()) {
    const uint64_t h = p->handles.front();
    p->handles.pop_front();
    absl::Status st = pool_->Wait(h, p->deadline);
    if (p->first.ok()) p->first = st;
    SubmitMore(*p);
  }
  if (p->first.ok())
    p->first = CheckAnswer(p->out, static_cast<int32_t>(p->batch.num_tokens), p->batch.hidden_size);
  return ExpertFailure(p->first);
}

absl::Status PoolRoutedExperts::Forward(const ExpertBatch& b, float* out) {
  if (b.num_tokens == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint64_t t, Submit(b, out));
  return Wait(t);
}

absl::StatusOr<std::unique_ptr<ExpertSlots>> PoolRoutedExperts::MakeSlots(
    const ExpertSlotsOptions& opts) {
  ExpertSlotsOptions o = opts;
  o.call_timeout = timeout_;
  o.map_failure = [this](const absl::Status& st) { return ExpertFailure(st); };
  return pool_->MakeSlots(o);
}

}  // namespace hmoe
