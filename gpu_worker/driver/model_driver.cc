#include "gpu_worker/driver/model_driver.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/driver/rope.h"

namespace hmoe {

namespace {

class ModelDriver;

class DriverSequence final : public Sequence {
 public:
  DriverSequence(const ModelDriver* owner, int64_t capacity, std::unique_ptr<KvCache> kv)
      : owner_(owner), capacity_(capacity), kv_(std::move(kv)) {}
  int64_t length() const override { return length_; }
  int64_t capacity() const override { return capacity_; }
  void Reset() override {
    length_ = 0;
    kv_->Shrink(0);
  }

  const ModelDriver* owner_;
  int64_t length_ = 0;
  int64_t capacity_;
  std::unique_ptr<KvCache> kv_;
};

// One MoE layer's deferred experts (ModelOptions::deferred_experts) from
// their Submit to the Wait at the end of the next layer. Owns what the call
// borrows; a call still pending at destruction (an error path) is waited on
// and its result dropped, so no ticket is left behind.
class DeferredCall {
 public:
  DeferredCall(RoutedExperts* experts, int layer) : experts_(experts), layer_(layer) {}
  DeferredCall(const DeferredCall&) = delete;
  DeferredCall& operator=(const DeferredCall&) = delete;
  ~DeferredCall() {
    if (pending_) experts_->Wait(ticket_).IgnoreError();
  }
  absl::Status Submit(int64_t T, int64_t H, int n) {
    const ExpertBatch b{.layer = layer_,
                        .num_tokens = T,
                        .hidden_size = H,
                        .hidden = hidden.data(),
                        .top_k = n,
                        .expert_ids = ids.data(),
                        .weights = weights.data()};
    out.resize(static_cast<size_t>(T * H));
    ASSIGN_OR_RETURN(ticket_, experts_->Submit(b, out.data()));
    pending_ = true;
    return absl::OkStatus();
  }
  // Waits for the deferred experts' sum (then in `out`).
  absl::Status Wait() {
    pending_ = false;
    return Annotate(experts_->Wait(ticket_),
                    absl::StrCat("layer ", layer_, " deferred routed experts"));
  }
  std::vector<float> hidden;  // [T, H], the layer's input (the backend reuses its buffer)
  std::vector<int32_t> ids;   // [T, n]
  std::vector<float> weights;
  std::vector<float> out;

 private:
  RoutedExperts* experts_;
  int layer_;
  uint64_t ticket_ = 0;
  bool pending_ = false;
};

class ModelDriver final : public Model {
 public:
  ModelDriver(const ModelConfig& config, const ModelOptions& options,
              std::unique_ptr<LayerBackend> backend, RoutedExperts* experts,
              std::unique_ptr<RoutedExperts> owned_experts, std::vector<GateSpec> gates)
      : c_(config),
        options_(options),
        owned_experts_(std::move(owned_experts)),
        backend_(std::move(backend)),
        experts_(experts),
        geo_(AttentionGeometryFor(config)),
        rope_(ComputeRope(config.rope, geo_.rope_dim)),
        gates_(std::move(gates)),
        routing_(config.moe_layer_indices(), config.moe.num_experts),
        pass_routing_(config.moe_layer_indices(), config.moe.num_experts) {
    for (int l = 0; l + 1 < c_.num_layers; ++l)
      if (c_.layers[static_cast<size_t>(l)].moe) ++deferring_layers_;
  }
  // Registers ModelOptions::metrics' families (Load).
  absl::Status RegisterMetrics() {
    if (options_.metrics == nullptr) return absl::OkStatus();
    ASSIGN_OR_RETURN(deferred_metric_,
                     options_.metrics->AddCounter(
                         "hmoe_expert_deferred_slots_total",
                         "Routed (token, expert) slots whose result Expert Deferral "
                         "(--defer-experts) joined one layer late, every expert call path."));
    return absl::OkStatus();
  }

  const ModelConfig& config() const override { return c_; }
  const ModelOptions& options() const override { return options_; }
  std::unique_ptr<Sequence> NewSequence() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::make_unique<DriverSequence>(this, options_.max_seq_len,
                                            backend_->NewKvCache(options_.max_seq_len));
  }
  int64_t kv_blocks_total() const override { return backend_->kv_blocks_total(); }
  int64_t kv_block_tokens() const override { return backend_->kv_block_tokens(); }
  ModelStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    ModelStats s = stats_;
    backend_->AddStats(&s);
    return s;
  }
  absl::Status health() const override { return backend_->health(); }
  RoutingTable routing_stats() const override {
    return routing_.Snapshot(c_.model_type, c_.moe.experts_per_token);
  }
  void AttachBackendExperts() { backend_->AttachExperts(experts_); }
  absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const override;

 private:
  absl::Status RunPass(const PassTokens& pass, float* logits) const;
  absl::Status RunPassOnce(const PassTokens& pass, float* logits) const;
  // The one accounting point of routed experts, whatever path calls them
  // (the host's RoutedExperts calls, hybrid prefill's streamed slots, a
  // backend's slots: host nodes, device waits, device sends, hot experts on
  // the device; Expert Deferral's parts): each routed (token, slot) of a
  // pass is tallied once in pass_routing_ (host-routed layers as they are
  // routed, a slot pass's from LayerBackend::SlotPassRoutes after its
  // Logits), and a pass's tally and deferred slots count only when it
  // completed (Account); a failed or retried attempt's are dropped.
  void Account(int64_t tokens) const;
  absl::Status FeedForward(int l, std::unique_ptr<DeferredCall>* deferred) const;
  // FeedForward when the backend calls the experts through its slots;
  // *deferred: l when part 1 of layer l is to be joined later, else -1.
  absl::Status FeedForwardInSlots(int l, int* deferred) const;

  ModelConfig c_;
  ModelOptions options_;
  // Declared before the backend: a backend's experts (cpu reference) may share its pool.
  std::unique_ptr<RoutedExperts> owned_experts_;
  std::unique_ptr<LayerBackend> backend_;
  RoutedExperts* experts_;
  AttentionGeometry geo_;
  RopeTables rope_;
  std::vector<GateSpec> gates_;           // [num_layers] each MoE layer's gate (its router kind's)
  mutable RoutingCounters routing_;       // thread-safe adds; completed passes'
  mutable RoutingCounters pass_routing_;  // the pass in progress (guarded by mu_)
  int deferring_layers_ = 0;              // MoE layers but the last: where Deferral splits
  Counter* deferred_metric_ = nullptr;    // with ModelOptions::metrics
  // One pass at a time: the backend holds one pass's activations.
  mutable std::mutex mu_;
  mutable ModelStats stats_;  // guarded by mu_
  // The pass in progress (guarded by mu_).
  mutable int64_t pass_tokens_ = 0;
  mutable std::vector<float> routed_out_;  // [T, H] the routed experts' sum
};

absl::Status ModelDriver::FeedForward(int l, std::unique_ptr<DeferredCall>* deferred) const {
  if (!c_.layers[static_cast<size_t>(l)].moe) return backend_->DenseMlp(l);
  RoutedInput in;
  RETURN_IF_ERROR(backend_->Route(l, gates_[static_cast<size_t>(l)], &in));
  const int64_t K = c_.moe.experts_per_token, H = c_.hidden_size;
  // T from the call's tokens: every backend routes all of the pass's tokens.
  const int64_t T = pass_tokens_;
  pass_routing_.Add(l, in.ids, T * K);
  // The last layer never defers: nothing would be left to overlap with.
  const int n = l + 1 < c_.num_layers ? options_.deferred_experts : 0;
  int64_t k_now = K;
  const int32_t* ids = in.ids;
  const float* weights = in.weights;
  std::vector<int32_t> ids_now;
  std::vector<float> weights_now;
  std::unique_ptr<DeferredCall> later;
  if (n > 0) {
    // Per token, the n lowest weights (ties: the later slot) go to `later`;
    // the others keep their order.
    later = std::make_unique<DeferredCall>(experts_, l);
    later->hidden.assign(in.hidden, in.hidden + T * H);
    later->ids.resize(static_cast<size_t>(T * n));
    later->weights.resize(static_cast<size_t>(T * n));
    k_now = K - n;
    ids_now.resize(static_cast<size_t>(T * k_now));
    weights_now.resize(static_cast<size_t>(T * k_now));
    SplitDeferred(in.ids, in.weights, T, K, n, ids_now.data(), weights_now.data(),
                  later->ids.data(), later->weights.data());
    ids = ids_now.data();
    weights = weights_now.data();
  }
  // Hybrid prefill: the backend may compute some slots itself (not with
  // deferral: its calls may still be in flight).
  std::vector<int32_t> ids_rest;
  bool all_taken = false;
  if (n == 0) {
    ids_rest.resize(static_cast<size_t>(T * K));
    absl::StatusOr<int64_t> taken =
        backend_->TakeRoutedSlots(l, in, T, static_cast<int>(K), ids_rest.data());
    if (!taken.ok())
      return Annotate(taken.status(), absl::StrCat("layer ", l, " streamed experts"));
    if (*taken > 0) ids = ids_rest.data();
    all_taken = *taken == T * K;
  }
  const ExpertBatch b{.layer = l,
                      .num_tokens = T,
                      .hidden_size = H,
                      .hidden = in.hidden,
                      .top_k = static_cast<int>(k_now),
                      .expert_ids = ids,
                      .weights = weights};
  // The routed experts run (remote ones: on the expert service) while the
  // backend computes the shared experts; deferred ones keep running after.
  const std::string where = absl::StrCat("layer ", l, " routed experts");
  routed_out_.resize(static_cast<size_t>(T * H));
  if (all_taken) {  // nothing left for the experts (n == 0: no deferred part)
    RETURN_IF_ERROR(backend_->StartSharedExperts(l));
    RETURN_IF_ERROR(backend_->AddExperts(l, nullptr));
    *deferred = std::move(later);
    return absl::OkStatus();
  }
  auto ticket = experts_->Submit(b, routed_out_.data());
  if (!ticket.ok()) return Annotate(ticket.status(), where);
  if (later) {
    absl::Status st = later->Submit(T, H, n);
    if (!st.ok()) {
      experts_->Wait(*ticket).IgnoreError();
      return Annotate(st, absl::StrCat("layer ", l, " deferred routed experts"));
    }
  }
  absl::Status shared = backend_->StartSharedExperts(l);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status waited = Annotate(experts_->Wait(*ticket), where);
  stats_.expert_wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  RETURN_IF_ERROR(shared);
  RETURN_IF_ERROR(waited);
  RETURN_IF_ERROR(backend_->AddExperts(l, routed_out_.data()));
  *deferred = std::move(later);
  return absl::OkStatus();
}

absl::Status ModelDriver::FeedForwardInSlots(int l, int* deferred) const {
  *deferred = -1;
  if (!c_.layers[static_cast<size_t>(l)].moe) return backend_->DenseMlp(l);
  // The last layer never defers: nothing would be left to overlap with.
  const int n = l + 1 < c_.num_layers ? options_.deferred_experts : 0;
  RETURN_IF_ERROR(backend_->RouteToSlots(l, gates_[static_cast<size_t>(l)], n));
  RETURN_IF_ERROR(backend_->StartSharedExperts(l));
  RETURN_IF_ERROR(backend_->JoinSlot(l, 0));
  if (n > 0) *deferred = l;
  return absl::OkStatus();
}

absl::Status ModelDriver::RunPass(const PassTokens& pass, float* logits) const {
  absl::Status st = RunPassOnce(pass, logits);
  if (!st.ok() && backend_->capture_fell_back()) {
    // Only captured, and the capture failed: run it for real.
    backend_->Abort();
    pass_routing_.Clear();
    st = RunPassOnce(pass, logits);
  }
  return st;
}

void ModelDriver::Account(int64_t tokens) const {
  pass_routing_.MoveTo(&routing_);
  const int64_t deferred = tokens * options_.deferred_experts * deferring_layers_;
  stats_.deferred_expert_slots += deferred;
  if (deferred_metric_ != nullptr && deferred > 0)
    deferred_metric_->Increment(static_cast<double>(deferred));
}

absl::Status ModelDriver::RunPassOnce(const PassTokens& pass, float* logits) const {
  pass_tokens_ = pass.size();
  RETURN_IF_ERROR(backend_->Begin(pass));
  if (!backend_->replayed()) {
    const bool slots = backend_->pass_uses_slots();
    // Expert Deferral: the previous layer's deferred experts, joined at the
    // end of this one.
    std::unique_ptr<DeferredCall> deferred, previous;
    int deferred_layer = -1, previous_layer = -1;
    for (int l = 0; l < c_.num_layers; ++l) {
      RETURN_IF_ERROR(backend_->Attention(l));
      RETURN_IF_ERROR(slots ? FeedForwardInSlots(l, &deferred_layer) : FeedForward(l, &deferred));
      if (previous) {
        const auto t0 = std::chrono::steady_clock::now();
        absl::Status st = previous->Wait();
        stats_.expert_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now() - t0)
                                     .count();
        RETURN_IF_ERROR(st);
        RETURN_IF_ERROR(backend_->AddToResidual(previous->out.data()));
      }
      if (previous_layer >= 0) RETURN_IF_ERROR(backend_->JoinSlot(previous_layer, 1));
      previous = std::move(deferred);
      previous_layer = deferred_layer;
    }
  }
  RETURN_IF_ERROR(backend_->Logits(logits));
  backend_->SlotPassRoutes(
      [this](int32_t layer, const int32_t* ids, int64_t n) { pass_routing_.Add(layer, ids, n); });
  return backend_->Commit();
}

absl::Status ModelDriver::ForwardBatch(absl::Span<const ForwardStep> steps) const {
  if (steps.empty()) return absl::InvalidArgumentError("ForwardBatch: no steps");
  const bool several = steps.size() > 1;
  auto step_error = [&](size_t i, absl::Status st) {
    return several ? Annotate(st, absl::StrCat("step ", i)) : st;
  };
  std::vector<DriverSequence*> seqs(steps.size());
  int64_t total = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const ForwardStep& st = steps[i];
    auto* s = dynamic_cast<DriverSequence*>(st.seq);
    if (s == nullptr || s->owner_ != this)
      return step_error(
          i, absl::InvalidArgumentError("Forward: the Sequence was not made by this Model"));
    if (st.logits == nullptr)
      return step_error(i, absl::InvalidArgumentError("Forward: no logits output"));
    for (size_t j = 0; j < i; ++j)
      if (seqs[j] == s)
        return step_error(i, absl::InvalidArgumentError(absl::StrCat(
                                 "ForwardBatch: the Sequence of step ", j, " appears again")));
    seqs[i] = s;
    const int64_t T = static_cast<int64_t>(st.tokens.size());
    if (T == 0) return step_error(i, absl::InvalidArgumentError("Forward: no tokens"));
    for (int64_t t = 0; t < T; ++t) {
      if (st.tokens[t] < 0 || st.tokens[t] >= c_.vocab_size)
        return step_error(i, absl::InvalidArgumentError(absl::StrCat(
                                 "token id ", st.tokens[t], " at index ", t,
                                 " is outside the vocabulary [0, ", c_.vocab_size, ")")));
    }
    const int64_t p0 = s->length_;
    if (p0 + T > s->capacity())
      return step_error(i, absl::ResourceExhaustedError(
                               absl::StrCat("sequence holds ", p0, " tokens; ", T,
                                            " more exceed its capacity of ", s->capacity())));
    total += T;
  }

  std::lock_guard<std::mutex> lock(mu_);
  // Room for the new positions; on failure the caches go back to their lengths.
  for (size_t i = 0; i < steps.size(); ++i) {
    absl::Status st =
        seqs[i]->kv_->Reserve(seqs[i]->length_ + static_cast<int64_t>(steps[i].tokens.size()));
    if (!st.ok()) {
      for (size_t j = 0; j <= i; ++j) seqs[j]->kv_->Shrink(seqs[j]->length_);
      return step_error(i, st);
    }
  }
  PassTokens pass;
  pass.ids.reserve(static_cast<size_t>(total));
  pass.rope_dim = geo_.rope_dim;
  pass.rope_cs.resize(static_cast<size_t>(total * geo_.rope_dim));
  for (size_t i = 0; i < steps.size(); ++i) {
    const ForwardStep& st = steps[i];
    const int64_t T = static_cast<int64_t>(st.tokens.size());
    const int64_t keep = st.mode == LogitsMode::kAll ? T : 1;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = pass.size();
      if (t >= T - keep) pass.logit_rows.push_back(static_cast<int32_t>(row));
      pass.ids.push_back(st.tokens[t]);
      pass.kv.push_back(seqs[i]->kv_.get());
      pass.pos.push_back(seqs[i]->length_ + t);
      RopeCosSin(rope_, seqs[i]->length_ + t, pass.rope_cs.data() + row * geo_.rope_dim);
    }
    pass.max_pos = std::max(pass.max_pos, seqs[i]->length_ + T - 1);
  }
  const int64_t V = c_.vocab_size;
  std::vector<float> all(pass.logit_rows.size() * static_cast<size_t>(V));
  absl::Status st = RunPass(pass, all.data());
  if (!st.ok()) {
    backend_->Abort();
    pass_routing_.Clear();  // a failed pass counts nothing
    for (DriverSequence* s : seqs) s->kv_->Shrink(s->length_);
    return st;
  }
  auto from = all.begin();
  for (size_t i = 0; i < steps.size(); ++i) {
    const int64_t keep =
        steps[i].mode == LogitsMode::kAll ? static_cast<int64_t>(steps[i].tokens.size()) : 1;
    const auto to = from + keep * V;
    steps[i].logits->assign(from, to);
    from = to;
    seqs[i]->length_ += static_cast<int64_t>(steps[i].tokens.size());
  }
  Account(total);
  ++stats_.passes;
  stats_.tokens += total;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateModelDriver(
    const ModelConfig& config, const ModelOptions& options, std::unique_ptr<LayerBackend> backend,
    RoutedExperts* experts, std::unique_ptr<RoutedExperts> owned_experts) {
  if (config.num_moe_layers() > 0 && experts == nullptr)
    return absl::InvalidArgumentError("CreateModelDriver: a MoE model needs RoutedExperts");
  // Each MoE layer's gate, from its router kind (UNIMPLEMENTED: a kind
  // without a router).
  std::vector<GateSpec> gates(config.layers.size());
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layers[static_cast<size_t>(l)].moe) continue;
    ASSIGN_OR_RETURN(gates[static_cast<size_t>(l)], GateSpecFor(config, l));
  }
  auto* d = new ModelDriver(config, options, std::move(backend), experts, std::move(owned_experts),
                            std::move(gates));
  std::unique_ptr<Model> m(d);
  RETURN_IF_ERROR(d->RegisterMetrics());
  // The backend may reach the experts from the device itself (slots).
  if (experts != nullptr) d->AttachBackendExperts();
  return m;
}

}  // namespace hmoe
