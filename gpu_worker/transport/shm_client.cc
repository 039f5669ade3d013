#include "gpu_worker/transport/shm_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gpu_worker/transport/grpc_client.h"

namespace hmoe {
namespace {

// Each control-plane RPC of a (re)connect, unless the call's deadline is nearer.
constexpr absl::Duration kControlTimeout = absl::Seconds(2);

}  // namespace

using shm::Align;
using shm::FutexWait;
using shm::FutexWake;
using shm::NowNs;
using shm::PeerExited;
using shm::PidfdOpen;
using shm::RandomOdd64;
using shm::SlotAt;
using shm::SlotGeometryOf;

struct ShmClient::Segment {
  uint8_t* base = nullptr;
  uint64_t size = 0;
  int fd = -1;         // the sealed memfd
  std::string path;    // /proc/<pid>/fd/<fd>, what the service opens
  uint64_t nonce = 0;  // random, in the header and the attach request
  int server_pidfd = -1;
  int32_t server_pid = 0;
  uint64_t epoch = 0;
  // The layout this client wrote; never read back from the header, which the
  // service can write.
  SlotGeometry geo;
  std::vector<int> owner;  // per slot: 0 free, 1 in use, 2 abandoned (reclaim once DONE)
  std::atomic<bool> dead{false};
  std::function<void(void*, uint64_t)> before_unmap;
  ShmHeader* header() const { return reinterpret_cast<ShmHeader*>(base); }
  // The service went away or gave the segment up.
  bool Gone() const {
    // A header epoch not ours: another server attached the segment (and
    // answers slots with its epoch); a fresh segment replaces it.
    return dead.load() || header()->closed.load() || header()->epoch.load() != epoch ||
           PeerExited(server_pidfd, server_pid);
  }
  ~Segment() {
    if (base) {
      if (before_unmap) before_unmap(base, size);
      header()->closed.store(1);
      header()->doorbell.fetch_add(1);
      FutexWake(&header()->doorbell);
      munmap(base, size);
    }
    if (fd >= 0) ::close(fd);
    if (server_pidfd >= 0) ::close(server_pidfd);
  }
};

void* ShmClient::segment() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seg_ ? seg_->base : nullptr;
}

absl::StatusOr<std::unique_ptr<ShmClient>> ShmClient::Create(std::shared_ptr<ControlClient> control,
                                                             const ShardInfo& info,
                                                             const ShmClientOptions& opts) {
  auto c = std::unique_ptr<ShmClient>(new ShmClient());
  c->control_ = std::move(control);
  c->opts_ = opts;
  c->geo_.slots = opts.slots;
  c->geo_.hidden = info.hidden;
  c->geo_.max_tokens = opts.max_tokens > 0 ? opts.max_tokens : info.max_tokens;
  c->geo_.max_top_k = info.top_k;
  c->info_ = info;
  auto seg = c->Connect(absl::InfiniteFuture());
  if (!seg.ok()) return seg.status();
  c->seg_ = std::move(*seg);
  return c;
}

ShmClient::~ShmClient() = default;

absl::StatusOr<std::shared_ptr<ShmClient::Segment>> ShmClient::Connect(absl::Time deadline) const {
  auto seg = std::make_shared<Segment>();
  seg->size = geo_.total_bytes();
  // A memfd, sized, then sealed against shrinking (and growing) before the
  // service sees it: it maps the file and must never find it truncated. The
  // fd stays open for the segment's life; the service opens it through
  // /proc/<our pid>/fd/<fd>.
  seg->fd = memfd_create("hmoe-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (seg->fd < 0)
    return absl::InternalError(absl::StrCat("shm: memfd_create: ", std::strerror(errno)));
  seg->path = absl::StrCat("/proc/", ::getpid(), "/fd/", seg->fd);
  // Private to our user (a memfd is created 0777): the service refuses any other.
  if (fchmod(seg->fd, 0600) != 0)
    return absl::InternalError(absl::StrCat("shm: chmod 600 the memfd: ", std::strerror(errno)));
  if (ftruncate(seg->fd, static_cast<off_t>(seg->size)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shm: ftruncate memfd to ", seg->size, " bytes: ", std::strerror(errno)));
  }
  if (fcntl(seg->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return absl::InternalError(absl::StrCat("shm: sealing the memfd: ", std::strerror(errno)));
  void* p = mmap(nullptr, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, seg->fd, 0);
  if (p == MAP_FAILED)
    return absl::InternalError(absl::StrCat(seg->path, ": mmap: ", std::strerror(errno)));
  seg->base = static_cast<uint8_t*>(p);
  ShmHeader* h = seg->header();
  geo_.WriteHeader(h);
  seg->geo = SlotGeometryOf(geo_);
  seg->nonce = RandomOdd64();
  h->nonce = seg->nonce;
  h->client_pid.store(static_cast<int32_t>(::getpid()));
  h->client_heartbeat_ns.store(NowNs());
  seg->owner.assign(geo_.slots, 0);
  // The service's pid may have changed since the last connection: ask again.
  // Each control RPC gets kControlTimeout or what is left of the call's deadline.
  bool capped = false;
  auto info = control_->Describe(ControlBudget(deadline, kControlTimeout, &capped));
  if (!info.ok()) {
    return SetupFailure(ControlFailure(info.status(), capped, "shm: describe"));
  }
  // A service restarted with other weights (model, format, part,
  // checkpoint) must not answer this worker's calls.
  RETURN_IF_ERROR(CheckServesTheSame(info_, *info, "shm"));
  seg->server_pid = static_cast<int32_t>(info->pid);
  seg->server_pidfd = PidfdOpen(seg->server_pid);
  auto epoch = control_->AttachShm(seg->path, ::getpid(), seg->nonce,
                                   ControlBudget(deadline, kControlTimeout, &capped));
  // As for describe: the service's refusals and deadlines keep their code,
  // anything else (shm off there, another hidden size, a path it cannot
  // open) means no segment from this service: UNAVAILABLE.
  if (!epoch.ok()) return SetupFailure(ControlFailure(epoch.status(), capped, "shm: attach"));
  seg->epoch = *epoch;
  // Only a segment handed out is announced before its unmap (one that failed
  // to attach was never seen, e.g. never cudaHostRegister-ed).
  seg->before_unmap = opts_.before_unmap;
  return seg;
}

absl::Status ShmClient::ConnectedLocked(std::unique_lock<std::mutex>& lock, absl::Time deadline) {
  while (true) {
    if (seg_ && seg_->Gone()) seg_.reset();  // discard: the service is gone or gave it up
    if (seg_) return absl::OkStatus();
    // One thread reconnects, without mu_ (its control RPCs may take
    // seconds; Wait and Release need mu_ meanwhile); others wait for it.
    if (connecting_) {
      if (connect_cv_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout &&
          connecting_) {
        return absl::DeadlineExceededError(
            "expert service (shm): a reconnect still running at the call's deadline");
      }
      continue;
    }
    connecting_ = true;
    lock.unlock();
    auto seg = Connect(deadline);
    lock.lock();
    connecting_ = false;
    connect_cv_.notify_all();
    if (!seg.ok()) return seg.status();
    seg_ = std::move(*seg);
  }
}

absl::StatusOr<uint64_t> ShmClient::EnsureSegment(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (fixed_seg_ && !fixed_seg_->Gone()) return fixed_gen_;
  fixed_seg_.reset();  // the last holder: before_unmap, then unmapped
  RETURN_IF_ERROR(ConnectedLocked(lock, deadline));
  fixed_seg_ = seg_;
  return ++fixed_gen_;
}

ShmClient::SlotView ShmClient::FixedView(uint32_t i, const float** out) const {
  std::lock_guard<std::mutex> lock(mu_);
  SlotView v;
  *out = nullptr;
  if (!fixed_seg_ || i >= fixed_seg_->geo.num_slots) return v;
  const SlotGeometry& g = fixed_seg_->geo;
  uint8_t* slot = reinterpret_cast<uint8_t*>(SlotAt(fixed_seg_->base, g, i));
  uint8_t* data = slot + kSlotHeaderBytes;
  const uint64_t t = static_cast<uint64_t>(geo_.max_tokens);
  const uint64_t io = Align(t * static_cast<uint64_t>(geo_.hidden) * 2, 64);
  const uint64_t wo = io + Align(t * static_cast<uint64_t>(geo_.max_top_k) * 4, 64);
  v.hidden = reinterpret_cast<uint16_t*>(data);
  v.ids = reinterpret_cast<int32_t*>(data + io);
  v.weights = reinterpret_cast<float*>(data + wo);
  v.state = &reinterpret_cast<ShmSlot*>(slot)->state;
  *out = reinterpret_cast<const float*>(slot + g.resp_offset);
  return v;
}

bool ShmClient::FixedServiceAlive() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fixed_seg_ && !fixed_seg_->Gone();
}

absl::StatusOr<uint64_t> ShmClient::SubmitFixed(uint32_t i, int32_t layer, int32_t tokens,
                                                int32_t top_k) {
  return ClaimFixed(i, layer, tokens, top_k, /*ring=*/true);
}

absl::StatusOr<uint64_t> ShmClient::ArmFixed(uint32_t i, int32_t layer, int32_t tokens,
                                             int32_t top_k) {
  return ClaimFixed(i, layer, tokens, top_k, /*ring=*/false);
}

void ShmClient::SetDevicePolling(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!fixed_seg_) return;
  ShmHeader* h = fixed_seg_->header();
  h->client_polling.store(on ? 1 : 0, std::memory_order_seq_cst);
  if (!on) return;
  // Rung, as a Submit does, so that a server about to sleep on the doorbell
  // (having read client_polling before this store) does not sleep.
  h->doorbell.fetch_add(1, std::memory_order_acq_rel);
  if (h->server_sleeping.load()) FutexWake(&h->doorbell);
}

absl::StatusOr<uint64_t> ShmClient::ClaimFixed(uint32_t i, int32_t layer, int32_t tokens,
                                               int32_t top_k, bool ring) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!fixed_seg_)
    return absl::FailedPreconditionError("expert service (shm): no segment (EnsureSegment first)");
  Segment& seg = *fixed_seg_;
  const SlotGeometry& g = seg.geo;
  if (i >= g.num_slots)
    return absl::FailedPreconditionError(
        absl::StrCat("expert service (shm): slot ", i, " of ", g.num_slots));
  if (seg.Gone()) {
    seg.dead.store(true);
    return absl::UnavailableError(absl::StrCat("expert service (shm): server pid ", seg.server_pid,
                                               " is gone; the segment is replaced before the next "
                                               "pass"));
  }
  if (tokens < 0 || tokens > geo_.max_tokens || top_k < 0 || top_k > geo_.max_top_k)
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", tokens, " x top_k ", top_k,
                                                   " over the fixed slot's ", geo_.max_tokens,
                                                   " x ", geo_.max_top_k));
  ShmSlot* s = SlotAt(seg.base, g, i);
  if (seg.owner[i] == 2 && s->state.load(std::memory_order_acquire) == kSlotDone) {
    // Reclaimed: FREE again, so that an armed call the device never sends
    // is told from one the service answered.
    s->state.store(kSlotFree, std::memory_order_release);
    seg.owner[i] = 0;
  }
  if (seg.owner[i] == 2)
    return absl::DeadlineExceededError(
        absl::StrCat("expert service (shm): slot ", i,
                     " still holds an abandoned call the service has not "
                     "finished"));
  if (seg.owner[i] == 1)
    return absl::FailedPreconditionError(
        absl::StrCat("expert service (shm): slot ", i, " is already claimed"));
  seg.owner[i] = 1;
  const uint64_t t = static_cast<uint64_t>(tokens), k = static_cast<uint64_t>(top_k);
  const uint64_t cap_t = static_cast<uint64_t>(geo_.max_tokens);
  const uint64_t seq = next_seq_++;
  Outstanding& o = outstanding_[seq];
  o.seg = fixed_seg_;
  o.slot = i;
  o.seq = seq;
  o.tokens = tokens;
  o.top_k = top_k;
  o.out_bytes = static_cast<int64_t>(t) * geo_.hidden * 4;
  o.hidden_bytes = t * static_cast<uint64_t>(geo_.hidden) * 2;
  o.ids_off = Align(cap_t * static_cast<uint64_t>(geo_.hidden) * 2, 64);
  o.ids_bytes = t * k * 4;
  o.weights_off = o.ids_off + Align(cap_t * static_cast<uint64_t>(geo_.max_top_k) * 4, 64);
  o.weights_bytes = t * k * 4;
  if (ring) {
    RingLocked(o, layer);
  } else {
    WriteCallLocked(o, layer);
  }
  return seq;
}

absl::StatusOr<ShmClient::SlotView> ShmClient::Acquire(int32_t tokens, int32_t top_k,
                                                       absl::Time deadline) {
  const uint64_t t = static_cast<uint64_t>(tokens > 0 ? tokens : 0);
  const uint64_t k = static_cast<uint64_t>(top_k > 0 ? top_k : 0);
  return AcquireBytes(tokens, top_k, t * static_cast<uint64_t>(geo_.hidden) * 2, t * k * 4,
                      t * k * 4, deadline);
}

// The byte sizes travel as given (a malformed call reaches the server, which
// rejects it naming the field), so they are not derived from the shape here.
absl::StatusOr<ShmClient::SlotView> ShmClient::AcquireBytes(int32_t tokens, int32_t top_k,
                                                            uint64_t hb, uint64_t ib, uint64_t wb,
                                                            absl::Time deadline) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        "expert service (shm): the call's deadline passed before it was sent");
  }
  std::unique_lock<std::mutex> lock(mu_);
  int slot_index = -1;
  while (true) {
    RETURN_IF_ERROR(ConnectedLocked(lock, deadline));
    const SlotGeometry& g = seg_->geo;
    // In 128 bits: byte sizes near 2^64 must not wrap under the capacity.
    const unsigned __int128 need =
        static_cast<unsigned __int128>(Align(hb, 64)) + Align(ib, 64) + wb;
    if (hb > g.req_capacity || ib > g.req_capacity || need > g.req_capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: ", tokens, " (", hb, " + ", ib, " + ", wb,
                       " request bytes) over the shared-memory slot capacity of ", g.req_capacity,
                       " bytes (", geo_.max_tokens, " tokens)"));
    }
    // A free slot, reclaiming abandoned ones the server has finished.
    int abandoned = 0, at_service = 0;
    for (uint32_t i = 0; i < g.num_slots && slot_index < 0; ++i) {
      ShmSlot* s = SlotAt(seg_->base, g, i);
      const uint32_t state = s->state.load(std::memory_order_acquire);
      if (seg_->owner[i] == 2 && state == kSlotDone) {
        s->state.store(kSlotFree, std::memory_order_release);
        seg_->owner[i] = 0;
      }
      if (seg_->owner[i] == 0) slot_index = static_cast<int>(i);
      if (seg_->owner[i] == 2) ++abandoned;
      if (state == kSlotRequest || state == kSlotBusy) ++at_service;
    }
    if (slot_index >= 0) break;
    // All busy. With calls at the service (in flight, or abandoned and not
    // finished: a stalled service) one frees by itself: wait for it, until
    // the call's deadline. Otherwise every slot is held by this client's own
    // handles (acquired and not committed, or answered and not released),
    // which only a Release or Wait frees: say so at once.
    if (at_service == 0 && abandoned == 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "expert service (shm): all ", g.num_slots,
          " slots held by this client's handles (acquired, or answered and not yet released)"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "expert service (shm): no free slot before the deadline: all ", g.num_slots,
          " slots busy (", abandoned, " with abandoned calls the service has not finished, ",
          g.num_slots - static_cast<uint32_t>(abandoned),
          " with calls not yet waited or released)"));
    }
    lock.unlock();
    absl::SleepFor(std::min(absl::Microseconds(200), deadline - absl::Now()));
    lock.lock();
  }
  Segment& seg = *seg_;
  const uint64_t io = Align(hb, 64), wo = io + Align(ib, 64);
  const uint32_t i = static_cast<uint32_t>(slot_index);
  seg.owner[i] = 1;
  uint8_t* data = reinterpret_cast<uint8_t*>(SlotAt(seg.base, seg.geo, i)) + kSlotHeaderBytes;
  const uint64_t seq = next_seq_++;
  Outstanding& o = outstanding_[seq];
  o.seg = seg_;
  o.slot = i;
  o.seq = seq;
  o.tokens = tokens;
  o.top_k = top_k;
  o.out_bytes = static_cast<int64_t>(tokens > 0 ? tokens : 0) * geo_.hidden * 4;
  o.hidden_bytes = hb;
  o.ids_off = io;
  o.ids_bytes = ib;
  o.weights_off = wo;
  o.weights_bytes = wb;
  SlotView v;
  v.handle = seq;
  v.hidden = reinterpret_cast<uint16_t*>(data);
  v.ids = reinterpret_cast<int32_t*>(data + io);
  v.weights = reinterpret_cast<float*>(data + wo);
  return v;
}

absl::Status ShmClient::Commit(uint64_t handle, int32_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = outstanding_.find(handle);
  if (it == outstanding_.end()) return absl::InvalidArgumentError("unknown handle");
  RingLocked(it->second, layer);
  return absl::OkStatus();
}

void ShmClient::WriteCallLocked(const Outstanding& o, int32_t layer) {
  ShmSlot* s = SlotAt(o.seg->base, o.seg->geo, o.slot);
  s->seq = o.seq;
  s->layer = layer;
  s->tokens = o.tokens;
  s->top_k = o.top_k;
  s->hidden_off = 0;
  s->hidden_bytes = o.hidden_bytes;
  s->ids_off = o.ids_off;
  s->ids_bytes = o.ids_bytes;
  s->weights_off = o.weights_off;
  s->weights_bytes = o.weights_bytes;
  s->client_sleeping.store(0);
}

void ShmClient::RingLocked(const Outstanding& o, int32_t layer) {
  ShmHeader* h = o.seg->header();
  ShmSlot* s = SlotAt(o.seg->base, o.seg->geo, o.slot);
  WriteCallLocked(o, layer);
  s->state.store(kSlotRequest, std::memory_order_release);
  h->doorbell.fetch_add(1, std::memory_order_acq_rel);
  if (h->server_sleeping.load()) FutexWake(&h->doorbell);
  h->client_heartbeat_ns.store(NowNs());
}

void ShmClient::Release(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = outstanding_.find(handle);
  if (it == outstanding_.end()) return;
  Outstanding& o = it->second;
  ShmSlot* s = SlotAt(o.seg->base, o.seg->geo, o.slot);
  s->state.store(kSlotFree, std::memory_order_release);
  o.seg->owner[o.slot] = 0;
  outstanding_.erase(it);
}

absl::StatusOr<uint64_t> ShmClient::Submit(const MoeCall& call, float* out, absl::Time deadline) {
  ASSIGN_OR_RETURN(SlotView v, AcquireBytes(call.tokens, call.top_k, call.hidden_bytes,
                                            call.ids_bytes, call.weights_bytes, deadline));
  if (call.hidden_bytes) std::memcpy(v.hidden, call.hidden, call.hidden_bytes);
  if (call.ids_bytes) std::memcpy(v.ids, call.ids, call.ids_bytes);
  if (call.weights_bytes) std::memcpy(v.weights, call.weights, call.weights_bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_[v.handle].out = out;
  }
  RETURN_IF_ERROR(Commit(v.handle, call.layer));
  return v.handle;
}

absl::Status ShmClient::Wait(uint64_t handle, absl::Time deadline) {
  float* out = nullptr;
  int64_t out_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = outstanding_.find(handle);
    if (it == outstanding_.end()) return absl::InvalidArgumentError("unknown handle");
    out = it->second.out;
    out_bytes = it->second.out_bytes;
  }
  ASSIGN_OR_RETURN(const float* answer, WaitInPlace(handle, deadline));
  if (out_bytes > 0) std::memcpy(out, answer, static_cast<size_t>(out_bytes));
  Release(handle);
  return absl::OkStatus();
}

absl::StatusOr<const float*> ShmClient::WaitInPlace(uint64_t handle, absl::Time deadline) {
  Outstanding o;  // a copy: the entry stays until Release (or a failure below)
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = outstanding_.find(handle);
    if (it == outstanding_.end()) return absl::InvalidArgumentError("unknown handle");
    o = it->second;
  }
  Segment& seg = *o.seg;
  const SlotGeometry& g = seg.geo;
  ShmSlot* s = SlotAt(seg.base, g, o.slot);
  const auto until = absl::ToChronoTime(deadline);
  const auto spin_until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(opts_.spin_us);
  absl::Status result;
  bool done = false;
  while (true) {
    if (s->state.load(std::memory_order_acquire) == kSlotDone) {
      done = true;
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now < spin_until) continue;
    if (std::chrono::system_clock::now() >= until) {
      result = absl::DeadlineExceededError("expert service (shm): no answer before the deadline");
      break;
    }
    if (seg.dead.load() || PeerExited(seg.server_pidfd, seg.server_pid)) {
      seg.dead.store(true);
      result = absl::UnavailableError(absl::StrCat("expert service (shm): server pid ",
                                                   seg.server_pid, " exited; segment discarded"));
      break;
    }
    if (seg.header()->closed.load()) {  // its shm server stopped (the process lives on)
      seg.dead.store(true);
      result =
          absl::UnavailableError(absl::StrCat("expert service (shm): server pid ", seg.server_pid,
                                              " closed the segment; segment discarded"));
      break;
    }
    s->client_sleeping.store(1);
    const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             until - std::chrono::system_clock::now())
                             .count();
    uint32_t cur = s->state.load(std::memory_order_acquire);
    if (cur != kSlotDone) FutexWait(&s->state, cur, std::clamp<int64_t>(left, 1000, 20'000'000));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!done) {
    outstanding_.erase(handle);
    if (seg.dead.load()) {
      if (seg_.get() == &seg) seg_.reset();  // the last holder unmaps it and closes the memfd
    } else {
      seg.owner[o.slot] = 2;  // reclaimed once the server finishes it
    }
    return result;
  }
  if (s->seq != o.seq || s->epoch != seg.epoch) {
    result = absl::DataLossError("expert service (shm): slot answered for another request/epoch");
  } else if (s->code != 0) {
    result = absl::Status(static_cast<absl::StatusCode>(s->code),
                          std::string(s->msg, std::min<size_t>(s->msg_len, sizeof(s->msg))));
  } else if (static_cast<int64_t>(s->out_bytes) != o.out_bytes || s->out_bytes > g.resp_capacity) {
    result = absl::InternalError("expert service (shm): response size mismatch");
  } else {
    // Held (owner 1, state done) until Release.
    return reinterpret_cast<const float*>(reinterpret_cast<uint8_t*>(s) + g.resp_offset);
  }
  outstanding_.erase(handle);
  s->state.store(kSlotFree, std::memory_order_release);
  seg.owner[o.slot] = 0;
  return result;
}

}  // namespace hmoe
