#include "gpu_worker/transport/expert_pool.h"

#include <algorithm>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/transport/shm_client.h"
#include "gpu_worker/transport/ucx_client.h"

namespace hmoe {

const char* TransportKindName(TransportKind t) {
  switch (t) {
    case TransportKind::kGrpc:
      return "grpc";
    case TransportKind::kShm:
      return "shm";
    case TransportKind::kUcx:
      return "ucx";
  }
  return "?";
}

absl::StatusOr<TransportKind> ParseTransportKind(const std::string& s) {
  if (s == "grpc") return TransportKind::kGrpc;
  if (s == "shm") return TransportKind::kShm;
  if (s == "ucx") return TransportKind::kUcx;
  return absl::InvalidArgumentError(absl::StrCat("transport: \"", s, "\" is not grpc, shm or ucx"));
}

// A shard's ExpertCallLedger: the slots' calls are the pool's.
class ExpertPool::ShardLedger final : public ExpertCallLedger {
 public:
  ShardLedger(ExpertPool* pool, int shard) : pool_(pool), shard_(shard) {}
  absl::Status Admit() override {
    return Annotate(pool_->FailingFast(pool_->shards_[static_cast<size_t>(shard_)]), Where());
  }
  void Ended(const SlotCallEnd& e) override {
    pool_->Account(shard_, e.status, e.sent, /*late=*/false, e.took, e.tokens, e.top_k);
  }
  void Reconnected(const absl::Status& st) override {
    std::lock_guard<std::mutex> lock(pool_->mu_);
    Shard& sh = pool_->shards_[static_cast<size_t>(shard_)];
    if (st.ok()) {
      sh.up = true;
      sh.data_loss_streak = 0;
    } else if (absl::IsUnavailable(st) || absl::IsUnauthenticated(st) ||
               absl::IsPermissionDenied(st) || absl::IsFailedPrecondition(st)) {
      sh.up = false;
    }
    if (sh.up_gauge) sh.up_gauge->Set(sh.up ? 1 : 0);
  }

 private:
  std::string Where() const {
    return absl::StrCat("expert shard ", shard_, " (",
                        pool_->shards_[static_cast<size_t>(shard_)].target, ")");
  }
  ExpertPool* pool_;
  int shard_;
};

absl::StatusOr<std::unique_ptr<ExpertPool>> ExpertPool::Connect(const ExpertPoolOptions& opts) {
  if (opts.targets.empty()) return absl::InvalidArgumentError("targets: no shards given");
  auto pool = std::unique_ptr<ExpertPool>(new ExpertPool());
  pool->fail_fast_after_miss_ = opts.fail_fast_after_miss;
  pool->fail_fast_after_failed_check_ = opts.fail_fast_after_failed_check;
  pool->transport_ = opts.transport;
  pool->max_in_flight_ =
      opts.transport == TransportKind::kShm ? static_cast<int>(opts.shm_slots) : 0;
  std::vector<Shard> shards(opts.targets.size());
  for (size_t i = 0; i < opts.targets.size(); ++i) {
    Shard s;
    s.target = opts.targets[i];
    s.control = std::make_shared<ControlClient>(
        MakeExpertChannel(s.target, opts.auth_tokens, opts.credentials));
    const absl::Time until = absl::Now() + opts.connect_timeout;
    absl::StatusOr<ShardInfo> info;
    while (true) {
      info = s.control->Describe(absl::Seconds(1));
      // A refused token will not be accepted later: no retry.
      if (info.ok() || absl::Now() >= until || absl::IsUnauthenticated(info.status())) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!info.ok()) {
      return Annotate(info.status(), absl::StrCat("expert shard ", s.target));
    }
    s.info = *info;
    const int idx = s.info.shard_index;
    if (s.info.num_shards != static_cast<int>(opts.targets.size()) || idx < 0 ||
        idx >= s.info.num_shards || !shards[static_cast<size_t>(idx)].target.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert shard ", s.target, " is shard ", idx, "/", s.info.num_shards, ", but ",
          opts.targets.size(), " targets were given (or the index repeats)"));
    }
    const ShardInfo& a = s.info;
    for (const Shard& o : shards) {
      if (o.target.empty()) continue;
      const ShardInfo& c = o.info;
      if (c.hidden != a.hidden || c.intermediate != a.intermediate ||
          c.num_experts != a.num_experts || c.top_k != a.top_k || c.moe_layers != a.moe_layers ||
          c.split != a.split || c.weight_format != a.weight_format) {
        return absl::FailedPreconditionError(
            absl::StrCat("expert shards ", o.target, " and ", s.target, " serve different models"));
      }
      if (!c.source_fingerprint.empty() && !a.source_fingerprint.empty() &&
          c.source_fingerprint != a.source_fingerprint) {
        return absl::FailedPreconditionError(
            absl::StrCat("expert shards ", o.target, " and ", s.target,
                         " serve routed experts of different checkpoints (fingerprints ",
                         c.source_fingerprint, " vs ", a.source_fingerprint, ")"));
      }
      if (!c.conversion_id.empty() && !a.conversion_id.empty() &&
          c.conversion_id != a.conversion_id) {
        return absl::FailedPreconditionError(absl::StrCat(
            "expert shards ", o.target, " and ", s.target,
            " serve packed files of different conversions (", c.conversion_id, " vs ",
            a.conversion_id, "): convert the model once, into one directory, for all shards"));
      }
    }
    shards[static_cast<size_t>(idx)] = std::move(s);
  }
  pool->model_ = shards[0].info;
  pool->model_.max_tokens = shards[0].info.max_tokens;
  for (Shard& s : shards) {
    pool->model_.max_tokens = std::min(pool->model_.max_tokens, s.info.max_tokens);
    switch (opts.transport) {
      case TransportKind::kGrpc:
        s.client = std::make_unique<GrpcStreamClient>(
            MakeExpertChannel(s.target, opts.auth_tokens, opts.credentials), s.info.hidden,
            GrpcStreamClient::kDefaultMaxQueuedBytes,
            GrpcStreamClient::ReconnectCheck{s.control, s.info});
        break;
      case TransportKind::kShm: {
        ShmClientOptions so;
        so.slots = opts.shm_slots;
        auto c = ShmClient::Create(s.control, s.info, so);
        if (!c.ok()) return Annotate(c.status(), absl::StrCat("expert shard ", s.target));
        s.client = std::move(*c);
        break;
      }
      case TransportKind::kUcx: {
        auto c = UcxClient::Create(s.control, s.info, opts.ucx);
        if (!c.ok()) return Annotate(c.status(), absl::StrCat("expert shard ", s.target));
        s.client = std::move(*c);
        break;
      }
    }
  }
  pool->shards_ = std::move(shards);
  for (size_t i = 0; i < pool->shards_.size(); ++i)
    pool->ledgers_.push_back(std::make_unique<ShardLedger>(pool.get(), static_cast<int>(i)));
  if (opts.metrics != nullptr) RETURN_IF_ERROR(pool->RegisterMetrics(*opts.metrics));
  return pool;
}

absl::Status ExpertPool::RegisterMetrics(MetricsRegistry& reg) {
  ASSIGN_OR_RETURN(CounterFamily calls,
                   reg.AddCounterFamily("hmoe_expert_calls_total",
                                        "Expert calls per shard, by outcome (the status code).",
                                        {"transport", "shard", "outcome"}));
  ASSIGN_OR_RETURN(
      HistogramFamily seconds,
      reg.AddHistogramFamily("hmoe_expert_call_seconds",
                             "Expert call latency per shard: from Submit to Wait seeing the "
                             "shard's answer.",
                             {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                              0.25, 0.5, 1, 2.5, 5, 10},
                             {"transport", "shard"}));
  ASSIGN_OR_RETURN(GaugeFamily up, reg.AddGaugeFamily("hmoe_expert_shard_up",
                                                      "1 while the last call or health check "
                                                      "found the expert shard serving, else 0.",
                                                      {"shard"}));
  ASSIGN_OR_RETURN(CounterFamily tokens,
                   reg.AddCounterFamily("hmoe_expert_call_tokens_total",
                                        "Token rows of the expert calls sent to each shard.",
                                        {"transport", "shard"}));
  ASSIGN_OR_RETURN(CounterFamily bytes,
                   reg.AddCounterFamily("hmoe_expert_call_bytes_total",
                                        "Payload bytes of the expert calls sent to each shard: "
                                        "requests sent, answers received.",
                                        {"transport", "shard", "direction"}));
  const std::string transport = TransportKindName(transport_);
  for (Shard& sh : shards_) {
    ASSIGN_OR_RETURN(sh.calls_ok, calls.WithLabels({transport, sh.target, "ok"}));
    ASSIGN_OR_RETURN(sh.tokens, tokens.WithLabels({transport, sh.target}));
    ASSIGN_OR_RETURN(sh.bytes_sent, bytes.WithLabels({transport, sh.target, "sent"}));
    ASSIGN_OR_RETURN(sh.bytes_received, bytes.WithLabels({transport, sh.target, "received"}));
    ASSIGN_OR_RETURN(sh.call_seconds, seconds.WithLabels({transport, sh.target}));
    ASSIGN_OR_RETURN(sh.up_gauge, up.WithLabels({sh.target}));
    sh.up_gauge->Set(1);
  }
  calls_metric_ = calls;
  return absl::OkStatus();
}

void ExpertPool::Account(int shard, const absl::Status& st, bool sent, bool late,
                         absl::Duration took, int64_t tokens, int64_t top_k) {
  Shard& sh = shards_[static_cast<size_t>(shard)];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (st.ok())
      sh.up = true;
    else if (absl::IsUnavailable(st) || absl::IsUnauthenticated(st) ||
             absl::IsPermissionDenied(st) || absl::IsFailedPrecondition(st))
      sh.up = false;
    if (absl::IsDataLoss(st))
      ++sh.data_loss_streak;
    else if (st.ok())
      sh.data_loss_streak = 0;
    // Only a shard that was sent the call in time and missed it fails fast.
    if (absl::IsDeadlineExceeded(st) && !late && fail_fast_after_miss_ > absl::ZeroDuration())
      sh.fail_fast_until = absl::Now() + fail_fast_after_miss_;
    if (sh.up_gauge) sh.up_gauge->Set(sh.up ? 1 : 0);
  }
  if (!calls_metric_) return;
  if (sent) {
    const int64_t H = model_.hidden;
    sh.call_seconds->Observe(absl::ToDoubleSeconds(took));
    sh.tokens->Increment(static_cast<double>(tokens));
    sh.bytes_sent->Increment(static_cast<double>(tokens * (H * 2 + top_k * 8)));
    if (st.ok()) sh.bytes_received->Increment(static_cast<double>(tokens * H * 4));
  }
  if (st.ok()) {
    sh.calls_ok->Increment();
    return;
  }
  // Failures look their child up (the registry's lock): not the hot path.
  auto c = calls_metric_->WithLabels({TransportKindName(transport_), sh.target,
                                      absl::AsciiStrToLower(absl::StatusCodeToString(st.code()))});
  if (c.ok()) (*c)->Increment();
}

ExpertPool::~ExpertPool() = default;

absl::Status ExpertPool::FailingFast(const Shard& sh) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sh.changed.empty())
    return absl::FailedPreconditionError(absl::StrCat(
        "restarted serving something else than when the worker connected: ", sh.changed,
        "; restart it as it was (or restart the worker against it)"));
  const absl::Time now = absl::Now();
  if (now < sh.check_fail_until)
    return absl::UnavailableError(absl::StrCat(
        "not serving at its last health check (",
        absl::FormatDuration(absl::Trunc(now - sh.check_failed_at, absl::Milliseconds(1))),
        " ago); failing fast until a check finds it serving"));
  if (now >= sh.fail_fast_until) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("missed a call deadline less than ",
                                             absl::FormatDuration(fail_fast_after_miss_),
                                             " ago; failing fast"));
}

absl::StatusOr<uint64_t> ExpertPool::Submit(const MoeCall& call, float* out, absl::Time deadline) {
  RETURN_IF_ERROR(ValidateMoeCall(model_, call));
  auto op = std::make_unique<Op>();
  op->out = out;
  op->tokens = call.tokens;
  const int64_t H = model_.hidden;
  const int k = call.top_k;
  auto send = [&](Shard& sh, const MoeCall& c, Sub& sub) {
    if (calls_metric_) sub.started = absl::Now();
    if (absl::Now() >= deadline) {
      sub.late = true;
      sub.submit_status =
          absl::DeadlineExceededError("the call's deadline passed before it was sent");
    } else if (absl::Status ff = FailingFast(sh); !ff.ok()) {
      sub.submit_status = ff;
    } else {
      const absl::Time before = absl::Now();
      auto h = sh.client->Submit(c, sub.dst, deadline);
      if (h.ok()) {
        sub.handle = *h;
      } else {
        sub.submit_status = h.status();
        // The deadline ran out between the check above and the client's own
        // (a Submit that did not block): not this shard's miss either.
        sub.late =
            absl::IsDeadlineExceeded(h.status()) && absl::Now() - before < absl::Milliseconds(1);
      }
    }
  };
  for (size_t i = 0; i < shards_.size(); ++i) {
    Shard& sh = shards_[i];
    Sub sub;
    sub.shard = static_cast<int>(i);
    sub.tokens = call.tokens;
    sub.top_k = k;
    if (model_.split == SplitMode::kTp) {
      // The first shard answers straight into `out`; the others' partials are added in Wait.
      if (i == 0) {
        sub.dst = out;
      } else {
        sub.scratch = TakeScratch(static_cast<size_t>(call.tokens * H));
        sub.dst = sub.scratch.data();
      }
      send(sh, call, sub);
    } else {
      for (int32_t t = 0; t < call.tokens; ++t) {
        for (int j = 0; j < k; ++j) {
          const int32_t e = call.ids[t * k + j];
          if (e >= sh.info.expert_begin && e < sh.info.expert_end) {
            sub.rows.push_back(t);
            break;
          }
        }
      }
      if (sub.rows.empty()) continue;
      const int32_t n = static_cast<int32_t>(sub.rows.size());
      sub.tokens = n;
      std::vector<uint16_t> x(static_cast<size_t>(n * H));
      std::vector<int32_t> ids(static_cast<size_t>(n * k));
      std::vector<float> w(static_cast<size_t>(n * k));
      for (int32_t r = 0; r < n; ++r) {
        const int32_t t = sub.rows[static_cast<size_t>(r)];
        std::copy_n(call.hidden + t * H, H, x.begin() + r * H);
        std::copy_n(call.ids + t * k, k, ids.begin() + r * k);
        std::copy_n(call.weights + t * k, k, w.begin() + r * k);
      }
      sub.scratch = TakeScratch(static_cast<size_t>(n * H));
      sub.dst = sub.scratch.data();
      send(sh, MoeCall::Make(call.layer, n, k, H, x.data(), ids.data(), w.data()), sub);
    }
    op->subs.push_back(std::move(sub));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_++;
  ops_[id] = std::move(op);
  return id;
}

absl::Status ExpertPool::Wait(uint64_t handle, absl::Time deadline) {
  std::unique_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) return absl::InvalidArgumentError("unknown expert-pool handle");
    op = std::move(it->second);
    ops_.erase(it);
  }
  absl::Status first;
  for (Sub& sub : op->subs) {
    absl::Status st = sub.submit_status.ok() ? shards_[static_cast<size_t>(sub.shard)].client->Wait(
                                                   sub.handle, deadline)
                                             : sub.submit_status;
    Account(sub.shard, st, sub.submit_status.ok(), sub.late,
            calls_metric_ ? absl::Now() - sub.started : absl::ZeroDuration(), sub.tokens,
            sub.top_k);
    if (!st.ok() && first.ok()) {
      first = Annotate(st, absl::StrCat("expert shard ", sub.shard, " (",
                                        shards_[static_cast<size_t>(sub.shard)].target, ")"));
    }
  }
  const int64_t H = model_.hidden;
  if (first.ok()) {
    if (model_.split == SplitMode::kTp) {
      for (size_t j = 1; j < op->subs.size(); ++j) {
        const float* s = op->subs[j].dst;
        for (int64_t i = 0; i < op->tokens * H; ++i) op->out[i] += s[i];
      }
    } else {
      std::fill(op->out, op->out + op->tokens * H, 0.f);
      for (const Sub& sub : op->subs) {
        for (size_t r = 0; r < sub.rows.size(); ++r) {
          float* o = op->out + sub.rows[r] * H;
          const float* s = sub.dst + static_cast<int64_t>(r) * H;
          for (int64_t c = 0; c < H; ++c) o[c] += s[c];
        }
      }
    }
  }
  for (Sub& sub : op->subs)
    if (!sub.scratch.empty()) ReturnScratch(std::move(sub.scratch));
  return first;
}

std::vector<float> ExpertPool::TakeScratch(size_t n) {
  std::vector<float> buf;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_scratch_.begin(); it != free_scratch_.end(); ++it) {
      if (it->size() >= n) {
        buf = std::move(*it);
        free_scratch_.erase(it);
        break;
      }
    }
  }
  if (buf.size() < n) buf.resize(n);  // only grows: a recycled buffer is not cleared
  return buf;
}

void ExpertPool::ReturnScratch(std::vector<float> buf) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_scratch_.size() < 32) free_scratch_.push_back(std::move(buf));
}

absl::Status ExpertPool::Run(const MoeCall& call, float* out, absl::Time deadline) {
  ASSIGN_OR_RETURN(uint64_t h, Submit(call, out, deadline));
  return Wait(h, deadline);
}

std::vector<bool> ExpertPool::ShardsUp() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<bool> r;
  for (const Shard& s : shards_) r.push_back(s.up);
  return r;
}

std::vector<bool> ExpertPool::DataPathsBroken() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<bool> r;
  for (const Shard& s : shards_) r.push_back(s.data_loss_streak >= kDataPathBrokenAfter);
  return r;
}

std::vector<Health> ExpertPool::CheckHealth(absl::Duration timeout) {
  std::vector<Health> r;
  for (Shard& s : shards_) {
    Health h = s.control->Check("", timeout);
    if (h == Health::kServing) {
      // grpc.health.v1 is open to all; Describe needs our token (a shard
      // that no longer takes it is not SERVING to us) and says what the
      // shard serves now. Only an answer or a refusal counts: a slow one
      // leaves the last verdict.
      absl::StatusOr<ShardInfo> now = s.control->Describe(timeout);
      const absl::Status& st = now.status();
      if (absl::IsUnauthenticated(st) || absl::IsPermissionDenied(st)) h = Health::kNotServing;
      if (now.ok()) {
        std::string diff = ServedDifference(s.info, *now);
        std::lock_guard<std::mutex> lock(mu_);
        if (!diff.empty()) {
          h = Health::kNotServing;
          s.up = false;
        }
        s.changed = std::move(diff);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (s.up_gauge) s.up_gauge->Set(h == Health::kServing ? 1 : 0);
      if (h == Health::kServing) {
        s.check_failed_at = s.check_fail_until = absl::InfinitePast();
      } else if (fail_fast_after_failed_check_ > absl::ZeroDuration()) {
        s.check_failed_at = absl::Now();
        s.check_fail_until = s.check_failed_at + fail_fast_after_failed_check_;
      }
    }
    r.push_back(h);
  }
  return r;
}

std::vector<ShardInfo> ExpertPool::shard_infos() const {
  std::vector<ShardInfo> r;
  for (const Shard& s : shards_) r.push_back(s.info);
  return r;
}

}  // namespace hmoe
