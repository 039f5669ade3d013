#include "common/transport/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <linux/magic.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/grpc_client.h"

namespace hmoe {
namespace {

// Each control-plane RPC of a (re)connect, unless the call's deadline is nearer.
constexpr absl::Duration kControlTimeout = absl::Seconds(2);
// Segments one service serves at once (each has a serving thread).

uint64_t Align(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Shared (not PRIVATE) futex ops: the word lives in a MAP_SHARED file mapping.
void FutexWait(std::atomic<uint32_t>* addr, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000),
              static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWake(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Random, never 0 (an unset header field).
uint64_t RandomOdd64() {
  std::random_device rd;
  return (uint64_t{rd()} << 32 | rd()) | 1;
}

int PidfdOpen(int32_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

// True if the process behind `pidfd` (or, without one, `pid`) has exited.
bool PeerExited(int pidfd, int32_t pid) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

// The slot geometry as checked at attach. The header stays client-writable,
// so the server never reads these fields from it again.
ShmSlot* SlotAt(uint8_t* base, const SlotGeometry& g, uint32_t i) {
  return reinterpret_cast<ShmSlot*>(base + g.slots_offset + uint64_t{i} * g.slot_bytes);
}
// Client side: the geometry it wrote into its segment's header, kept
// privately too (the service could rewrite the header).
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

void SetMessage(ShmSlot* s, const absl::Status& st) {
  s->code = static_cast<int32_t>(st.code());
  const size_t n = std::min(st.message().size(), sizeof(s->msg));
  if (n > 0) std::memcpy(s->msg, st.message().data(), n);
  s->msg_len = static_cast<uint32_t>(n);
}

}  // namespace

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

// ---- server -------------------------------------------------------------------

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
  next_epoch_ = RandomOdd64();
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
        FutexWake(&h->doorbell);
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
  s->client_pidfd = PidfdOpen(s->client_pid);
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
    return absl::InvalidArgumentError(absl::StrCat(path, ": holds segment ", absl::Hex(h->nonce),
                                                   ", not the requested ", absl::Hex(nonce),
                                                   " (the fd number was reused)"));
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
        return absl::AlreadyExistsError(absl::StrCat(path, ": segment ", absl::Hex(nonce),
                                                     " is already attached (epoch ", e, ")"));
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
    h->server_heartbeat_ns.store(NowNs());
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
      ShmSlot* slot = SlotAt(s->base, g, i);
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
      if (slot->client_sleeping.load()) FutexWake(&slot->state);
    }
    if (worked) continue;
    // Idle: spin briefly on the doorbell, then sleep on it. While the client
    // polls (a device sends calls by their state alone), also scan the
    // slots, spin up to 100 ms and then sleep 1 ms at a time.
    const bool polling = h->client_polling.load(std::memory_order_acquire) != 0;
    auto requested = [&] {
      for (uint32_t i = 0; i < n; ++i)
        if (SlotAt(s->base, g, i)->state.load(std::memory_order_acquire) == kSlotRequest)
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
    FutexWait(&h->doorbell, bell, polling ? 1'000'000 : 50'000'000);
    h->server_sleeping.store(0);
    h->server_heartbeat_ns.store(NowNs());
    if (PeerExited(s->client_pidfd, s->client_pid) || h->closed.load()) {
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

// ---- client -------------------------------------------------------------------

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
    return dead.load() || header()->closed.load() || PeerExited(server_pidfd, server_pid);
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
