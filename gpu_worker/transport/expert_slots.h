// ExpertSlots: fixed expert-call slots in host memory owned by the transport,
// the form of an expert call that a CUDA Graph can hold.
//
// A slot is a request region (bf16 hidden [max_tokens][H], int32 ids and f32
// routing weights [max_tokens][k]) and a response region (f32 partial sums
// [max_tokens][H]) at addresses that stay put while generation() does. The
// GPU copies a layer's request straight into a slot and its answer straight
// out; the host only rings the doorbell (Submit) and waits (Wait). Both are
// safe to call from a CUDA host node: they make no CUDA calls, Submit never
// waits for the service, Wait returns by the call's deadline, and a failure
// is not returned but kept for TakeStatus (a graph cannot stop half way; the
// pass that saw a failure is dropped afterwards).
//
// The slot index is the only ticket: the caller decides which slot a call
// uses (e.g. one per MoE layer, one more per deferred half) and every
// Submit(s) is followed by exactly one Wait(s) before slot s is written
// again. Nothing here knows the model's schedule.
//
// Errors kept for TakeStatus: UNAVAILABLE (service gone; Prepare reconnects),
// DEADLINE_EXCEEDED (no answer in time; the slot stays blocked until the
// service finishes the abandoned call or goes away), the service's own
// refusals (INVALID_ARGUMENT naming the field), FAILED_PRECONDITION (bad slot
// use: a slot submitted twice, an unknown slot, too many tokens), DATA_LOSS
// (an answer with a non-finite value), and with a ledger its Admit's
// refusals (UNAVAILABLE: the service known down).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hmoe {

// How one slot call ended, for ExpertCallLedger::Ended.
struct SlotCallEnd {
  int32_t layer = 0;
  int32_t tokens = 0;
  int32_t top_k = 0;
  // It reached the service (a call refused before it was sent: false).
  bool sent = false;
  // From Submit / Arm to the host seeing its answer or failure (sent calls;
  // for a call the device sends, its Wait comes after the pass).
  absl::Duration took;
  absl::Status status;  // the transport's own outcome (before map_failure)
};

// Where a transport accounts the calls its slots carry and refuses them
// while the service is known down: the same bookkeeping as its other calls
// (ExpertPool's, per shard). Any thread.
class ExpertCallLedger {
 public:
  virtual ~ExpertCallLedger() = default;
  // OK, or why no call may be sent now (UNAVAILABLE: the service failed its
  // last health check or missed a deadline lately). Checked before each
  // call and before a reconnect.
  virtual absl::Status Admit() = 0;
  // A call that Admit let through ended.
  virtual void Ended(const SlotCallEnd& end) = 0;
  // A reconnect (ExpertSlots::Prepare) ended with `st`: the service's state,
  // not a call.
  virtual void Reconnected(const absl::Status& st) = 0;
};

struct ExpertSlotsOptions {
  int64_t hidden = 0;  // H, the model's hidden size
  int num_slots = 0;
  int32_t max_tokens = 32;  // per call
  int32_t top_k = 8;        // most ids per token of one call
  absl::Duration call_timeout = absl::Seconds(30);
  // Applied to each failure before TakeStatus reports it (e.g. the worker's
  // mapping of transport codes to what its clients see); may be empty.
  std::function<absl::Status(const absl::Status&)> map_failure;
  // Called with a region just before its memory is released (e.g. to
  // cudaHostUnregister it): at destruction, and when Prepare moves the
  // slots. Never called from Submit or Wait. May be empty.
  std::function<void(void* base, uint64_t bytes)> before_release;
  // Borrowed, outlives the slots; null: calls are neither accounted nor
  // refused here (staged slots: their transport does both).
  ExpertCallLedger* ledger = nullptr;
};

// A slot's regions (for the current generation).
struct SlotView {
  uint16_t* hidden = nullptr;  // bf16 [max_tokens][H]
  int32_t* ids = nullptr;      // [tokens][top_k] as the call's top_k lays them out
  float* weights = nullptr;    // [tokens][top_k]
  const float* out = nullptr;  // f32 [max_tokens][H], valid after a successful Wait
};

// Host memory holding the slots, for cudaHostRegister.
struct HostRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
};

class ExpertSlots {
 public:
  virtual ~ExpertSlots() = default;
  virtual int num_slots() const = 0;
  virtual int32_t max_tokens() const = 0;
  virtual int32_t top_k() const = 0;
  virtual int64_t hidden() const = 0;
  // What the calls go over: "shm (zero copy)", "grpc (staged)", "in-process".
  virtual const char* kind() const = 0;

  // Outside any graph, before a pass: reconnects to the service when it went
  // away (until `deadline`), and returns the generation, which changes when
  // the slots moved (views, regions: re-read them, recapture graphs). With a
  // ledger, fails at once (its Admit's status, mapped) while the service is
  // known down; failures are mapped as a call's.
  virtual absl::StatusOr<uint64_t> Prepare(absl::Time deadline) = 0;
  virtual SlotView view(int slot) const = 0;
  virtual std::vector<HostRegion> regions() const = 0;

  // Enqueues the call in `slot`: `tokens` rows of its regions, `top_k` ids
  // each, for MoE layer `layer`. Never waits for the service. After a
  // failure not yet taken (TakeStatus) nothing is sent: the pass is lost
  // anyway, and a hung service then costs one deadline per pass.
  virtual void Submit(int slot, int32_t layer, int32_t tokens, int32_t top_k) = 0;
  // Waits until the slot's answer is in view(slot).out, or the call's
  // deadline; on failure the response region is unspecified. An answer
  // with a non-finite value is a failure (DATA_LOSS, CheckAnswer): a pass
  // that already read it is dropped as for any failed call.
  virtual void Wait(int slot) = 0;
  // The first failure since the last TakeStatus (OK if none), and clears it.
  virtual absl::Status TakeStatus() = 0;
  // Outside any graph: Waits on every slot submitted and not yet waited on
  // (a pass abandoned half way), so that each can be submitted again.
  virtual void Drain() = 0;
  // Nanoseconds spent inside Wait since the last call (clears).
  virtual int64_t TakeWaitNs() = 0;
  // A failure is kept for TakeStatus (any thread; e.g. a submit host node
  // telling the device to stop waiting).
  virtual bool has_failure() const = 0;
  // How long a call may take (ExpertSlotsOptions::call_timeout).
  virtual absl::Duration call_timeout() const = 0;

  // A wait the device can do without a host node: `word`, inside regions(),
  // holds a value in [busy_lo, busy_hi] while the call last submitted in the
  // slot is at the service and leaves that range once it is answered or
  // failed (or was never sent). Wait(slot) is still called afterwards, before
  // the slot's next Submit: it then returns at once and reports the failure.
  // word == nullptr: this transport has none (staged copies).
  // request != 0: the device may also send the call itself, without a host
  // node: after Arm(slot), it stores `request` into `word` (once the
  // request region holds the call), between SetDeviceSends(true) and (false).
  struct DeviceWait {
    uint32_t* word = nullptr;
    uint32_t busy_lo = 0, busy_hi = 0;
    uint32_t request = 0;
  };
  virtual DeviceWait device_wait(int slot) const {
    (void)slot;
    return {};
  }
  // Submit's twin for a call the device sends (DeviceWait::request): the
  // same checks and bookkeeping, the call written, all but the send. True
  // when the device is to send it; false when it must not (an empty call, or
  // a failure kept for TakeStatus). Wait(slot) follows as after Submit.
  virtual bool Arm(int slot, int32_t layer, int32_t tokens, int32_t top_k) = 0;
  // On before a pass whose calls the device sends, off after it.
  virtual void SetDeviceSends(bool on) { (void)on; }
  // False once the transport knows the service of the current generation
  // went away (cheap, any thread): a watchdog's check while the device waits
  // on device_wait() words.
  virtual bool service_alive() const { return true; }
};

// DATA_LOSS naming the first non-finite value of an answer of `tokens` rows
// of `hidden` f32 (a service answering garbage), else OK.
absl::Status CheckAnswer(const float* out, int32_t tokens, int64_t hidden);

// The common bookkeeping of an implementation: per-slot submitted state,
// the first failure, the time spent waiting. Submit/Wait of one slot come
// from one thread at a time; TakeStatus from any.
class ExpertSlotsBase : public ExpertSlots {
 public:
  ExpertSlotsBase(int64_t hidden, const ExpertSlotsOptions& opts);
  int num_slots() const override { return opts_.num_slots; }
  int32_t max_tokens() const override { return opts_.max_tokens; }
  int32_t top_k() const override { return opts_.top_k; }
  int64_t hidden() const override { return hidden_; }
  void Submit(int slot, int32_t layer, int32_t tokens, int32_t top_k) final;
  bool Arm(int slot, int32_t layer, int32_t tokens, int32_t top_k) final;
  void Wait(int slot) final;
  absl::Status TakeStatus() final;
  void Drain() final;
  int64_t TakeWaitNs() final;
  bool has_failure() const final { return failed_.load(std::memory_order_acquire); }
  absl::Duration call_timeout() const final { return opts_.call_timeout; }

 protected:
  // The call in slot `slot` (checked: in range, not pending, within the
  // capacity, tokens > 0); `deadline` is the call's.
  virtual absl::Status DoSubmit(int slot, int32_t layer, int32_t tokens, int32_t top_k,
                                absl::Time deadline) = 0;
  // ABORTED only for an armed call that was never sent (the device's pass
  // stopped first): released, and not a call the ledger counts.
  virtual absl::Status DoWait(int slot, absl::Time deadline) = 0;
  // `st` as TakeStatus reports it (ExpertSlotsOptions::map_failure).
  absl::Status Mapped(const absl::Status& st) const {
    return st.ok() || !opts_.map_failure ? st : opts_.map_failure(st);
  }
  // Arm's: the call written, not sent (only where device_wait().request != 0).
  virtual absl::Status DoArm(int slot, int32_t layer, int32_t tokens, int32_t top_k,
                             absl::Time deadline) {
    (void)slot, (void)layer, (void)tokens, (void)top_k, (void)deadline;
    return absl::UnimplementedError("this transport's slots are sent by the host only");
  }
  const ExpertSlotsOptions opts_;

 private:
  struct Call {
    bool pending = false;  // submitted, not yet waited
    bool sent = false;     // DoSubmit succeeded
    int32_t layer = 0, tokens = 0, top_k = 0;
    absl::Time started, deadline;
  };
  void Record(const absl::Status& st, int slot, int32_t layer);
  // Submit and Arm: checks, bookkeeping, then DoSubmit or DoArm; whether sent.
  bool Claim(int slot, int32_t layer, int32_t tokens, int32_t top_k, bool arm);
  const int64_t hidden_;
  std::vector<Call> calls_;  // by slot
  std::mutex mu_;
  absl::Status first_;               // guarded by mu_
  std::atomic<bool> failed_{false};  // !first_.ok(), readable without mu_
  std::atomic<int64_t> wait_ns_{0};
};

// Slots in this object's own page-aligned host memory (one region), for
// implementations whose transport copies the request (DoSubmit / DoWait
// left to them). Slot layout: hidden | ids | weights | out, each 64-aligned.
class HostMemorySlots : public ExpertSlotsBase {
 public:
  HostMemorySlots(int64_t hidden, const ExpertSlotsOptions& opts);
  ~HostMemorySlots() override;
  // Allocates the memory (RESOURCE_EXHAUSTED naming the size).
  absl::Status Init();
  absl::StatusOr<uint64_t> Prepare(absl::Time) override { return 1; }
  SlotView view(int slot) const override;
  std::vector<HostRegion> regions() const override { return {HostRegion{base_, bytes_}}; }

 private:
  uint64_t ids_off_ = 0, weights_off_ = 0, out_off_ = 0, slot_bytes_ = 0, bytes_ = 0;
  uint8_t* base_ = nullptr;
};

}  // namespace hmoe
