#include "expert_service/transport/ucx_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/fragments.h"
#include "common/transport/ucx_lanes.h"

extern char** environ;

namespace hmoe {
namespace {

using ucx::Arrival;
using ucx::Cut;
using ucx::CutPayload;
using ucx::InitContext;
using ucx::InitWorker;
using ucx::kAmRequest;
using ucx::kAmResponse;
using ucx::kPooledBuffers;
using ucx::Worker;

// The largest well-formed request payload a shard takes: bf16 hidden rows,
// int32 ids and f32 weights for max_tokens tokens.
uint64_t MaxRequestBytes(const ShardInfo& info) {
  const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(info.max_tokens, 0));
  return t * (2 * static_cast<uint64_t>(std::max<int64_t>(info.hidden, 0)) +
              8 * static_cast<uint64_t>(std::max<int64_t>(info.top_k, 0)));
}

// Zero bytes after a peer's address, as parsed by the checker and the service.
constexpr size_t kAddressPad = 4096;

// Frames between UcxServer and its checker child (one SOCK_STREAM
// socketpair, fd kCheckerFd in the child): the child sends kCheckerReady
// once UCX is up; each request is a u32 (host order) length and the address
// bytes, each answer one byte, kCheckerAccept or kCheckerRefuse.
constexpr char kCheckerReady = 'R', kCheckerAccept = 'A', kCheckerRefuse = 'N';

bool WriteAll(int fd, const void* p, size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The long-lived checker child (UcxServerOptions::address_checker): UCX
// starts once in it, each Connect costs one endpoint creation there. A child
// that dies on an address (UCX aborts) is restarted by the next Check.
class AddressChecker {
 public:
  AddressChecker(std::vector<std::string> argv, absl::Duration timeout)
      : argv_(std::move(argv)), timeout_(timeout) {}
  ~AddressChecker() {
    std::lock_guard<std::mutex> lock(mu_);
    Stop();
  }

  // Starts the child now (a service checks it can before serving).
  absl::Status Start() {
    std::lock_guard<std::mutex> lock(mu_);
    return EnsureChild(absl::Now() + timeout_);
  }

  // OK: this host's UCX creates an endpoint to `address`. INVALID_ARGUMENT:
  // it refuses it or dies on it. UNAVAILABLE: no verdict within the timeout
  // or no child could be started (the service's problem, not the address's).
  absl::Status Check(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time deadline = absl::Now() + timeout_;
    RETURN_IF_ERROR(EnsureChild(deadline));
    const uint32_t n = static_cast<uint32_t>(address.size());
    char verdict = 0;
    if (!WriteAll(fd_, &n, sizeof(n)) || !WriteAll(fd_, address.data(), address.size()) ||
        !ReadByte(deadline, &verdict)) {
      if (absl::Now() >= deadline) {
        Stop();
        return absl::UnavailableError(absl::StrCat("UCX address check gave no verdict within ",
                                                   absl::FormatDuration(timeout_)));
      }
      const int status = Stop();
      if (WIFSIGNALED(status)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "client_worker_address (", address.size(),
            " bytes) is not a worker address this service's UCX (", ucp_get_version_string(),
            ") can read: parsing it killed the check (signal ", WTERMSIG(status),
            "); is the client's UCX the same version?"));
      }
      return absl::UnavailableError(
          absl::StrCat("UCX address check ended (wait status ", status, ") without a verdict"));
    }
    if (verdict == kCheckerAccept) return absl::OkStatus();
    if (verdict == kCheckerRefuse) {
      return absl::InvalidArgumentError(
          absl::StrCat("client_worker_address (", address.size(), " bytes): this service's UCX (",
                       ucp_get_version_string(), ") cannot create an endpoint to it"));
    }
    Stop();
    return absl::UnavailableError("UCX address check: unexpected answer");
  }

 private:
  // mu_ held. A child ready to check, started if there is none.
  absl::Status EnsureChild(absl::Time deadline) {
    if (pid_ > 0) return absl::OkStatus();
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
      return absl::UnavailableError(
          absl::StrCat("UCX address check: socketpair: ", std::strerror(errno)));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    // The socket at fd 3 (UCX logs to stdout: not a channel), nothing else of
    // this process past stderr (its sockets, UCX's).
    posix_spawn_file_actions_adddup2(&fa, sv[1], kCheckerFd);
    posix_spawn_file_actions_addclosefrom_np(&fa, kCheckerFd + 1);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    std::vector<char*> args;
    for (const std::string& a : argv_) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    // UCX's backtrace on a fatal error off in the child (the assertion's own
    // line stays): a refused address is one line of the service's log.
    std::vector<std::string> env_strings = {"UCX_HANDLE_ERRORS=none"};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "UCX_HANDLE_ERRORS=", 18) != 0) env_strings.emplace_back(*e);
    }
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    const int err = posix_spawn(&pid, args[0], &fa, &attr, args.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    ::close(sv[1]);
    if (err != 0) {
      ::close(sv[0]);
      return absl::UnavailableError(
          absl::StrCat("UCX address check: cannot start ", argv_[0], ": ", std::strerror(err)));
    }
    pid_ = pid;
    fd_ = sv[0];
    char ready = 0;
    if (!ReadByte(deadline, &ready) || ready != kCheckerReady) {
      const int status = Stop();
      return absl::UnavailableError(absl::StrCat("UCX address check: ", argv_[0],
                                                 " did not start (wait status ", status, ")"));
    }
    return absl::OkStatus();
  }

  // mu_ held. One byte from the child by `deadline`.
  bool ReadByte(absl::Time deadline, char* c) {
    while (true) {
      const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (ms <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return false;
      if (r == 0) continue;
      return ReadAll(fd_, c, 1);
    }
  }

  // mu_ held. Ends the child (SIGKILL unless it has exited) and returns its
  // wait status (-1: none).
  int Stop() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (pid_ <= 0) return -1;
    int status = -1;
    // A child that just died on an address has exited: reap without killing.
    for (int i = 0; i < 100; ++i) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || r < 0) {
        pid_ = -1;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  const std::vector<std::string> argv_;
  const absl::Duration timeout_;
  std::mutex mu_;
  pid_t pid_ = -1;
  int fd_ = -1;
};

// Closes eps[i] on lane i's worker: now for `here` (the calling progress
// thread's lane), posted to the others' threads.
template <typename Lanes>
void CloseEps(const Lanes& lanes, const std::vector<ucp_ep_h>& eps, size_t here) {
  for (size_t i = 0; i < eps.size() && i < lanes.size(); ++i) {
    if (eps[i] == nullptr) continue;
    Worker* w = lanes[i]->worker.get();
    if (i == here) {
      w->CloseEp(eps[i]);
    } else {
      w->Post([w, ep = eps[i]] { w->CloseEp(ep); });
    }
  }
}
constexpr size_t kNoLane = SIZE_MAX;

}  // namespace

// ---- server -------------------------------------------------------------------

struct UcxServer::Impl {
  MoeHandler* handler = nullptr;
  UcxServerOptions opts;
  std::unique_ptr<AddressChecker> checker;  // null: addresses not checked
  std::shared_ptr<BufferPool> pool;
  struct Lane {
    Impl* impl;
    size_t index;
    std::unique_ptr<Worker> worker;
  };
  std::vector<std::unique_ptr<Lane>> lanes;
  struct Peer {
    // eps[i] is on lanes[i]'s worker, created and closed on its thread.
    std::vector<ucp_ep_h> eps;
    uint64_t incarnation = 0;  // which Connect made them
  };
  std::mutex mu;
  std::map<uint64_t, Peer> peers;  // mu
  uint64_t incarnations = 0;       // mu
  // Endpoints that failed while not (yet) a peer's, recorded while a
  // Connect is between creating endpoints and installing them (mu).
  int connecting = 0;
  std::set<ucp_ep_h> failed_early;
  std::atomic<uint64_t> n_endpoints{0}, n_failures{0};
  // Answers being computed or handed to lanes: the destructor's drain waits
  // for them to reach UCX (then for UCX's pending sends).
  std::atomic<int64_t> answering{0};

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t) {
    auto* lane = static_cast<Lane*>(arg);
    Impl* self = lane->impl;
    self->n_failures.fetch_add(1);
    std::vector<ucp_ep_h> eps;
    {
      std::lock_guard<std::mutex> lock(self->mu);
      auto it = std::find_if(self->peers.begin(), self->peers.end(), [&](const auto& kv) {
        return lane->index < kv.second.eps.size() && kv.second.eps[lane->index] == ep;
      });
      if (it == self->peers.end()) {
        if (self->connecting > 0) self->failed_early.insert(ep);
        return;
      }
      eps = self->ErasePeer(it);
    }
    CloseEps(self->lanes, eps, lane->index);
  }
  // mu held. Forgets a peer; returns its endpoints for CloseEps.
  std::vector<ucp_ep_h> ErasePeer(std::map<uint64_t, Peer>::iterator it) {
    std::vector<ucp_ep_h> eps = std::move(it->second.eps);
    DropIncoming(it->first);
    peers.erase(it);
    n_endpoints.fetch_sub(1);
    return eps;
  }

  // Requests whose fragments are still arriving, by (client id, request
  // id). A null assembly: refused; its further fragments are dropped.
  struct Incoming {
    UcxRequestHeader h;
    std::shared_ptr<Assembly> a;
    absl::Time started;
  };
  std::map<std::pair<uint64_t, uint64_t>, Incoming> incoming;  // mu
  // Requests one client may have part-way at once (more: RESOURCE_EXHAUSTED).
  static constexpr size_t kMaxIncomingPerPeer = 64;

  void DropIncoming(uint64_t client_id) {  // mu held
    incoming.erase(incoming.lower_bound({client_id, 0}),
                   incoming.upper_bound({client_id, UINT64_MAX}));
  }
  void ExpireIncoming() {  // mu held
    const absl::Time too_old = absl::Now() - opts.assembly_timeout;
    std::erase_if(incoming, [&](const auto& kv) { return kv.second.started < too_old; });
  }

  // Whether the request's sizes can be a call this shard takes, before any
  // byte is received: names the header's wrong field where it says.
  absl::Status Admit(const UcxRequestHeader& h) const {
    const uint64_t max = MaxRequestBytes(handler->info());
    if (h.hidden_bytes <= max && h.ids_bytes <= max && h.weights_bytes <= max &&
        h.hidden_bytes + h.ids_bytes + h.weights_bytes <= max) {
      return absl::OkStatus();
    }
    MoeCall shape;
    shape.layer = h.layer;
    shape.tokens = h.tokens;
    shape.top_k = h.top_k;
    shape.hidden_bytes = h.hidden_bytes;
    shape.ids_bytes = h.ids_bytes;
    shape.weights_bytes = h.weights_bytes;
    absl::Status st = ValidateMoeCallShape(handler->info(), shape);
    if (!st.ok()) return st;
    return absl::InvalidArgumentError(
        absl::StrCat("request payload of ", h.hidden_bytes, "+", h.ids_bytes, "+", h.weights_bytes,
                     " bytes over the shard's largest call (", max,
                     " bytes: max_tokens x (2 x hidden + 8 x top_k))"));
  }

  // Sends `payload` to client `client_id` as response fragments striped
  // over its lanes: fragment j on lane (j + here) mod n, n = min(its lanes,
  // fragments), so one fragment goes on lane 0. Called on lane `here`'s
  // progress thread: that lane's part is sent now, the others' posted.
  void Answer(size_t here, uint64_t client_id, UcxResponseHeader r, Bytes payload) {
    answering.fetch_add(1);
    size_t n = 0;
    uint64_t incarnation = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto p = peers.find(client_id);
      if (p != peers.end()) {
        n = p->second.eps.size();
        incarnation = p->second.incarnation;
      }
    }
    const Cut cut = CutPayload(payload.size(), r.frag_bytes);
    const size_t used = static_cast<size_t>(std::min<uint64_t>(n, cut.count));
    auto shared = std::make_shared<Bytes>(std::move(payload));
    std::function<void()> now;
    for (size_t lane = 0; lane < used; ++lane) {
      answering.fetch_add(1);
      // The fragments j with (j + here) mod used == lane; sent on the
      // endpoint of the Connect that was current at the answer (a client
      // reconnecting meanwhile gets none of them, not half).
      auto send = [this, lane, first = (lane + used - here % used) % used, used, client_id,
                   incarnation, r, shared, cut] {
        ucp_ep_h ep = nullptr;
        {
          std::lock_guard<std::mutex> lock(mu);
          auto p = peers.find(client_id);
          if (p != peers.end() && p->second.incarnation == incarnation) ep = p->second.eps[lane];
        }
        if (ep != nullptr) {
          lanes[lane]->worker->SendFragments(
              ep, kAmResponse,
              [r](uint64_t offset) mutable {
                r.frag_offset = offset;
                return std::string(reinterpret_cast<const char*>(&r), sizeof(r));
              },
              shared, cut, first, used);
        }
        answering.fetch_sub(1);
      };
      if (lane == here) {
        now = std::move(send);
      } else {
        lanes[lane]->worker->Post(std::move(send));
      }
    }
    if (now) now();
    answering.fetch_sub(1);
  }
  void AnswerError(size_t here, uint64_t client_id, uint64_t request_id, const absl::Status& st) {
    UcxResponseHeader r{};
    r.request_id = request_id;
    r.code = static_cast<int32_t>(st.code());
    r.msg_len = static_cast<uint32_t>(st.message().size());
    Bytes msg = BufferPool::Get(pool, st.message().size());
    std::memcpy(msg.data(), st.message().data(), st.message().size());
    Answer(here, client_id, r, std::move(msg));
  }
  void Refuse(size_t here, const UcxRequestHeader& h, const absl::Status& st) {
    handler->Refused(st);
    AnswerError(here, h.client_id, h.request_id, st);
  }

  // A request fragment on `lane` (its progress thread).
  void OnArrival(Lane* lane, const Arrival& m) {
    UcxRequestHeader h;
    if (m.header.size() != sizeof(h)) return;  // not ours: no id to answer
    std::memcpy(&h, m.header.data(), sizeof(h));
    const auto key = std::make_pair(h.client_id, h.request_id);
    absl::Status refused;
    std::shared_ptr<Assembly> a;
    uint8_t* dst = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (peers.find(h.client_id) == peers.end()) return;
      auto it = incoming.find(key);
      if (it == incoming.end()) {
        ExpireIncoming();
        const size_t open =
            static_cast<size_t>(std::distance(incoming.lower_bound({h.client_id, 0}),
                                              incoming.upper_bound({h.client_id, UINT64_MAX})));
        const uint64_t total = h.hidden_bytes + h.ids_bytes + h.weights_bytes;
        absl::Status admitted =
            open >= kMaxIncomingPerPeer
                ? absl::ResourceExhaustedError(absl::StrCat(
                      "ucx: ", open, " requests of this client still missing fragments"))
                : Admit(h);
        absl::StatusOr<std::shared_ptr<Assembly>> started =
            admitted.ok() ? Assembly::Start(pool, total, h.frag_bytes) : admitted;
        if (!started.ok()) {
          // A request in several fragments: the rest are dropped on arrival
          // (a full client's are not remembered either).
          if (m.len < total && open < kMaxIncomingPerPeer)
            incoming.emplace(key, Incoming{h, nullptr, absl::Now()});
          refused = started.status();
        } else {
          it = incoming.emplace(key, Incoming{h, *std::move(started), absl::Now()}).first;
        }
      }
      if (refused.ok()) {
        Incoming& in = it->second;
        if (in.a == nullptr) return;  // refused before
        const UcxRequestHeader& first = in.h;
        absl::StatusOr<uint8_t*> d =
            h.layer != first.layer || h.tokens != first.tokens || h.top_k != first.top_k ||
                    h.hidden_bytes != first.hidden_bytes || h.ids_bytes != first.ids_bytes ||
                    h.weights_bytes != first.weights_bytes || h.frag_bytes != first.frag_bytes
                ? absl::InvalidArgumentError("the fragments of one request disagree on its header")
                : in.a->Claim(h.frag_offset, m.len);
        if (d.ok()) {
          a = in.a;
          dst = *d;
        } else {
          in.a = nullptr;  // receives in flight land in their own buffer and are dropped
          refused = d.status();
        }
      }
    }
    const size_t here = lane->index;
    if (!refused.ok()) return Refuse(here, h, refused);
    lane->worker->Receive(m, dst, [this, key, a, here](bool ok) {
      if (!a->Landed(ok)) return;
      UcxRequestHeader h;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = incoming.find(key);
        if (it == incoming.end() || it->second.a != a) return;  // dropped meanwhile
        h = it->second.h;
        incoming.erase(it);
      }
      if (!a->ok()) return;  // a transfer failed: the peer is going away
      Serve(here, h, a->Take());
    });
  }

  // Computes a whole request and answers it (on lane `here`'s thread).
  void Serve(size_t here, const UcxRequestHeader& h, Bytes data) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (peers.find(h.client_id) == peers.end()) return;
      answering.fetch_add(1);
    }
    MoeCall call;
    call.layer = h.layer;
    call.tokens = h.tokens;
    call.top_k = h.top_k;
    // The arrays are read in place from the (64-byte aligned) payload; one
    // at an offset that is not a multiple of 4 (an odd tokens x hidden) is
    // copied out first.
    std::vector<int32_t> ids_copy;
    std::vector<float> weights_copy;
    const uint8_t* base = data.data();
    call.hidden = reinterpret_cast<const uint16_t*>(base);
    call.hidden_bytes = h.hidden_bytes;
    const uint8_t* ids = base + h.hidden_bytes;
    const uint8_t* weights = ids + h.ids_bytes;
    if (reinterpret_cast<uintptr_t>(ids) % alignof(int32_t) != 0) {
      ids_copy.resize(h.ids_bytes / 4 + 1);
      std::memcpy(ids_copy.data(), ids, h.ids_bytes);
      ids = reinterpret_cast<const uint8_t*>(ids_copy.data());
    }
    if (reinterpret_cast<uintptr_t>(weights) % alignof(float) != 0) {
      weights_copy.resize(h.weights_bytes / 4 + 1);
      std::memcpy(weights_copy.data(), weights, h.weights_bytes);
      weights = reinterpret_cast<const uint8_t*>(weights_copy.data());
    }
    call.ids = reinterpret_cast<const int32_t*>(ids);
    call.ids_bytes = h.ids_bytes;
    call.weights = reinterpret_cast<const float*>(weights);
    call.weights_bytes = h.weights_bytes;
    const ShardInfo& info = handler->info();
    const int64_t t = std::clamp<int64_t>(call.tokens, 0, info.max_tokens);
    // The handler writes its answer straight into the buffer sent back.
    Bytes answer = BufferPool::Get(pool, static_cast<size_t>(t * info.hidden) * sizeof(float));
    uint64_t ns = 0;
    const absl::Status st = handler->Handle(call, reinterpret_cast<float*>(answer.data()), &ns);
    if (!st.ok()) {
      AnswerError(here, h.client_id, h.request_id, st);
    } else {
      UcxResponseHeader r{};
      r.request_id = h.request_id;
      r.compute_ns = ns;
      r.out_bytes = static_cast<uint64_t>(call.tokens) * static_cast<uint64_t>(info.hidden) * 4;
      r.frag_bytes = opts.fragment_bytes;
      answer.Truncate(r.out_bytes);
      Answer(here, h.client_id, r, std::move(answer));
    }
    answering.fetch_sub(1);
  }

  // Every lane's thread stopped, then every worker destroyed (a lane's
  // thread may post to another lane's).
  void StopLanes() {
    for (auto& l : lanes) l->worker->Stop();
    lanes.clear();
  }
};

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Create(MoeHandler* handler,
                                                             const UcxServerOptions& opts) {
  RETURN_IF_ERROR(CheckFragmentBytes(opts.fragment_bytes));
  RETURN_IF_ERROR(CheckUcxLanes(opts.lanes));
  auto s = std::unique_ptr<UcxServer>(new UcxServer());
  s->impl_ = std::make_unique<Impl>();
  Impl* impl = s->impl_.get();
  impl->handler = handler;
  impl->opts = opts;
  impl->pool = std::make_shared<BufferPool>(kPooledBuffers);
  if (!opts.address_checker.empty()) {
    impl->checker = std::make_unique<AddressChecker>(opts.address_checker, opts.check_timeout);
    RETURN_IF_ERROR(impl->checker->Start());
  }
  // The lanes made so far stop with `s` if one fails.
  RETURN_IF_ERROR(ucx::AddLanes(impl, opts.lanes, kAmRequest, 50));
  return s;
}

UcxServer::~UcxServer() {
  if (!impl_ || impl_->lanes.empty()) return;
  Impl* impl = impl_.get();
  // Answers already computed go out before the endpoints close (a forced
  // close cancels them; a rendezvous answer waits for the client to fetch
  // it): a drained service's last answers arrive. An answer is counted in
  // `answering` until its every lane has handed its fragments to UCX.
  const absl::Time until = absl::Now() + impl->opts.close_timeout;
  auto busy = [impl] {
    if (impl->answering.load() > 0) return true;
    for (const auto& l : impl->lanes) {
      if (l->worker->pending_sends() > 0) return true;
    }
    return false;
  };
  while (busy() && absl::Now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::map<uint64_t, Impl::Peer> peers;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    peers.swap(impl->peers);
  }
  for (size_t i = 0; i < impl->lanes.size(); ++i) {
    Worker* w = impl->lanes[i]->worker.get();
    w->Call<int>([&] {
      for (auto& [id, p] : peers) {
        if (i < p.eps.size() && p.eps[i] != nullptr) w->CloseEp(p.eps[i]);
      }
      return 0;
    });
  }
  impl->StopLanes();
}

absl::StatusOr<std::string> UcxServer::Connect(const std::string& client_address,
                                               uint64_t client_id,
                                               const std::function<bool()>& caller_gone) {
  absl::StatusOr<std::vector<std::string>> addresses =
      DecodeUcxAddresses(client_address, "client_worker_address");
  if (!addresses.ok()) return addresses.status();
  const bool list = IsUcxAddressList(client_address);
  Impl* impl = impl_.get();
  const size_t n = std::min(addresses->size(), impl->lanes.size());
  addresses->resize(n);
  auto gone = [&] { return caller_gone != nullptr && caller_gone(); };
  if (gone())
    return absl::CancelledError("UCX connect: the client gave up before the address check");
  if (impl->checker) {
    for (size_t i = 0; i < n; ++i) {
      absl::Status st = impl->checker->Check((*addresses)[i]);
      if (!st.ok()) return list ? Annotate(st, absl::StrCat("lane ", i)) : st;
    }
  }
  if (gone()) {
    return absl::CancelledError(
        "UCX connect: the client gave up during the address check; no endpoint made");
  }
  auto over_cap = [impl] {
    return absl::ResourceExhaustedError(absl::StrCat("UCX: ", impl->peers.size(),
                                                     " clients connected, the service's cap (",
                                                     impl->opts.max_endpoints, ", --max-peers)"));
  };
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    if (impl->peers.find(client_id) == impl->peers.end() &&
        impl->peers.size() >= impl->opts.max_endpoints) {
      return over_cap();
    }
    ++impl->connecting;
  }
  std::vector<ucp_ep_h> eps(n, nullptr);
  absl::Status st;
  for (size_t i = 0; i < n && st.ok(); ++i) {
    Impl::Lane* lane = impl->lanes[i].get();
    st = lane->worker->Call<absl::Status>([&]() -> absl::Status {
      // Parsed with the same zero padding as in the checker.
      auto ep = lane->worker->CreateEp((*addresses)[i] + std::string(kAddressPad, '\0'),
                                       &Impl::OnEpError, lane);
      if (!ep.ok()) return ep.status();
      eps[i] = *ep;
      return absl::OkStatus();
    });
  }
  std::vector<ucp_ep_h> replaced;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    --impl->connecting;
    for (size_t i = 0; i < n; ++i) {
      if (eps[i] != nullptr && impl->failed_early.erase(eps[i]) > 0 && st.ok()) {
        st = absl::UnavailableError(
            absl::StrCat("UCX connect: lane ", i, "'s endpoint failed while being set up"));
      }
    }
    if (impl->connecting == 0) impl->failed_early.clear();
    if (st.ok()) {
      auto it = impl->peers.find(client_id);
      if (it != impl->peers.end()) {
        replaced = std::move(it->second.eps);
        impl->DropIncoming(client_id);
      } else if (impl->peers.size() >= impl->opts.max_endpoints) {
        st = over_cap();
      } else {
        impl->n_endpoints.fetch_add(1);
      }
    }
    if (st.ok()) {
      Impl::Peer& p = impl->peers[client_id];
      p.eps = eps;
      p.incarnation = ++impl->incarnations;
    }
  }
  if (!st.ok()) {
    CloseEps(impl->lanes, eps, kNoLane);
    return st;
  }
  CloseEps(impl->lanes, replaced, kNoLane);
  if (!list) return impl->lanes[0]->worker->address();
  std::vector<std::string> mine;
  for (size_t i = 0; i < n; ++i) mine.push_back(impl->lanes[i]->worker->address());
  return EncodeUcxAddresses(mine);
}

uint64_t UcxServer::endpoints() const { return impl_->n_endpoints.load(); }
uint64_t UcxServer::peer_failures() const { return impl_->n_failures.load(); }

void UcxServer::FailPeersForTesting(int lane) {
  Impl* impl = impl_.get();
  if (lane < 0 || static_cast<size_t>(lane) >= impl->lanes.size()) return;
  Impl::Lane* l = impl->lanes[static_cast<size_t>(lane)].get();
  l->worker->Call<int>([impl, l] {
    std::vector<ucp_ep_h> eps;
    {
      std::lock_guard<std::mutex> lock(impl->mu);
      for (const auto& [id, p] : impl->peers) {
        if (l->index < p.eps.size()) eps.push_back(p.eps[l->index]);
      }
    }
    for (ucp_ep_h ep : eps) Impl::OnEpError(l, ep, UCS_ERR_CONNECTION_RESET);
    return 0;
  });
}

int UcxAddressCheckMain(int in_fd, int out_fd) {
  // A malformed address ends this process by abort(): no core file for it.
  ::prctl(PR_SET_DUMPABLE, 0);
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  absl::Status init = InitContext(false, &context);
  if (init.ok()) init = InitWorker(context, &worker);
  if (absl::Status st = init; !st.ok()) {
    std::fprintf(stderr, "hmoe UCX address check: %s\n", std::string(st.message()).c_str());
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
    return 3;
  }
  int rc = 0;
  std::vector<char> padded;
  if (!WriteAll(out_fd, &kCheckerReady, 1)) rc = 2;
  while (rc == 0) {
    uint32_t n = 0;
    if (!ReadAll(in_fd, &n, sizeof(n))) break;  // the service closed: done
    if (n == 0 || n > kMaxUcxAddressBytes) {
      rc = 2;
      break;
    }
    // The service's own endpoint creation, on the same zero-padded bytes.
    padded.assign(n + kAddressPad, 0);
    if (!ReadAll(in_fd, padded.data(), n)) {
      rc = 2;
      break;
    }
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(padded.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ucp_ep_h h = nullptr;
    const ucs_status_t s = ucp_ep_create(worker, &ep, &h);
    if (s == UCS_OK) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(h, &p);
      if (UCS_PTR_IS_PTR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker);
        ucp_request_free(r);
      }
    }
    const char verdict = s == UCS_OK ? kCheckerAccept : kCheckerRefuse;
    if (!WriteAll(out_fd, &verdict, 1)) rc = 2;
  }
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
  return rc;
}

}  // namespace hmoe
