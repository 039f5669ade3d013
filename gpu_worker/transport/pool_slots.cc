// ExpertSlots over the pool: staged (any transport, any shards) and zero
// copy (one shm shard).
#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/shm_client.h"

namespace hmoe {
namespace {

// Over ExpertPool::Submit / Wait.
class StagedSlots final : public HostMemorySlots {
 public:
  StagedSlots(ExpertPool* pool, int64_t hidden, const ExpertSlotsOptions& opts)
      : HostMemorySlots(hidden, opts), pool_(pool), handles_(static_cast<size_t>(opts.num_slots)) {}
  const char* kind() const override { return "staged"; }

 private:
  absl::Status DoSubmit(int slot, int32_t layer, int32_t tokens, int32_t top_k,
                        absl::Time deadline) override {
    const SlotView v = view(slot);
    const MoeCall call = MoeCall::Make(layer, tokens, top_k, hidden(), v.hidden, v.ids, v.weights);
    ASSIGN_OR_RETURN(handles_[static_cast<size_t>(slot)],
                     pool_->Submit(call, const_cast<float*>(v.out), deadline));
    return absl::OkStatus();
  }
  absl::Status DoWait(int slot, absl::Time deadline) override {
    return pool_->Wait(handles_[static_cast<size_t>(slot)], deadline);
  }
  ExpertPool* pool_;
  std::vector<uint64_t> handles_;
};

// Slot i is slot i of the client's segment.
class ShmSlots final : public ExpertSlotsBase {
 public:
  ShmSlots(std::unique_ptr<ShmClient> client, int64_t hidden, const ExpertSlotsOptions& opts)
      : ExpertSlotsBase(hidden, opts), client_(std::move(client)) {
    handles_.assign(static_cast<size_t>(opts.num_slots), 0);
    views_.resize(static_cast<size_t>(opts.num_slots));
    states_.assign(static_cast<size_t>(opts.num_slots), nullptr);
    armed_.assign(static_cast<size_t>(opts.num_slots), 0);
  }
  const char* kind() const override { return "shm (zero copy)"; }
  absl::StatusOr<uint64_t> Prepare(absl::Time deadline) override {
    // A service known down is not waited for (as a call to it is not).
    // (Its segment, if any, stays as it is.)
    if (opts_.ledger != nullptr) RETURN_IF_ERROR(Mapped(opts_.ledger->Admit()));
    absl::StatusOr<uint64_t> got = client_->EnsureSegment(deadline);
    // A reconnect's outcome is news about the service; a segment kept is not.
    if (opts_.ledger != nullptr && (!got.ok() || *got != gen_))
      opts_.ledger->Reconnected(got.status());
    if (!got.ok()) {
      // The old segment was given up (before_release called): no view may
      // point into it.
      std::fill(views_.begin(), views_.end(), SlotView{});
      std::fill(states_.begin(), states_.end(), nullptr);
      region_ = HostRegion{};
      gen_ = 0;
      return Mapped(got.status());
    }
    const uint64_t gen = *got;
    if (gen != gen_) {
      for (int i = 0; i < num_slots(); ++i) {
        const float* out = nullptr;
        SlotView& v = views_[static_cast<size_t>(i)];
        const ShmClient::SlotView f = client_->FixedView(static_cast<uint32_t>(i), &out);
        v = SlotView{f.hidden, f.ids, f.weights, out};
        states_[static_cast<size_t>(i)] = f.state;
      }
      region_ = HostRegion{client_->segment(), client_->segment_bytes()};
      gen_ = gen;
    }
    return gen;
  }
  SlotView view(int slot) const override { return views_[static_cast<size_t>(slot)]; }
  std::vector<HostRegion> regions() const override { return {region_}; }
  DeviceWait device_wait(int slot) const override {
    if (slot < 0 || slot >= num_slots()) return {};
    std::atomic<uint32_t>* w = states_[static_cast<size_t>(slot)];
    static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free);
    return DeviceWait{reinterpret_cast<uint32_t*>(w), kSlotRequest, kSlotBusy, kSlotRequest};
  }
  bool service_alive() const override { return client_->FixedServiceAlive(); }
  void SetDeviceSends(bool on) override { client_->SetDevicePolling(on); }

 private:
  absl::Status DoSubmit(int slot, int32_t layer, int32_t tokens, int32_t top_k,
                        absl::Time) override {
    ASSIGN_OR_RETURN(handles_[static_cast<size_t>(slot)],
                     client_->SubmitFixed(static_cast<uint32_t>(slot), layer, tokens, top_k));
    return absl::OkStatus();
  }
  absl::Status DoArm(int slot, int32_t layer, int32_t tokens, int32_t top_k, absl::Time) override {
    ASSIGN_OR_RETURN(handles_[static_cast<size_t>(slot)],
                     client_->ArmFixed(static_cast<uint32_t>(slot), layer, tokens, top_k));
    armed_[static_cast<size_t>(slot)] = 1;
    return absl::OkStatus();
  }
  absl::Status DoWait(int slot, absl::Time deadline) override {
    const uint64_t h = handles_[static_cast<size_t>(slot)];
    // An armed call the device never sent (its pass stopped first): released,
    // not waited for. Wait on an armed call comes after the device's work.
    const std::atomic<uint32_t>* state = states_[static_cast<size_t>(slot)];
    if (std::exchange(armed_[static_cast<size_t>(slot)], uint8_t{0}) != 0 && state != nullptr &&
        state->load(std::memory_order_acquire) == kSlotFree) {
      client_->Release(h);
      return absl::AbortedError("expert call armed but never sent by the device");
    }
    ASSIGN_OR_RETURN(const float* answer, client_->WaitInPlace(h, deadline));
    // The answer stays in the slot's response region: nothing reuses the
    // slot before this caller's next Submit on it.
    client_->Release(h);
    if (answer != views_[static_cast<size_t>(slot)].out)
      return absl::InternalError("expert service (shm): answer outside the fixed slot");
    return absl::OkStatus();
  }
  std::unique_ptr<ShmClient> client_;
  std::vector<uint64_t> handles_;
  std::vector<SlotView> views_;
  std::vector<std::atomic<uint32_t>*> states_;  // the slots' state words
  std::vector<uint8_t> armed_;                  // by slot: armed (DoArm), not yet waited
  HostRegion region_;
  uint64_t gen_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeStagedExpertSlots(ExpertPool* pool,
                                                                   const ExpertSlotsOptions& opts) {
  auto s = std::make_unique<StagedSlots>(pool, pool->model().hidden, opts);
  RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<ExpertSlots>(std::move(s));
}

absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeShmExpertSlots(std::unique_ptr<ShmClient> client,
                                                                int64_t hidden,
                                                                const ExpertSlotsOptions& opts) {
  if (opts.num_slots <= 0 || opts.max_tokens <= 0 || opts.top_k <= 0)
    return absl::InvalidArgumentError("expert slots: num_slots, max_tokens and top_k must be > 0");
  auto s = std::make_unique<ShmSlots>(std::move(client), hidden, opts);
  RETURN_IF_ERROR(s->Prepare(absl::Now() + opts.call_timeout).status());
  return std::unique_ptr<ExpertSlots>(std::move(s));
}

absl::StatusOr<std::unique_ptr<ExpertSlots>> ExpertPool::MakeSlots(const ExpertSlotsOptions& opts) {
  // Before anything is sized by them (a negative count is a huge one).
  if (opts.num_slots <= 0 || opts.max_tokens <= 0 || opts.top_k <= 0)
    return absl::InvalidArgumentError("expert slots: num_slots, max_tokens and top_k must be > 0");
  if (opts.hidden != model_.hidden)
    return absl::InvalidArgumentError(absl::StrCat("expert slots: hidden size ", opts.hidden,
                                                   "; the shards serve ", model_.hidden));
  for (const Shard& sh : shards_) {
    if (sh.info.max_tokens < opts.max_tokens)
      return absl::FailedPreconditionError(
          absl::StrCat("expert shard ", sh.target, " takes ", sh.info.max_tokens,
                       " tokens per call; the slots need ", opts.max_tokens));
    if (sh.info.top_k < opts.top_k)
      return absl::FailedPreconditionError(absl::StrCat("expert shard ", sh.target, " takes top-k ",
                                                        sh.info.top_k, "; the slots need ",
                                                        opts.top_k));
  }
  if (transport_ == TransportKind::kShm && shards_.size() == 1) {
    ShmClientOptions so;
    so.slots = static_cast<uint32_t>(opts.num_slots);
    so.max_tokens = opts.max_tokens;
    so.before_unmap = opts.before_release;
    auto c = ShmClient::Create(shards_[0].control, shards_[0].info, so);
    if (!c.ok()) return Annotate(c.status(), absl::StrCat("expert shard ", shards_[0].target));
    ExpertSlotsOptions zero_copy = opts;
    zero_copy.ledger = ledgers_[0].get();
    return MakeShmExpertSlots(std::move(*c), model_.hidden, zero_copy);
  }
  ExpertSlotsOptions staged = opts;
  staged.ledger = nullptr;  // Submit / Wait account for them
  return MakeStagedExpertSlots(this, staged);
}

}  // namespace hmoe
