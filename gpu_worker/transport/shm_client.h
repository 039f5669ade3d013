// The shared-memory data plane's worker end (the layout and protocol:
// common/transport/shm_layout.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/moe_call.h"
#include "common/transport/shm_layout.h"

namespace hmoe {

class ControlClient;

struct ShmClientOptions {
  uint32_t slots = 4;
  int64_t max_tokens = 0;  // 0: the shard's max_tokens
  int spin_us = 30;        // spin before futex sleep
  // Called with a segment's mapping just before it is unmapped (e.g. to
  // cudaHostUnregister it); may be empty.
  std::function<void(void* base, uint64_t bytes)> before_unmap;
};

class ShmClient : public MoeClient {
 public:
  static absl::StatusOr<std::unique_ptr<ShmClient>> Create(std::shared_ptr<ControlClient> control,
                                                           const ShardInfo& info,
                                                           const ShmClientOptions& opts = {});
  ~ShmClient() override;
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline) override;
  absl::Status Wait(uint64_t handle, absl::Time deadline) override;
  const char* transport() const override { return "shm"; }

  // Zero-copy use (the GPU path). Acquire reserves a free slot for `tokens` x
  // `top_k`, waiting for one held by a call at the service (or for a
  // reconnect) until `deadline` (then DEADLINE_EXCEEDED, naming how many
  // slots abandoned calls still hold); RESOURCE_EXHAUSTED at once when every
  // slot is held by this client's own handles,
  // and returns where the request goes inside the mapped segment: the
  // caller writes it in place (e.g. a cudaMemcpyAsync into the registered
  // segment), then Commit(handle, layer) rings the doorbell. WaitInPlace
  // returns the f32 answer [tokens][hidden] where it lies in the slot, valid
  // until Release(handle); on error the slot is already released. Every
  // acquired handle ends in exactly one Release (after WaitInPlace succeeded)
  // or a failed WaitInPlace. Submit/Wait are these plus one copy each way.
  struct SlotView {
    uint64_t handle = 0;
    uint16_t* hidden = nullptr;  // bf16 [tokens][hidden]
    int32_t* ids = nullptr;      // [tokens][top_k]
    float* weights = nullptr;    // [tokens][top_k]
    // FixedView only: the slot's state word (ShmSlotState), REQUEST or BUSY
    // while a call is at the service (for a device that waits by polling).
    std::atomic<uint32_t>* state = nullptr;
  };
  absl::StatusOr<SlotView> Acquire(int32_t tokens, int32_t top_k, absl::Time deadline);
  absl::Status Commit(uint64_t handle, int32_t layer);
  absl::StatusOr<const float*> WaitInPlace(uint64_t handle, absl::Time deadline);
  void Release(uint64_t handle);

  // Fixed-slot use (ExpertSlots over shm). Slot i always lays its request
  // out for the segment's full geometry (hidden at 0, ids and weights at
  // fixed offsets), so its addresses stay put while the segment does; the
  // segment is kept mapped until the next EnsureSegment, even after the
  // service died. EnsureSegment is the only fixed-slot call that connects:
  // it replaces a segment whose service went away (until `deadline`) and
  // returns the segment's generation (a new one per segment).
  absl::StatusOr<uint64_t> EnsureSegment(absl::Time deadline);
  // Slot i's regions in the segment of the last EnsureSegment (null before).
  SlotView FixedView(uint32_t i, const float** out) const;
  // Claims slot i for `tokens` x `top_k` and rings the doorbell; never
  // waits: UNAVAILABLE when the segment's service went away,
  // DEADLINE_EXCEEDED while the slot still holds an abandoned call the
  // service has not finished, FAILED_PRECONDITION for a slot already
  // claimed or out of range, INVALID_ARGUMENT over the slot's capacity.
  // Then WaitInPlace and Release as for Acquire.
  absl::StatusOr<uint64_t> SubmitFixed(uint32_t i, int32_t layer, int32_t tokens, int32_t top_k);
  // SubmitFixed without the send: slot i is claimed and its call written,
  // all but its state, which whoever sends it (a device) sets to REQUEST
  // (while SetDevicePolling(true)). Same errors; then WaitInPlace and Release.
  absl::StatusOr<uint64_t> ArmFixed(uint32_t i, int32_t layer, int32_t tokens, int32_t top_k);
  // While on, the fixed-slot segment's server also scans for slots set to
  // REQUEST without a doorbell and sleeps at most ~1 ms (it is woken here
  // when turned on). A no-op without a segment.
  void SetDevicePolling(bool on);

  // False once the service of the fixed-slot segment went away (or none is
  // attached): its pid exited or it closed the segment. Any thread.
  bool FixedServiceAlive() const;

  // The mapped segment (for cudaHostRegister); null while disconnected.
  void* segment() const;
  uint64_t segment_bytes() const { return geo_.total_bytes(); }

  struct Segment;  // the memfd, its mapping, the server's pidfd; all released when dropped

 private:
  ShmClient() = default;
  // A new segment, attached by the service; mu_ not held (the RPCs may take seconds).
  absl::StatusOr<std::shared_ptr<Segment>> Connect(absl::Time deadline) const;
  absl::StatusOr<SlotView> AcquireBytes(int32_t tokens, int32_t top_k, uint64_t hidden_bytes,
                                        uint64_t ids_bytes, uint64_t weights_bytes,
                                        absl::Time deadline);
  struct Outstanding {
    std::shared_ptr<Segment> seg;
    uint32_t slot = 0;
    uint64_t seq = 0;
    float* out = nullptr;  // Submit's destination (null for zero-copy use)
    int64_t out_bytes = 0;
    int32_t tokens = 0, top_k = 0;
    uint64_t hidden_bytes = 0, ids_off = 0, ids_bytes = 0, weights_off = 0, weights_bytes = 0;
  };
  // With mu_ held (through `lock`): a live segment in seg_, reconnecting
  // (mu_ released meanwhile) when the last one's service went away.
  absl::Status ConnectedLocked(std::unique_lock<std::mutex>& lock, absl::Time deadline);
  // With mu_ held: writes o's call into its slot (all but the state).
  void WriteCallLocked(const Outstanding& o, int32_t layer);
  // With mu_ held: writes o's call into its slot and rings the doorbell.
  void RingLocked(const Outstanding& o, int32_t layer);
  // SubmitFixed / ArmFixed: claims slot i and writes its call; rings if `ring`.
  absl::StatusOr<uint64_t> ClaimFixed(uint32_t i, int32_t layer, int32_t tokens, int32_t top_k,
                                      bool ring);

  std::shared_ptr<ControlClient> control_;
  ShmClientOptions opts_;
  ShmGeometry geo_;
  ShardInfo info_;  // what the service served at Create; each reconnect checks it still does
  mutable std::mutex mu_;
  std::condition_variable connect_cv_;
  bool connecting_ = false;  // a thread is in Connect (mu_)
  std::shared_ptr<Segment> seg_;
  std::shared_ptr<Segment> fixed_seg_;  // fixed-slot use: kept until EnsureSegment replaces it
  uint64_t fixed_gen_ = 0;
  uint64_t next_seq_ = 1;
  std::map<uint64_t, Outstanding> outstanding_;
};

}  // namespace hmoe