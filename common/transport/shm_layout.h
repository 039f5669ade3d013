// Shared-memory data plane (same host): the segment layout and protocol both
// ends follow (the service's end: expert_service/transport/shm_server.h; the
// worker's: gpu_worker/transport/shm_client.h).
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
#include <cstdint>

#include "absl/status/status.h"
#include "common/transport/moe_call.h"

namespace hmoe {

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

// ---- shared by both ends' code (not part of the layout) ----
namespace shm {

// `x` rounded up to a multiple of `a`.
uint64_t Align(uint64_t x, uint64_t a);
// Steady-clock ns (heartbeats).
uint64_t NowNs();
// Shared (not PRIVATE) futex ops: the word lives in a MAP_SHARED file mapping.
void FutexWait(std::atomic<uint32_t>* addr, uint32_t expected, int64_t timeout_ns);
void FutexWake(std::atomic<uint32_t>* addr);
// Random, never 0 (an unset header field).
uint64_t RandomOdd64();
// A pidfd of `pid`, or -1 with errno set (ESRCH: no such process).
int PidfdOpen(int32_t pid);
// True if the process behind `pidfd` (or, without one, `pid`) has exited.
bool PeerExited(int pidfd, int32_t pid);
// Slot i of a segment mapped at `base` with geometry `g`. The server passes
// the geometry as checked at attach: the header stays client-writable, so it
// never reads these fields from it again.
ShmSlot* SlotAt(uint8_t* base, const SlotGeometry& g, uint32_t i);
// The slot geometry `geo` lays out (what WriteHeader writes; the client keeps
// it privately too, as the service could rewrite the header).
SlotGeometry SlotGeometryOf(const ShmGeometry& geo);

}  // namespace shm
}  // namespace hmoe
