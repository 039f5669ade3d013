// Shared-memory data plane (same host).
//
// The worker creates a segment (a memfd), sizes it for its largest call,
// seals it against shrinking (F_SEAL_SHRINK: truncated under the service's
// mapping it would SIGBUS the service), and hands its path,
// /proc/<worker pid>/fd/<fd>, its pid and the segment's random nonce to the
// service over the control plane (ExpertControl.AttachShm). The service
// resolves the path without opening the target (O_PATH), accepts only a
// regular file on tmpfs (not hugetlbfs, whose hole punching could still
// SIGBUS it; not a device, FIFO or network file), reopens it, requires the
// seal and the nonce in its header, maps it and serves it from one thread per
// segment. Nothing is left in /dev/shm when both sides die. Layout (all offsets from
// the segment base, page-aligned so the worker can cudaHostRegister the whole segment and let the
// GPU copy straight into a slot's request region and out of its response region):
//
//   [0, 4096)            ShmHeader: magic, version, geometry, epoch, pids,
//                        doorbell futex, heartbeats
//   slots_offset + i * slot_bytes, i < num_slots:
//     [0, 256)           ShmSlot: state futex, sequence, epoch, call shape,
//                        request offsets/lengths, status, timings
//     [256, 256 + req_capacity)        request region: hidden | ids | weights
//     [resp_offset, resp_offset + resp_capacity)  response region: f32 [T][H]
//
// Protocol per slot: FREE -> (client) REQUEST -> (server) BUSY -> DONE ->
// (client, after reading) FREE. Doorbells: the client bumps header.doorbell
// and futex-wakes the server; the server sets slot.state and futex-wakes the
// client; both spin briefly before sleeping. A device (the GPU) may take the
// client's part without a doorbell: the host arms a slot (ArmFixed: every
// field but the state), the device stores REQUEST into its state and polls
// for DONE; meanwhile header.client_polling keeps the server scanning. The server treats every
// field the client wrote as untrusted: offsets and lengths are bounds-checked against the slot
// before use.
//
// Peer death: each side holds a pidfd of the other (pid from the control
// plane) and polls it whenever a futex wait times out; heartbeats (steady-clock
// ns) are written for diagnosis and for peers without pidfd. A dead service
// fails the client's calls with UNAVAILABLE and the client discards the
// segment (a later Submit re-attaches a fresh one); a dead client makes the
// service discard the segment (unmap; the memfd goes with it). A stopped (SIGSTOP) service is
// not dead: waits end in DEADLINE_EXCEEDED.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/moe_call.h"

namespace hmoe {

class ControlClient;

inline constexpr uint64_t kShmMagic = 0x31304D48534D4F48ull;  // "HOMSHM01"
inline constexpr uint32_t kShmVersion = 3;

enum ShmSlotState : uint32_t { kSlotFree = 0, kSlotRequest = 1, kSlotBusy = 2, kSlotDone = 3 };

struct alignas(64) ShmHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_slots;
  uint64_t slot_bytes;
  uint64_t slots_offset;
  uint64_t req_capacity;
  uint64_t resp_offset;  // within a slot
  uint64_t resp_capacity;
  uint64_t total_bytes;
  int64_t hidden;
  uint64_t nonce;               // the client's random id of this segment, repeated in AttachShm
  std::atomic<uint64_t> epoch;  // written by the server at attach
  std::atomic<int32_t> server_pid;
  std::atomic<int32_t> client_pid;
  std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> server_sleeping;
  std::atomic<uint64_t> server_heartbeat_ns;
  std::atomic<uint64_t> client_heartbeat_ns;
  std::atomic<uint32_t> closed;  // either side gave the segment up
  // Set by the client while a device may send calls by storing REQUEST into
  // a slot's state without ringing the doorbell: the server then also scans
  // the slots while idle and sleeps only briefly (ShmClient::SetDevicePolling).
  std::atomic<uint32_t> client_polling;
};

struct alignas(64) ShmSlot {
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> client_sleeping;
  uint64_t seq;
  uint64_t epoch;
  int32_t layer, tokens, top_k, code;
  uint64_t hidden_off, hidden_bytes, ids_off, ids_bytes, weights_off, weights_bytes;
  uint64_t out_bytes;
  uint64_t compute_ns;
  uint32_t msg_len;
  char msg[132];
};
static_assert(sizeof(ShmSlot) <= 256);

struct ShmGeometry {
  uint32_t slots = 4;
  int64_t hidden = 0;
  int64_t max_tokens = 256;
  int64_t max_top_k = 8;
  uint64_t req_capacity() const;
  uint64_t resp_capacity() const;
  uint64_t slot_bytes() const;
  uint64_t total_bytes() const;
  // Writes the layout fields of a fresh segment's header (magic, version,
  // slot geometry, total size, hidden); pids, epoch and futexes untouched.
  void WriteHeader(ShmHeader* h) const;
};

// The slot layout a segment's header describes. Client-written: the service
// reads it once and checks that copy (CheckSlotGeometry) before any use.
struct SlotGeometry {
  uint32_t num_slots = 0;
  uint64_t slots_offset = 0, slot_bytes = 0, req_capacity = 0, resp_offset = 0, resp_capacity = 0;
};
// Bytes of a slot's header (ShmSlot, padded); its request region follows.
inline constexpr uint64_t kSlotHeaderBytes = 256;
// INVALID_ARGUMENT ("slot geometry outside the segment") unless 1..4096
// slots of 64-byte multiples lie inside `segment_bytes` past the header,
// each with its request region before its 64-aligned response region.
absl::Status CheckSlotGeometry(const SlotGeometry& g, uint64_t segment_bytes);

// What a slot's client-written header asks, read once.
struct SlotRequest {
  int32_t layer = 0, tokens = 0, top_k = 0;
  uint64_t hidden_off = 0, hidden_bytes = 0, ids_off = 0, ids_bytes = 0, weights_off = 0,
           weights_bytes = 0;
};
// Fills `call`'s shape from `r` (its pointers left null) after checking that
// each array lies inside the slot's request region of `g` (aligned to its
// element), that `tokens` rows of `info.hidden` f32 fit the response region,
// and ValidateMoeCallShape; INVALID_ARGUMENT naming the field.
absl::Status CheckSlotRequest(const SlotRequest& r, const SlotGeometry& g, const ShardInfo& info,
                              MoeCall* call);

// Service side: one thread per attached segment.
class ShmServer {
 public:
  static constexpr size_t kDefaultMaxSessions = 1024;
  // Serves at most `max_sessions` segments at once (segments of dead clients
  // are dropped first).
  explicit ShmServer(MoeHandler* handler, size_t max_sessions = kDefaultMaxSessions);
  ~ShmServer();
  // Maps `path` (/proc/<client_pid>/fd/<n>: the client's memfd on tmpfs,
  // sealed with F_SEAL_SHRINK, whose header carries `nonce`; INVALID_ARGUMENT
  // otherwise), checks its header, starts serving it; returns the epoch
  // written into it. The nonce guards against a stale attach finding a newer
  // segment under a reused fd number. A segment already served:
  // ALREADY_EXISTS; max_sessions segments served: RESOURCE_EXHAUSTED.
  absl::StatusOr<uint64_t> Attach(const std::string& path, int64_t client_pid, uint64_t nonce);
  uint64_t sessions() const;
  uint64_t discarded() const { return discarded_.load(); }

 private:
  struct Session;
  void Serve(Session* s);
  MoeHandler* handler_;
  const size_t max_sessions_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<Session>> sessions_;
  std::atomic<uint64_t> next_epoch_;
  std::atomic<uint64_t> discarded_{0};
  std::atomic<bool> stop_{false};
};

struct ShmClientOptions {
  uint32_t slots = 4;
  int64_t max_tokens = 0;  // 0: the shard's max_tokens
  int spin_us = 30;        // spin before futex sleep
  // Called with a segment's mapping just before it is unmapped (e.g. to
  // cudaHostUnregister it); may be empty.
  std::function<void(void* base, uint64_t bytes)> before_unmap;
};

// Worker side.
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
