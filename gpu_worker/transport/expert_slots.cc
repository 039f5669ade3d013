#include "gpu_worker/transport/expert_slots.h"

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace hmoe {
namespace {

uint64_t Align(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

HostMemorySlots::HostMemorySlots(int64_t hidden, const ExpertSlotsOptions& opts)
    : ExpertSlotsBase(hidden, opts) {
  const uint64_t t = static_cast<uint64_t>(opts.max_tokens), h = static_cast<uint64_t>(hidden),
                 k = static_cast<uint64_t>(opts.top_k);
  ids_off_ = Align(t * h * 2, 64);
  weights_off_ = ids_off_ + Align(t * k * 4, 64);
  out_off_ = weights_off_ + Align(t * k * 4, 64);
  slot_bytes_ = Align(out_off_ + t * h * 4, 4096);
  bytes_ = slot_bytes_ * static_cast<uint64_t>(opts.num_slots);
}

HostMemorySlots::~HostMemorySlots() {
  if (base_ && opts_.before_release) opts_.before_release(base_, bytes_);
  std::free(base_);
}

absl::Status HostMemorySlots::Init() {
  if (opts_.num_slots <= 0 || opts_.max_tokens <= 0 || opts_.top_k <= 0)
    return absl::InvalidArgumentError("expert slots: num_slots, max_tokens and top_k must be > 0");
  base_ = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes_));
  if (base_ == nullptr)
    return absl::ResourceExhaustedError(
        absl::StrCat("expert slots: ", bytes_, " bytes of host memory"));
  // Rows a caller reads beyond a call's tokens are zeros, never garbage.
  std::memset(base_, 0, bytes_);
  return absl::OkStatus();
}

SlotView HostMemorySlots::view(int slot) const {
  uint8_t* p = base_ + slot_bytes_ * static_cast<uint64_t>(slot);
  return SlotView{reinterpret_cast<uint16_t*>(p), reinterpret_cast<int32_t*>(p + ids_off_),
                  reinterpret_cast<float*>(p + weights_off_),
                  reinterpret_cast<const float*>(p + out_off_)};
}

absl::Status CheckAnswer(const float* out, int32_t tokens, int64_t hidden) {
  if (out == nullptr) return absl::InternalError("expert slots: no answer region");
  const int64_t n = int64_t{tokens} * hidden;
  // A branch-free pass first (one the compiler can vectorize): an all-ones
  // exponent is a NaN or an infinity; the second pass finds where.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i)
    bad |= static_cast<uint32_t>((std::bit_cast<uint32_t>(out[i]) & 0x7f800000u) == 0x7f800000u);
  if (bad == 0) return absl::OkStatus();
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i]))
      return absl::DataLossError(absl::StrCat("the expert answer holds a non-finite value (row ",
                                              i / hidden, ", column ", i % hidden, "); refused"));
  }
  return absl::OkStatus();
}

ExpertSlotsBase::ExpertSlotsBase(int64_t hidden, const ExpertSlotsOptions& opts)
    : opts_(opts), hidden_(hidden), calls_(static_cast<size_t>(opts.num_slots)) {}

void ExpertSlotsBase::Record(const absl::Status& st, int slot, int32_t layer) {
  if (st.ok()) return;
  absl::Status mapped = Mapped(st);
  std::lock_guard<std::mutex> lock(mu_);
  if (first_.ok())
    first_ = Annotate(mapped, absl::StrCat("layer ", layer, " routed experts (slot ", slot, ")"));
  failed_.store(true, std::memory_order_release);
}

void ExpertSlotsBase::Submit(int slot, int32_t layer, int32_t tokens, int32_t top_k) {
  Claim(slot, layer, tokens, top_k, /*arm=*/false);
}

bool ExpertSlotsBase::Arm(int slot, int32_t layer, int32_t tokens, int32_t top_k) {
  return Claim(slot, layer, tokens, top_k, /*arm=*/true);
}

bool ExpertSlotsBase::Claim(int slot, int32_t layer, int32_t tokens, int32_t top_k, bool arm) {
  if (slot < 0 || slot >= num_slots()) {
    Record(absl::FailedPreconditionError(absl::StrCat("no slot ", slot, " of ", num_slots())), slot,
           layer);
    return false;
  }
  Call& c = calls_[static_cast<size_t>(slot)];
  if (c.pending) {
    Record(absl::FailedPreconditionError("submitted again before it was waited on"), slot, layer);
    return false;
  }
  c.pending = true;
  c.sent = false;
  c.layer = layer;
  c.tokens = tokens;
  c.top_k = top_k;
  c.started = absl::Now();
  c.deadline = c.started + opts_.call_timeout;
  if (tokens == 0) return false;  // nothing to compute; Wait returns at once
  {
    // A failure since the last TakeStatus dooms the pass: the rest of its
    // calls are not sent (a hung service costs one deadline, not one per layer).
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_.ok()) return false;
  }
  if (tokens < 0 || tokens > opts_.max_tokens || top_k <= 0 || top_k > opts_.top_k) {
    Record(absl::FailedPreconditionError(absl::StrCat(tokens, " tokens x top-k ", top_k,
                                                      " over the slots' ", opts_.max_tokens, " x ",
                                                      opts_.top_k)),
           slot, layer);
    return false;
  }
  absl::Status st = opts_.ledger != nullptr ? opts_.ledger->Admit() : absl::OkStatus();
  if (st.ok())
    st = arm ? DoArm(slot, layer, tokens, top_k, c.deadline)
             : DoSubmit(slot, layer, tokens, top_k, c.deadline);
  c.sent = st.ok();
  // A refusal is the call's end; a sent call ends at its Wait.
  if (!st.ok() && opts_.ledger != nullptr)
    opts_.ledger->Ended(SlotCallEnd{layer, tokens, top_k, false, absl::ZeroDuration(), st});
  Record(st, slot, layer);
  return c.sent;
}

void ExpertSlotsBase::Wait(int slot) {
  if (slot < 0 || slot >= num_slots()) {
    Record(absl::FailedPreconditionError(absl::StrCat("no slot ", slot, " of ", num_slots())), slot,
           0);
    return;
  }
  Call& c = calls_[static_cast<size_t>(slot)];
  if (!c.pending) {
    Record(absl::FailedPreconditionError("waited on without a submit"), slot, c.layer);
    return;
  }
  c.pending = false;
  if (!c.sent) return;  // its failure (or empty call) is already recorded
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = DoWait(slot, c.deadline);
  if (st.ok()) st = CheckAnswer(view(slot).out, c.tokens, hidden_);
  wait_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  // ABORTED: an armed call the device never sent, no call of the service's.
  if (opts_.ledger != nullptr && !absl::IsAborted(st))
    opts_.ledger->Ended(SlotCallEnd{c.layer, c.tokens, c.top_k, true, absl::Now() - c.started, st});
  Record(st, slot, c.layer);
}

absl::Status ExpertSlotsBase::TakeStatus() {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status st = std::move(first_);
  first_ = absl::OkStatus();
  failed_.store(false, std::memory_order_release);
  return st;
}

void ExpertSlotsBase::Drain() {
  for (int i = 0; i < num_slots(); ++i)
    if (calls_[static_cast<size_t>(i)].pending) Wait(i);
}

int64_t ExpertSlotsBase::TakeWaitNs() { return wait_ns_.exchange(0); }

}  // namespace hmoe
