#include "expert_service/transport/shm_server.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
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

namespace hmoe {
namespace {

void SetMessage(ShmSlot* s, const absl::Status& st) {
  s->code = static_cast<int32_t>(st.code());
  const size_t n = std::min(st.message().size(), sizeof(s->msg));
  if (n > 0) std::memcpy(s->msg, st.message().data(), n);
  s->msg_len = static_cast<uint32_t>(n);
}

}  // namespace

struct ShmServer::Session {
  std::string path;
  std::mutex mu;            // guards base against Serve's unmap at the end
  uint8_t* base = nullptr;  // null once Serve has dropped a dead client's segment
  uint64_t size = 0;
  SlotGeometry geo;
  // Private copies of each call's ids and weights: validated once, used as
  // validated (the client can still write the slot while it is BUSY).
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int client_pidfd = -1;
  int32_t client_pid = 0;
  uint64_t nonce = 0;
  uint64_t epoch = 0;
  std::atomic<bool> stop{false};
  std::atomic<bool> finished{false};
  std::thread thread;
  ~Session() {
    if (base) munmap(base, size);
    if (client_pidfd >= 0) ::close(client_pidfd);
  }
};

ShmServer::ShmServer(MoeHandler* handler, size_t max_sessions)
    : handler_(handler), max_sessions_(max_sessions) {
  next_epoch_ = shm::RandomOdd64();
}

ShmServer::~ShmServer() {
  stop_ = true;
  std::map<uint64_t, std::unique_ptr<Session>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(sessions_);
  }
  for (auto& [id, s] : all) {
    s->stop = true;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->base != nullptr) {
        auto* h = reinterpret_cast<ShmHeader*>(s->base);
        h->closed.store(1);
        h->doorbell.fetch_add(1);
        shm::FutexWake(&h->doorbell);
      }
    }
    if (s->thread.joinable()) s->thread.join();
  }
}

uint64_t ShmServer::sessions() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (auto& [id, s] : sessions_) n += !s->finished.load();
  return n;
}

absl::StatusOr<uint64_t> ShmServer::Attach(const std::string& path, int64_t client_pid,
                                           uint64_t nonce) {
  if (client_pid <= 0 || client_pid > INT32_MAX)
    return absl::InvalidArgumentError(
        absl::StrCat("client_pid: ", client_pid, " is not a process id"));
  // The segment is the client's sealed memfd, reached through its fd table:
  // exactly /proc/<client_pid>/fd/<n>, nothing else is opened.
  const std::string prefix = absl::StrCat("/proc/", client_pid, "/fd/");
  if (path.rfind(prefix, 0) != 0 || path.size() == prefix.size() ||
      path.size() > prefix.size() + 9 ||
      path.find_first_not_of("0123456789", prefix.size()) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("path: \"", path, "\" is not ", prefix, "<fd> (the client's memfd)"));
  }
  auto s = std::make_unique<Session>();
  s->path = path;
  s->nonce = nonce;
  s->client_pid = static_cast<int32_t>(client_pid);
  s->client_pidfd = shm::PidfdOpen(s->client_pid);
  if (s->client_pidfd < 0 && errno == ESRCH) {
    return absl::InvalidArgumentError(absl::StrCat("client_pid: ", client_pid, " is not running"));
  }
  // Resolved without opening the target (O_PATH: no driver open, no FUSE or
  // NFS round trip); only a regular file on tmpfs is opened for real.
  const int pfd = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (pfd < 0) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  struct stat st;
  struct statfs sfs;
  const bool regular = fstat(pfd, &st) == 0 && S_ISREG(st.st_mode);
  const bool tmpfs = fstatfs(pfd, &sfs) == 0 && sfs.f_type == TMPFS_MAGIC;
  if (!regular || !tmpfs) {
    ::close(pfd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a segment (",
                     !regular ? "not a regular file" : "not on tmpfs: not a memfd", ")"));
  }
  const int fd = ::open(absl::StrCat("/proc/self/fd/", pfd).c_str(), O_RDWR | O_CLOEXEC);
  const int open_errno = errno;
  ::close(pfd);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(open_errno)));
  // Only our own user's private segment: a memfd is created mode 0777; the
  // client makes it 0600 before asking for the attach.
  if (fstat(fd, &st) != 0 || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": not a segment private to this service's user (owner and mode 0600)"));
  }
  // Sealed against shrinking, or the client could truncate it under our
  // mapping and every later access would SIGBUS the service.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a memfd sealed with F_SEAL_SHRINK (",
        seals < 0 ? std::string(std::strerror(errno)) : absl::StrCat("seals 0x", absl::Hex(seals)),
        ")"));
  }
  // Size read after the seal check: from here it can only grow.
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < sizeof(ShmHeader)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a segment (too small)"));
  }
  s->size = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED)
    return absl::InternalError(absl::StrCat(path, ": mmap: ", std::strerror(errno)));
  s->base = static_cast<uint8_t*>(p);
  auto* h = reinterpret_cast<ShmHeader*>(s->base);
  const ShardInfo& info = handler_->info();
  // Header geometry is client-written: read it once, check that copy
  // describes slots inside the file, and use only the copy from here on.
  if (h->magic != kShmMagic || h->version != kShmVersion) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad magic/version"));
  }
  if (h->nonce != nonce) {
    // Neither nonce is told: a live segment's nonce is what lets a caller
    // attach it.
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": holds another segment than the one requested (the fd number was "
                     "reused?)"));
  }
  const int64_t hidden = h->hidden;
  if (hidden != info.hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": hidden ", hidden, " != the shard's ", info.hidden));
  }
  SlotGeometry& g = s->geo;
  g.num_slots = h->num_slots;
  g.slots_offset = h->slots_offset;
  g.slot_bytes = h->slot_bytes;
  g.req_capacity = h->req_capacity;
  g.resp_offset = h->resp_offset;
  g.resp_capacity = h->resp_capacity;
  RETURN_IF_ERROR(Annotate(CheckSlotGeometry(g, s->size), path));
  Session* raw = s.get();
  uint64_t epoch = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The destructor swaps sessions_ out under mu_ after setting stop_: a
    // session added after that would never be joined.
    if (stop_.load()) return absl::UnavailableError("shm: the shared-memory server is stopping");
    // Reap sessions whose thread ended.
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second->finished.load()) {
        it->second->thread.join();
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
    // One serving thread per segment: a second attach of the same one would
    // have two threads claim its slots and rewrite its epoch.
    for (const auto& [e, other] : sessions_) {
      if (other->nonce == nonce) {
        return absl::AlreadyExistsError(absl::StrCat(path, ": segment is already attached"));
      }
    }
    if (sessions_.size() >= max_sessions_) {
      return absl::ResourceExhaustedError(absl::StrCat("shm: ", sessions_.size(),
                                                       " segments attached, the service's cap (",
                                                       max_sessions_, ", --max-peers)"));
    }
    s->epoch = next_epoch_.fetch_add(2);
    epoch = s->epoch;
    h->epoch.store(epoch);
    h->server_pid.store(static_cast<int32_t>(::getpid()));
    h->server_heartbeat_ns.store(shm::NowNs());
    // Started under the lock: a reaper never sees a session without its thread.
    raw->thread = std::thread(&ShmServer::Serve, this, raw);
    sessions_[epoch] = std::move(s);
  }
  return epoch;
}

void ShmServer::Serve(Session* s) {
  auto* h = reinterpret_cast<ShmHeader*>(s->base);
  const SlotGeometry& g = s->geo;
  const uint32_t n = g.num_slots;
  const uint64_t resp_off = g.resp_offset;
  const uint64_t row_bytes = static_cast<uint64_t>(handler_->info().hidden) * 4;  // one output row
  uint32_t next = 0;
  bool client_gone = false;
  while (!s->stop.load() && !stop_.load()) {
    const uint32_t bell = h->doorbell.load(std::memory_order_acquire);
    bool worked = false;
    for (uint32_t j = 0; j < n; ++j) {
      const uint32_t i = (next + j) % n;
      ShmSlot* slot = shm::SlotAt(s->base, g, i);
      uint32_t expect = kSlotRequest;
      if (!slot->state.compare_exchange_strong(expect, kSlotBusy, std::memory_order_acq_rel))
        continue;
      worked = true;
      next = i + 1;
      uint8_t* data = reinterpret_cast<uint8_t*>(slot) + kSlotHeaderBytes;
      // Copy the client-written description once, then check every range.
      SlotRequest r;
      r.layer = slot->layer;
      r.tokens = slot->tokens;
      r.top_k = slot->top_k;
      r.hidden_off = slot->hidden_off;
      r.hidden_bytes = slot->hidden_bytes;
      r.ids_off = slot->ids_off;
      r.ids_bytes = slot->ids_bytes;
      r.weights_off = slot->weights_off;
      r.weights_bytes = slot->weights_bytes;
      const uint64_t ho = r.hidden_off, io = r.ids_off, ib = r.ids_bytes, wo = r.weights_off,
                     wb = r.weights_bytes;
      MoeCall call;
      bool handled = false;
      // Sizes first: nothing is copied for a call that cannot be valid
      // (the client chooses the segment's size, and these lengths).
      absl::Status st = CheckSlotRequest(r, g, handler_->info(), &call);
      if (st.ok()) {
        // Hidden rows are read in place (their values never steer an
        // address); ids and weights are copied, then validated and used.
        s->ids.resize(ib / 4);
        s->weights.resize(wb / 4);
        if (ib > 0) std::memcpy(s->ids.data(), data + io, ib / 4 * 4);
        if (wb > 0) std::memcpy(s->weights.data(), data + wo, wb / 4 * 4);
        call.hidden = reinterpret_cast<const uint16_t*>(data + ho);
        call.ids = s->ids.data();
        call.weights = s->weights.data();
        uint64_t ns = 0;
        float* out = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(slot) + resp_off);
        st = handler_->Handle(call, out, &ns);
        slot->compute_ns = ns;
        slot->out_bytes = st.ok() ? static_cast<uint64_t>(call.tokens) * row_bytes : 0;
        handled = true;
      }
      if (!handled) handler_->Refused(st);
      SetMessage(slot, st);
      slot->epoch = s->epoch;
      // seq_cst, not release: the store must not pass the load of
      // client_sleeping below (the client stores that, then loads state).
      slot->state.store(kSlotDone, std::memory_order_seq_cst);
      if (slot->client_sleeping.load()) shm::FutexWake(&slot->state);
    }
    if (worked) continue;
    // Idle: spin briefly on the doorbell, then sleep on it. While the client
    // polls (a device sends calls by their state alone), also scan the
    // slots, spin up to 100 ms and then sleep 1 ms at a time.
    const bool polling = h->client_polling.load(std::memory_order_acquire) != 0;
    auto requested = [&] {
      for (uint32_t i = 0; i < n; ++i)
        if (shm::SlotAt(s->base, g, i)->state.load(std::memory_order_acquire) == kSlotRequest)
          return true;
      return false;
    };
    const auto spin_until =
        std::chrono::steady_clock::now() +
        (polling ? std::chrono::microseconds(100'000) : std::chrono::microseconds(50));
    bool woke = false;
    while (
        !(woke = h->doorbell.load(std::memory_order_acquire) != bell || (polling && requested())) &&
        std::chrono::steady_clock::now() < spin_until) {
    }
    if (woke) continue;
    h->server_sleeping.store(1);
    shm::FutexWait(&h->doorbell, bell, polling ? 1'000'000 : 50'000'000);
    h->server_sleeping.store(0);
    h->server_heartbeat_ns.store(shm::NowNs());
    if (shm::PeerExited(s->client_pidfd, s->client_pid) || h->closed.load()) {
      client_gone = true;
      break;
    }
  }
  if (client_gone) {
    // The worker is gone: whatever it left half-written is dropped with the
    // segment, and so are this session's mapping and pidfd (not kept until
    // the next attach). The memfd goes with the last mapping.
    discarded_.fetch_add(1);
    std::lock_guard<std::mutex> lock(s->mu);
    munmap(s->base, s->size);
    s->base = nullptr;
    if (s->client_pidfd >= 0) ::close(s->client_pidfd);
    s->client_pidfd = -1;
  }
  s->finished.store(true);
}

}  // namespace hmoe
