#include "common/transport/shm_layout.h"

#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <random>

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace shm {

uint64_t Align(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void FutexWait(std::atomic<uint32_t>* addr, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000),
              static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

uint64_t RandomOdd64() {
  std::random_device rd;
  return (uint64_t{rd()} << 32 | rd()) | 1;
}

int PidfdOpen(int32_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

bool PeerExited(int pidfd, int32_t pid) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

ShmSlot* SlotAt(uint8_t* base, const SlotGeometry& g, uint32_t i) {
  return reinterpret_cast<ShmSlot*>(base + g.slots_offset + uint64_t{i} * g.slot_bytes);
}
SlotGeometry SlotGeometryOf(const ShmGeometry& geo) {
  SlotGeometry g;
  g.num_slots = geo.slots;
  g.slots_offset = 4096;
  g.slot_bytes = geo.slot_bytes();
  g.req_capacity = geo.req_capacity();
  g.resp_offset = Align(kSlotHeaderBytes + geo.req_capacity(), 64);
  g.resp_capacity = geo.resp_capacity();
  return g;
}

}  // namespace shm

using shm::Align;
using shm::SlotGeometryOf;

absl::Status CheckSlotGeometry(const SlotGeometry& g, uint64_t segment_bytes) {
  const unsigned __int128 end = static_cast<unsigned __int128>(g.slots_offset) +
                                static_cast<unsigned __int128>(g.num_slots) * g.slot_bytes;
  if (g.num_slots == 0 || g.num_slots > 4096 || g.slots_offset < sizeof(ShmHeader) ||
      g.slots_offset % 64 != 0 || g.slot_bytes % 64 != 0 || end > segment_bytes ||
      g.req_capacity > g.slot_bytes || g.resp_offset % 64 != 0 ||
      static_cast<unsigned __int128>(g.resp_offset) <
          static_cast<unsigned __int128>(kSlotHeaderBytes) + g.req_capacity ||
      static_cast<unsigned __int128>(g.resp_offset) + g.resp_capacity > g.slot_bytes) {
    return absl::InvalidArgumentError("slot geometry outside the segment");
  }
  return absl::OkStatus();
}

absl::Status CheckSlotRequest(const SlotRequest& r, const SlotGeometry& g, const ShardInfo& info,
                              MoeCall* call) {
  const uint64_t req_cap = g.req_capacity, resp_cap = g.resp_capacity;
  const uint64_t row_bytes = static_cast<uint64_t>(std::max<int64_t>(info.hidden, 1)) * 4;
  auto in_range = [&](uint64_t off, uint64_t len, uint64_t align) {
    return off <= req_cap && len <= req_cap - off && off % align == 0;
  };
  if (!in_range(r.hidden_off, r.hidden_bytes, 2))
    return absl::InvalidArgumentError("hidden: offset/length outside the slot's request region");
  if (!in_range(r.ids_off, r.ids_bytes, 4))
    return absl::InvalidArgumentError(
        "expert_ids: offset/length outside the slot's request region");
  if (!in_range(r.weights_off, r.weights_bytes, 4))
    return absl::InvalidArgumentError(
        "expert_weights: offset/length outside the slot's request region");
  if (r.tokens > 0 && static_cast<uint64_t>(r.tokens) * row_bytes > resp_cap)
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", r.tokens,
                                                   " exceeds the segment's response capacity (",
                                                   resp_cap / row_bytes, " tokens)"));
  *call = MoeCall{};
  call->layer = r.layer;
  call->tokens = r.tokens;
  call->top_k = r.top_k;
  call->hidden_bytes = r.hidden_bytes;
  call->ids_bytes = r.ids_bytes;
  call->weights_bytes = r.weights_bytes;
  return ValidateMoeCallShape(info, *call);
}

uint64_t ShmGeometry::req_capacity() const {
  const uint64_t t = static_cast<uint64_t>(max_tokens), k = static_cast<uint64_t>(max_top_k);
  return Align(t * static_cast<uint64_t>(hidden) * 2, 64) + Align(t * k * 4, 64) * 2;
}
uint64_t ShmGeometry::resp_capacity() const {
  return Align(static_cast<uint64_t>(max_tokens) * static_cast<uint64_t>(hidden) * 4, 64);
}
uint64_t ShmGeometry::slot_bytes() const {
  return Align(kSlotHeaderBytes + req_capacity() + resp_capacity(), 4096);
}
uint64_t ShmGeometry::total_bytes() const { return 4096 + uint64_t{slots} * slot_bytes(); }
void ShmGeometry::WriteHeader(ShmHeader* h) const {
  const SlotGeometry g = SlotGeometryOf(*this);
  h->magic = kShmMagic;
  h->version = kShmVersion;
  h->num_slots = g.num_slots;
  h->slot_bytes = g.slot_bytes;
  h->slots_offset = g.slots_offset;
  h->req_capacity = g.req_capacity;
  h->resp_offset = g.resp_offset;
  h->resp_capacity = g.resp_capacity;
  h->total_bytes = total_bytes();
  h->hidden = hidden;
}

}  // namespace hmoe
