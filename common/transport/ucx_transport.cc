#include "common/transport/ucx_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/fragments.h"
#include "common/transport/grpc_client.h"

extern char** environ;

namespace hmoe {
namespace {

constexpr uint16_t kAmRequest = 1;
constexpr uint16_t kAmResponse = 2;

absl::Status UcsError(const char* what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat("UCX ", what, ": ", ucs_status_string(s)));
}

// The largest well-formed request payload a shard takes: bf16 hidden rows,
// int32 ids and f32 weights for max_tokens tokens.
uint64_t MaxRequestBytes(const ShardInfo& info) {
  const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(info.max_tokens, 0));
  return t * (2 * static_cast<uint64_t>(std::max<int64_t>(info.hidden, 0)) +
              8 * static_cast<uint64_t>(std::max<int64_t>(info.top_k, 0)));
}
// The longest error message a client takes in an answer.
constexpr uint64_t kMaxErrorMessageBytes = 64 << 10;

// Zero bytes after a peer's address, as parsed by the checker and the service.
constexpr size_t kAddressPad = 4096;

// The UCP context one side's lanes share (and the address checker's own).
// `threads`: its workers run on several threads at once.
absl::Status InitContext(bool threads, ucp_context_h* context) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError("config", s);
  // Latency default for MoE calls (a T=1 request is 14 KB at H=7168): send
  // up to 256 KB eagerly instead of paying rendezvous' extra round trip
  // (measured: T=1 round trip 59 -> 35 us over tcp loopback). An explicit
  // UCX_RNDV_THRESH in the environment wins.
  if (std::getenv("UCX_RNDV_THRESH") == nullptr)
    (void)ucp_config_modify(config, "RNDV_THRESH", "256k");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = threads ? 1 : 0;
  s = ucp_init(&params, config, context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError("init", s);
  return absl::OkStatus();
}

// A worker driven by one thread at a time.
absl::Status InitWorker(ucp_context_h context, ucp_worker_h* worker) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  const ucs_status_t s = ucp_worker_create(context, &wp, worker);
  if (s != UCS_OK) return UcsError("worker", s);
  return absl::OkStatus();
}

// A UCP context, cleaned up after the last of its workers is gone.
class Context {
 public:
  static absl::StatusOr<std::shared_ptr<Context>> Create(bool threads) {
    auto c = std::shared_ptr<Context>(new Context());
    RETURN_IF_ERROR(InitContext(threads, &c->h_));
    return c;
  }
  ~Context() {
    if (h_ != nullptr) ucp_cleanup(h_);
  }
  ucp_context_h get() const { return h_; }

 private:
  Context() = default;
  ucp_context_h h_ = nullptr;
};

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

// Buffers kept for reuse per side (shared by its lanes): a call's request
// and answer, a few calls in flight.
constexpr size_t kPooledBuffers = 4;

// A payload of `total` bytes cut every frag_bytes (0 or >= total: one
// message): fragment j is [offset(j), offset(j) + len(j)).
struct Cut {
  uint64_t total = 0, step = 0, count = 1;
  uint64_t offset(uint64_t j) const { return j * step; }
  uint64_t len(uint64_t j) const { return std::min(step, total - j * step); }
};
Cut CutPayload(uint64_t total, uint64_t frag_bytes) {
  const uint64_t step = frag_bytes == 0 || frag_bytes >= total ? total : frag_bytes;
  return Cut{total, step, step == 0 ? 1 : (total + step - 1) / step};
}

// One active message as UCX hands it over (progress thread, valid during the
// callback only): the owner reads the header and, if it wants the bytes,
// calls Worker::Receive with where they go.
struct Arrival {
  std::string_view header;
  void* data;  // UCX's handle: the bytes (eager) or the rendezvous descriptor
  size_t len;
  bool rndv;
};

// A UCP worker driven by one progress thread (one lane). Everything touching
// the worker runs on that thread; other threads Post() closures to it.
class Worker {
 public:
  // Runs on the progress thread for each message with id am_id. A message
  // it does not Receive is dropped (a rendezvous sender's data is released).
  using OnArrival = std::function<void(const Arrival&)>;

  static absl::StatusOr<std::unique_ptr<Worker>> Create(std::shared_ptr<Context> context,
                                                        uint16_t am_id, OnArrival on_arrival,
                                                        int spin_us) {
    auto w = std::unique_ptr<Worker>(new Worker());
    w->context_ = std::move(context);
    w->on_arrival_ = std::move(on_arrival);
    w->spin_us_ = spin_us;
    RETURN_IF_ERROR(InitWorker(w->context_->get(), &w->worker_));
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    ucs_status_t s = ucp_worker_get_address(w->worker_, &addr, &len);
    if (s != UCS_OK) return UcsError("worker address", s);
    w->address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(w->worker_, addr);
    s = ucp_worker_get_efd(w->worker_, &w->efd_);
    if (s != UCS_OK) return UcsError("event fd", s);
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = am_id;
    hp.cb = &Worker::OnAm;
    hp.arg = w.get();
    s = ucp_worker_set_am_recv_handler(w->worker_, &hp);
    if (s != UCS_OK) return UcsError("am handler", s);
    w->thread_ = std::thread(&Worker::Loop, w.get());
    return w;
  }

  ~Worker() {
    Stop();
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (worker_) ucp_worker_destroy(worker_);
  }

  // Ends the progress thread (tasks posted later never run). A side with
  // several lanes stops every lane before it destroys any: a lane's thread
  // may post to another.
  void Stop() {
    // A Create that failed part-way has no progress thread to signal.
    if (thread_.joinable()) {
      Post([this] { stop_ = true; });
      thread_.join();
    }
  }

  const std::string& address() const { return address_; }

  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(fn));
    }
    ucp_worker_signal(worker_);
  }

  // Runs fn on the progress thread and waits for it.
  template <typename T>
  T Call(std::function<T()> fn) {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    T result{};
    Post([&] {
      T r = fn();
      std::lock_guard<std::mutex> lock(m);
      result = std::move(r);
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return done; });
    return result;
  }

  // Sends handed to UCX and not yet complete (a rendezvous send completes
  // once the peer has fetched the data). Any thread.
  int64_t pending_sends() const { return pending_sends_.load(); }

  // ---- progress thread only ----
  // Handles whatever has reached this worker already.
  void Drain() {
    while (ucp_worker_progress(worker_) != 0) {
    }
  }

  absl::StatusOr<ucp_ep_h> CreateEp(const std::string& remote, ucp_err_handler_cb_t cb, void* arg) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = cb;
    ep.err_handler.arg = arg;
    ucp_ep_h h = nullptr;
    ucs_status_t s = ucp_ep_create(worker_, &ep, &h);
    if (s != UCS_OK) return UcsError("endpoint", s);
    return h;
  }

  void CloseEp(ucp_ep_h ep) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
  }

  // Receives an arrival's len bytes into dst (which must stay valid until
  // `done` runs; progress thread, now or later; ok false if the transfer
  // failed, e.g. the peer went away).
  void Receive(const Arrival& a, uint8_t* dst, std::function<void(bool ok)> done) {
    if (!a.rndv) {
      if (a.len > 0) std::memcpy(dst, a.data, a.len);
      done(true);
      return;
    }
    auto* op = new RecvOp{std::move(done)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = [](void* req, ucs_status_t s, size_t, void* user) {
      auto* op = static_cast<RecvOp*>(user);
      op->done(s == UCS_OK);
      delete op;
      ucp_request_free(req);
    };
    p.user_data = op;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, a.data, dst, a.len, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      op->done(r == nullptr);
      delete op;
    }
  }

  // Sends fragments first, first + stride, ... of `payload` cut as `cut`,
  // each with header(its offset). The payload is shared by the fragments
  // (of every lane) until the last completes. on_error runs for each
  // fragment whose send fails.
  void SendFragments(ucp_ep_h ep, uint16_t id,
                     const std::function<std::string(uint64_t offset)>& header,
                     const std::shared_ptr<Bytes>& payload, const Cut& cut, uint64_t first,
                     uint64_t stride, const std::function<void(ucs_status_t)>& on_error = nullptr) {
    for (uint64_t j = first; j < cut.count; j += stride)
      SendOne(ep, id, header(cut.offset(j)), payload, cut.offset(j), cut.len(j), on_error);
  }

 private:
  Worker() = default;
  struct SendOp {
    Worker* self;
    std::string header;
    std::shared_ptr<Bytes> payload;
    std::function<void(ucs_status_t)> on_error;
  };
  struct RecvOp {
    std::function<void(bool)> done;
  };

  void SendOne(ucp_ep_h ep, uint16_t id, std::string header, std::shared_ptr<Bytes> payload,
               uint64_t offset, uint64_t len, const std::function<void(ucs_status_t)>& on_error) {
    auto* op = new SendOp{this, std::move(header), std::move(payload), on_error};
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = [](void* req, ucs_status_t s, void* user) {
      auto* op = static_cast<SendOp*>(user);
      if (s != UCS_OK && op->on_error) op->on_error(s);
      op->self->pending_sends_.fetch_sub(1);
      delete op;
      ucp_request_free(req);
    };
    p.user_data = op;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, op->header.data(), op->header.size(),
                                         op->payload->data() + offset, len, &p);
    if (r == nullptr) {
      delete op;
    } else if (UCS_PTR_IS_ERR(r)) {
      if (op->on_error) op->on_error(UCS_PTR_STATUS(r));
      delete op;
    } else {
      pending_sends_.fetch_add(1);
    }
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_len, void* data, size_t len,
                           const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Worker*>(arg);
    const Arrival a{std::string_view(static_cast<const char*>(header), header_len), data, len,
                    (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0};
    // Returning UCS_OK without receiving drops a rendezvous payload.
    self->on_arrival_(a);
    return UCS_OK;
  }

  void Loop() {
    auto last_work = std::chrono::steady_clock::now();
    while (!stop_) {
      std::deque<std::function<void()>> tasks;
      {
        std::lock_guard<std::mutex> lock(mu_);
        tasks.swap(tasks_);
      }
      for (auto& t : tasks) t();
      bool worked = !tasks.empty();
      while (ucp_worker_progress(worker_) != 0) worked = true;
      for (auto it = closing_.begin(); it != closing_.end();) {
        if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
          ucp_request_free(*it);
          it = closing_.erase(it);
        } else {
          ++it;
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (worked) {
        last_work = now;
        continue;
      }
      if (now - last_work < std::chrono::microseconds(spin_us_)) continue;
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!tasks_.empty()) continue;
      }
      pollfd_wait(50);
    }
    for (auto* r : closing_) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    closing_.clear();
  }

  // Progress thread only; the epoll fd is the worker's, closed with it.
  void pollfd_wait(int ms) {
    epoll_event ev{};
    if (epoll_fd_ < 0) {
      epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
      ev.events = EPOLLIN;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd_, &ev);
    }
    epoll_wait(epoll_fd_, &ev, 1, ms);
  }

  std::shared_ptr<Context> context_;  // outlives worker_
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  int epoll_fd_ = -1;
  std::string address_;
  OnArrival on_arrival_;
  int spin_us_ = 50;
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  std::vector<void*> closing_;
  std::atomic<int64_t> pending_sends_{0};
  bool stop_ = false;
  std::thread thread_;
};

constexpr char kAddressListMagic[] = "HMOELNS1";
constexpr size_t kAddressListMagicBytes = 8;

bool IsAddressList(const std::string& bytes) {
  return bytes.size() >= kAddressListMagicBytes &&
         std::memcmp(bytes.data(), kAddressListMagic, kAddressListMagicBytes) == 0;
}

void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

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

absl::Status CheckUcxLanes(int lanes, const char* field) {
  if (lanes < 1 || lanes > kMaxUcxLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", lanes, " outside [1, ", kMaxUcxLanes, "]"));
  }
  return absl::OkStatus();
}

std::string EncodeUcxAddresses(const std::vector<std::string>& addresses) {
  if (addresses.size() == 1) return addresses[0];
  std::string s(kAddressListMagic, kAddressListMagicBytes);
  PutU32(&s, static_cast<uint32_t>(addresses.size()));
  for (const std::string& a : addresses) {
    PutU32(&s, static_cast<uint32_t>(a.size()));
    s += a;
  }
  return s;
}

absl::StatusOr<std::vector<std::string>> DecodeUcxAddresses(const std::string& bytes,
                                                            const char* field) {
  if (!IsAddressList(bytes)) {
    if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty"));
    if (bytes.size() > kMaxUcxAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes.size(), " bytes, over the ",
                                                     kMaxUcxAddressBytes, " a UCX address takes"));
    }
    return std::vector<std::string>{bytes};
  }
  size_t at = kAddressListMagicBytes;
  auto cut_short = [&](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": lane list of ", bytes.size(),
                                                   " bytes ends inside ", what, " at byte ", at));
  };
  if (bytes.size() - at < 4) return cut_short("its count");
  const uint32_t n = GetU32(bytes.data() + at);
  at += 4;
  if (n < 1 || n > static_cast<uint32_t>(kMaxUcxLanes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": lane list of ", n, " addresses (1 to ", kMaxUcxLanes, ")"));
  }
  std::vector<std::string> out;
  for (uint32_t i = 0; i < n; ++i) {
    if (bytes.size() - at < 4) return cut_short("a length");
    const uint32_t len = GetU32(bytes.data() + at);
    at += 4;
    if (len == 0 || len > kMaxUcxAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": lane ", i, "'s address of ", len,
                                                     " bytes (1 to ", kMaxUcxAddressBytes, ")"));
    }
    if (bytes.size() - at < len) return cut_short("an address");
    out.emplace_back(bytes, at, len);
    at += len;
  }
  if (at != bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", bytes.size() - at, " bytes after the lane list's last address"));
  }
  return out;
}

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
  auto context = Context::Create(opts.lanes > 1);
  if (!context.ok()) return context.status();
  for (int i = 0; i < opts.lanes; ++i) {
    auto lane = std::make_unique<Impl::Lane>();
    lane->impl = impl;
    lane->index = static_cast<size_t>(i);
    auto w = Worker::Create(
        *context, kAmRequest, [impl, l = lane.get()](const Arrival& m) { impl->OnArrival(l, m); },
        50);
    if (!w.ok()) return w.status();  // the lanes made so far stop with `s`
    lane->worker = std::move(*w);
    impl->lanes.push_back(std::move(lane));
  }
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
  const bool list = IsAddressList(client_address);
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

// ---- client -------------------------------------------------------------------

constexpr absl::Duration kConnectTimeout = absl::Seconds(2);
constexpr absl::Duration kSuspectConnectTimeout = absl::Milliseconds(250);
constexpr std::chrono::seconds kSuspectRetry{1};

struct UcxClient::Impl {
  std::shared_ptr<ControlClient> control;
  ShardInfo info;  // what the service served at Create; each reconnect checks it still does
  int64_t hidden = 0;
  uint64_t fragment_bytes = 0;
  uint64_t client_id = 0;
  std::shared_ptr<BufferPool> pool;
  struct Lane {
    Impl* impl;
    size_t index;
    std::unique_ptr<Worker> worker;
    ucp_ep_h ep = nullptr;  // this lane's thread only
    uint64_t gen = 0;       // the connection attempt `ep` belongs to (this lane's thread only)
  };
  std::vector<std::unique_ptr<Lane>> lanes;
  std::timed_mutex connect_mu;  // one handshake at a time
  std::mutex mu;
  std::condition_variable cv;
  // Bumped with every notify of cv: Wait spins on it a moment before it
  // sleeps (a small answer lands within tens of microseconds; a futex wake
  // costs about as much).
  std::atomic<uint64_t> wakeups{0};
  int spin_us = 0;
  void Notify() {  // mu held
    wakeups.fetch_add(1, std::memory_order_release);
    cv.notify_all();
  }
  bool connected = false;
  // A call ran out its deadline: the next Submit re-handshakes first (the
  // service may have dropped its endpoints to us while ours look up; our
  // requests then vanish and nothing else would tell us). At most one
  // attempt per kSuspectRetry; a failed one leaves the old endpoints in use.
  bool suspect = false;
  bool handshaking = false;  // a Submit is redoing the handshake (others wait)
  std::chrono::steady_clock::time_point last_retry{};
  // The connection in use: its attempt number (0: none yet) and its lanes.
  uint64_t generation = 0;
  size_t active_lanes = 0;
  uint64_t attempts = 0;        // connection attempts so far (each tags its endpoints)
  uint64_t failed_attempt = 0;  // an attempt one of whose new endpoints failed at once
  uint64_t failing = 0;         // the connection whose calls FailAll is ending
  uint64_t next_id = 1;
  struct Pending {
    float* out = nullptr;
    uint64_t out_bytes = 0;
    uint64_t generation = 0;
    bool done = false;
    absl::Status status;
    Bytes answer;  // status OK: out_bytes of f32 rows, copied to `out` by Wait
    std::shared_ptr<Assembly> assembly;  // the answer's fragments arriving
    UcxResponseHeader first{};           // the answer's first fragment's header
    // Fragments of an OK answer landed before its last (offset, length):
    // Wait copies them to `out` while the others arrive.
    std::vector<std::pair<uint64_t, uint64_t>> landed;
  };
  std::map<uint64_t, Pending> pending;

  // Connection `gen` failed (an endpoint error or a failed send on some
  // lane): the next Submit reconnects, and its calls still out end
  // UNAVAILABLE once every lane has handled what already reached it. A
  // service that closes right after its last answers closes every lane, and
  // an idle lane can see that before a busy one has taken in the answers
  // sent on it.
  void FailAll(uint64_t gen, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (gen != generation) {
        // An endpoint of the connection being set up: that set-up fails.
        if (gen > generation) failed_attempt = gen;
        return;
      }
      connected = false;
      if (failing == gen) return;  // already being ended
      failing = gen;
    }
    auto left = std::make_shared<std::atomic<size_t>>(lanes.size());
    for (const auto& l : lanes) {
      Lane* lane = l.get();
      lane->worker->Post([this, lane, left, gen, why] {
        lane->worker->Drain();
        if (left->fetch_sub(1) != 1) return;
        std::lock_guard<std::mutex> lock(mu);
        FailGeneration(gen, why);
      });
    }
  }
  void FailGeneration(uint64_t gen, const std::string& why) {  // mu held
    for (auto& [id, p] : pending) {
      if (!p.done && p.generation == gen) {
        p.done = true;
        p.status = absl::UnavailableError(absl::StrCat("expert service (ucx): ", why));
      }
    }
    Notify();
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t s) {
    auto* lane = static_cast<Lane*>(arg);
    if (ep != lane->ep) return;
    lane->worker->CloseEp(ep);
    lane->ep = nullptr;
    lane->impl->FailAll(
        lane->gen, absl::StrCat("peer failure on lane ", lane->index, ": ", ucs_status_string(s)));
  }

  // Ends a pending call (mu held).
  void Finish(Pending& p, absl::Status st) {
    p.status = std::move(st);
    p.done = true;
    p.assembly.reset();
    Notify();
  }

  // A response fragment on `lane` (its progress thread).
  void OnArrival(Lane* lane, const Arrival& m) {
    UcxResponseHeader h;
    if (m.header.size() != sizeof(h)) return;
    std::memcpy(&h, m.header.data(), sizeof(h));
    std::shared_ptr<Assembly> a;
    uint8_t* dst = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = pending.find(h.request_id);
      if (it == pending.end()) return;  // abandoned after a deadline
      Pending& p = it->second;
      if (p.done) return;  // already ended (failed with its endpoint)
      if (p.assembly == nullptr) {
        // The first fragment: the answer's size must be the call's (or an
        // error message's) before anything is received.
        const uint64_t total = h.code == 0 ? h.out_bytes : h.msg_len;
        if (h.code == 0 ? h.out_bytes != p.out_bytes : h.msg_len > kMaxErrorMessageBytes) {
          return Finish(p, absl::InternalError(absl::StrCat(
                               "expert service (ucx): a response of ", total, " bytes, expected ",
                               h.code == 0 ? p.out_bytes : kMaxErrorMessageBytes)));
        }
        auto started = Assembly::Start(pool, total, h.frag_bytes);
        if (!started.ok())
          return Finish(p, Annotate(started.status(), "expert service (ucx): response"));
        p.assembly = *std::move(started);
        p.first = h;
      }
      const UcxResponseHeader& first = p.first;
      absl::StatusOr<uint8_t*> d =
          h.code != first.code || h.msg_len != first.msg_len || h.out_bytes != first.out_bytes ||
                  h.frag_bytes != first.frag_bytes
              ? absl::InternalError("the fragments of one response disagree on its header")
              : p.assembly->Claim(h.frag_offset, m.len);
      if (!d.ok()) return Finish(p, Annotate(d.status(), "expert service (ucx): response"));
      a = p.assembly;
      dst = *d;
    }
    lane->worker->Receive(
        m, dst, [this, id = h.request_id, a, off = h.frag_offset, len = m.len](bool ok) {
          if (!a->Landed(ok)) {
            if (!ok) return;
            std::lock_guard<std::mutex> lock(mu);
            auto it = pending.find(id);
            if (it == pending.end() || it->second.done || it->second.assembly != a ||
                it->second.first.code != 0) {
              return;
            }
            it->second.landed.emplace_back(off, len);
            return Notify();
          }
          std::lock_guard<std::mutex> lock(mu);
          auto it = pending.find(id);
          if (it == pending.end() || it->second.done || it->second.assembly != a) return;
          Pending& p = it->second;
          if (!a->ok()) {
            return Finish(
                p, absl::UnavailableError("expert service (ucx): the answer's transfer failed"));
          }
          Bytes data = a->Take();
          if (p.first.code != 0) {
            return Finish(p, absl::Status(static_cast<absl::StatusCode>(p.first.code),
                                          std::string(reinterpret_cast<const char*>(data.data()),
                                                      data.size())));
          }
          // Copied to `out` by the waiting thread: the progress threads move on
          // to other calls' bytes meanwhile.
          p.answer = std::move(data);
          Finish(p, absl::OkStatus());
        });
  }

  // Sends fragment j of request `id` on `lane`'s endpoint; on that lane's
  // thread.
  void SendRequest(Lane* lane, uint64_t id, UcxRequestHeader h,
                   const std::shared_ptr<Bytes>& payload, const Cut& cut, uint64_t j) {
    // A lane's endpoint and its attempt change together on this thread: a
    // reconnect between Submit and now means the call goes out on the new
    // endpoint, so it belongs to the new connection (its failures and its
    // deadline miss are that connection's).
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = pending.find(id);
      // Already ended (failed with its endpoint, or abandoned at its
      // deadline): nothing to send.
      if (it == pending.end() || it->second.done) return;
      if (lane->ep == nullptr) {
        connected = false;  // the next Submit reconnects
        it->second.done = true;
        it->second.status = absl::UnavailableError(
            absl::StrCat("expert service (ucx): not connected (lane ", lane->index, ")"));
        Notify();
        return;
      }
      it->second.generation = lane->gen;
    }
    lane->worker->SendFragments(
        lane->ep, kAmRequest,
        [&h](uint64_t offset) {
          h.frag_offset = offset;
          return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
        },
        payload, cut, j, cut.count,
        [this, gen = lane->gen](ucs_status_t s) {
          FailAll(gen, absl::StrCat("send: ", ucs_status_string(s)));
        });
  }

  // Redoes the control-plane handshake and replaces every lane's endpoint,
  // within `timeout` or by `deadline` if nearer (then DEADLINE_EXCEEDED;
  // else UNAVAILABLE). Serialized; a caller that saw generation `seen`
  // returns at once if another thread has replaced that connection
  // meanwhile. Calls still out on the old endpoints are left to finish: the
  // service answers them on its new endpoints to us, or they end by their
  // own deadline.
  absl::Status Connect(absl::Duration timeout, absl::Time deadline, uint64_t seen) {
    std::unique_lock<std::timed_mutex> serial(connect_mu, std::defer_lock);
    if (deadline == absl::InfiniteFuture()) {
      serial.lock();
    } else if (!serial.try_lock_until(absl::ToChronoTime(deadline))) {
      return absl::DeadlineExceededError(
          "ucx connect: another handshake still running at the call's deadline");
    }
    bool reconnect;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (generation != seen && connected) return absl::OkStatus();
      reconnect = generation > 0;
    }
    bool capped = false;
    // One budget for the handshake's control calls together.
    const absl::Time until = absl::Now() + ControlBudget(deadline, timeout, &capped);
    if (reconnect) {
      // A reconnect: the service may have restarted with other weights
      // (model, format, part, checkpoint); it must not answer our calls.
      auto now = control->Describe(std::max(until - absl::Now(), absl::ZeroDuration()));
      if (!now.ok()) return SetupFailure(ControlFailure(now.status(), capped, "ucx: describe"));
      RETURN_IF_ERROR(CheckServesTheSame(info, *now, "ucx"));
    }
    std::vector<std::string> mine;
    for (const auto& l : lanes) mine.push_back(l->worker->address());
    auto reply = control->UcxConnect(EncodeUcxAddresses(mine), client_id,
                                     std::max(until - absl::Now(), absl::ZeroDuration()));
    if (!reply.ok()) return SetupFailure(ControlFailure(reply.status(), capped, "ucx connect"));
    auto theirs = DecodeUcxAddresses(*reply, "server_worker_address");
    if (!theirs.ok()) return SetupFailure(Annotate(theirs.status(), "ucx connect"));
    const size_t n = std::min(theirs->size(), lanes.size());
    uint64_t attempt;
    {
      std::lock_guard<std::mutex> lock(mu);
      attempt = ++attempts;
    }
    // Each lane's swap on its own thread, where its endpoint errors are
    // handled too; lanes past n are left without one.
    absl::Status st;
    for (size_t i = 0; i < lanes.size(); ++i) {
      Lane* lane = lanes[i].get();
      absl::Status s = lane->worker->Call<absl::Status>([&]() -> absl::Status {
        if (lane->ep) lane->worker->CloseEp(lane->ep);
        lane->ep = nullptr;
        if (i >= n || !st.ok()) return absl::OkStatus();
        auto e = lane->worker->CreateEp((*theirs)[i], &Impl::OnEpError, lane);
        if (!e.ok()) return e.status();
        lane->ep = *e;
        lane->gen = attempt;
        return absl::OkStatus();
      });
      if (st.ok()) st = s;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (st.ok() && failed_attempt == attempt) {
        st = absl::UnavailableError("ucx connect: an endpoint failed while being set up");
      }
      if (st.ok()) {
        generation = attempt;
        active_lanes = n;
        connected = true;
        suspect = false;
        return absl::OkStatus();
      }
    }
    for (const auto& l : lanes) {
      Lane* lane = l.get();
      lane->worker->Call<int>([lane] {
        if (lane->ep) lane->worker->CloseEp(lane->ep);
        lane->ep = nullptr;
        return 0;
      });
    }
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    FailGeneration(generation, st.ToString());
    return st;
  }

  // Every lane's endpoint closed and its thread stopped.
  void Close() {
    for (const auto& l : lanes) {
      Lane* lane = l.get();
      lane->worker->Call<int>([lane] {
        if (lane->ep) lane->worker->CloseEp(lane->ep);
        lane->ep = nullptr;
        return 0;
      });
    }
    for (const auto& l : lanes) l->worker->Stop();
    lanes.clear();
  }
};

absl::StatusOr<std::unique_ptr<UcxClient>> UcxClient::Create(std::shared_ptr<ControlClient> control,
                                                             const ShardInfo& info,
                                                             const UcxClientOptions& opts) {
  RETURN_IF_ERROR(CheckFragmentBytes(opts.fragment_bytes));
  RETURN_IF_ERROR(CheckUcxLanes(opts.lanes));
  auto c = std::unique_ptr<UcxClient>(new UcxClient());
  c->impl_ = std::make_unique<Impl>();
  Impl* impl = c->impl_.get();
  impl->control = std::move(control);
  impl->info = info;
  impl->hidden = info.hidden;
  impl->fragment_bytes = opts.fragment_bytes;
  impl->spin_us = opts.wait_spin_us;
  impl->pool = std::make_shared<BufferPool>(kPooledBuffers);
  std::random_device rd;
  impl->client_id = (uint64_t{rd()} << 32) | rd();
  auto context = Context::Create(opts.lanes > 1);
  if (!context.ok()) return context.status();
  for (int i = 0; i < opts.lanes; ++i) {
    auto lane = std::make_unique<Impl::Lane>();
    lane->impl = impl;
    lane->index = static_cast<size_t>(i);
    auto w = Worker::Create(
        *context, kAmResponse, [impl, l = lane.get()](const Arrival& m) { impl->OnArrival(l, m); },
        opts.spin_us);
    if (!w.ok()) return w.status();  // the lanes made so far stop with `c`
    lane->worker = std::move(*w);
    impl->lanes.push_back(std::move(lane));
  }
  absl::Status st = impl->Connect(kConnectTimeout, absl::InfiniteFuture(), impl->generation);
  if (!st.ok()) return st;
  return c;
}

UcxClient::~UcxClient() {
  if (impl_) impl_->Close();
}

int UcxClient::lanes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->connected ? static_cast<int>(impl_->active_lanes) : 0;
}

void UcxClient::FailLaneForTesting(int lane) {
  if (lane < 0 || static_cast<size_t>(lane) >= impl_->lanes.size()) return;
  Impl::Lane* l = impl_->lanes[static_cast<size_t>(lane)].get();
  l->worker->Call<int>([l] {
    if (l->ep) Impl::OnEpError(l, l->ep, UCS_ERR_CONNECTION_RESET);
    return 0;
  });
}

absl::StatusOr<uint64_t> UcxClient::Submit(const MoeCall& call, float* out, absl::Time deadline) {
  // What one active message may carry here (the service refuses anything over
  // its --max-tokens long before).
  RETURN_IF_ERROR(CheckMoeCallBytes(call, uint64_t{1} << 36, "ucx"));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        "expert service (ucx): the call's deadline passed before it was sent");
  }
  Impl* impl = impl_.get();
  bool connected, retry = false;
  uint64_t seen;
  {
    std::unique_lock<std::mutex> lock(impl->mu);
    // Another Submit is re-handshaking: wait (<= its 250 ms, or our
    // deadline), then use the endpoints it leaves, rather than send on the
    // suspect ones meanwhile.
    if (!impl->cv.wait_until(lock, absl::ToChronoTime(deadline),
                             [impl] { return !impl->handshaking; })) {
      return absl::DeadlineExceededError(
          "expert service (ucx): a reconnect handshake still running at the deadline");
    }
    connected = impl->connected;
    seen = impl->generation;
    const auto now = std::chrono::steady_clock::now();
    if (connected && impl->suspect && now - impl->last_retry >= kSuspectRetry) {
      retry = true;
      impl->last_retry = now;
      impl->handshaking = true;
    }
  }
  if (!connected) {
    absl::Status st = impl->Connect(kConnectTimeout, deadline, seen);
    if (!st.ok()) return st;
  } else if (retry) {
    // Short: a stopped service must still end this call by its own deadline.
    // A failed handshake keeps the old endpoints (and the suspicion).
    const absl::Status st = impl->Connect(kSuspectConnectTimeout, deadline, seen);
    {
      std::lock_guard<std::mutex> lock(impl->mu);
      impl->handshaking = false;
      impl->Notify();
    }
    // A service now serving other weights: say so (its old endpoints are
    // gone anyway); other failures keep the old endpoints.
    if (absl::IsFailedPrecondition(st)) return st;
  }
  UcxRequestHeader h{};
  h.client_id = impl->client_id;
  h.layer = call.layer;
  h.tokens = call.tokens;
  h.top_k = call.top_k;
  h.hidden_bytes = call.hidden_bytes;
  h.ids_bytes = call.ids_bytes;
  h.weights_bytes = call.weights_bytes;
  h.frag_bytes = impl->fragment_bytes;
  Bytes payload =
      BufferPool::Get(impl->pool, call.hidden_bytes + call.ids_bytes + call.weights_bytes);
  const Cut cut = CutPayload(payload.size(), h.frag_bytes);
  uint64_t id;
  size_t used;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    id = impl->next_id++;
    auto& p = impl->pending[id];
    p.out = out;
    p.out_bytes = static_cast<uint64_t>(call.tokens > 0 ? call.tokens : 0) *
                  static_cast<uint64_t>(impl->hidden) * 4;
    p.generation = impl->generation;
    // Fragment j on lane j mod used: one fragment on lane 0.
    used =
        static_cast<size_t>(std::min<uint64_t>(std::max<size_t>(impl->active_lanes, 1), cut.count));
  }
  h.request_id = id;
  auto shared = std::make_shared<Bytes>(std::move(payload));
  // Each fragment is handed to its lane as soon as it is copied in: the
  // lanes send the first ones while the later ones are copied.
  const struct {
    const void* p;
    uint64_t n;
  } parts[] = {{call.hidden, call.hidden_bytes},
               {call.ids, call.ids_bytes},
               {call.weights, call.weights_bytes}};
  for (uint64_t j = 0; j < cut.count; ++j) {
    const uint64_t lo = cut.offset(j), hi = lo + cut.len(j);
    uint64_t start = 0;
    for (const auto& part : parts) {
      const uint64_t from = std::max(lo, start), to = std::min(hi, start + part.n);
      if (from < to) {
        std::memcpy(shared->data() + from, static_cast<const uint8_t*>(part.p) + (from - start),
                    to - from);
      }
      start += part.n;
    }
    Impl::Lane* lane = impl->lanes[j % used].get();
    lane->worker->Post(
        [impl, lane, id, h, shared, cut, j] { impl->SendRequest(lane, id, h, shared, cut, j); });
  }
  return id;
}

absl::Status UcxClient::Wait(uint64_t handle, absl::Time deadline) {
  Impl* impl = impl_.get();
  std::unique_lock<std::mutex> lock(impl->mu);
  auto it = impl->pending.find(handle);
  if (it == impl->pending.end()) return absl::InvalidArgumentError("unknown handle");
  const auto until = absl::ToChronoTime(deadline);
  if (!it->second.done && impl->spin_us > 0) {
    // Only this Wait erases the entry: `it` stays valid while unlocked.
    const uint64_t seen = impl->wakeups.load(std::memory_order_acquire);
    lock.unlock();
    const auto spin_end = std::min(
        until, std::chrono::system_clock::now() + std::chrono::microseconds(impl->spin_us));
    while (impl->wakeups.load(std::memory_order_acquire) == seen &&
           std::chrono::system_clock::now() < spin_end) {
    }
    lock.lock();
  }
  Impl::Pending& p = it->second;
  auto* out = reinterpret_cast<uint8_t*>(p.out);
  // Parts of `out` written while the answer's other fragments arrived.
  std::vector<std::pair<uint64_t, uint64_t>> copied;
  while (!p.done) {
    if (!p.landed.empty()) {
      // The landed bytes stay put: in the assembly (held here) until the
      // last fragment, then in p.answer, which only this Wait frees.
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      ranges.swap(p.landed);
      const std::shared_ptr<Assembly> a = p.assembly;
      const uint8_t* from = a->data();
      lock.unlock();
      for (const auto& [off, len] : ranges) std::memcpy(out + off, from + off, len);
      copied.insert(copied.end(), ranges.begin(), ranges.end());
      lock.lock();
      continue;
    }
    if (impl->cv.wait_until(lock, until) == std::cv_status::timeout && !p.done) {
      // Only a call on the current connection makes it suspect: calls left
      // on a replaced one must not trigger handshake after handshake.
      if (p.generation == impl->generation) impl->suspect = true;
      impl->pending.erase(it);
      return absl::DeadlineExceededError("expert service (ucx): no answer before the deadline");
    }
  }
  absl::Status st = p.status;
  Bytes answer = std::move(p.answer);
  impl->pending.erase(it);
  lock.unlock();
  if (st.ok() && answer.size() > 0) {
    // The rest: what was not copied while it arrived.
    std::sort(copied.begin(), copied.end());
    uint64_t at = 0;
    copied.emplace_back(answer.size(), 0);
    for (const auto& [off, len] : copied) {
      if (off > at) std::memcpy(out + at, answer.data() + at, off - at);
      at = std::max(at, off + len);
    }
  }
  return st;
}

}  // namespace hmoe

namespace hmoe {

absl::StatusOr<std::string> UcxNetDeviceFor(const std::string& listen) {
  std::string host = listen;
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    host = close == std::string::npos ? host.substr(1) : host.substr(1, close - 1);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  if (host.empty() || host == "0.0.0.0" || host == "::") return std::string();
  if (host == "localhost") host = "127.0.0.1";
  in_addr v4{};
  in6_addr v6{};
  const bool is4 = inet_pton(AF_INET, host.c_str(), &v4) == 1;
  const bool is6 = !is4 && inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  if (!is4 && !is6) return std::string();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0)
    return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  std::string name;
  for (ifaddrs* a = list; a != nullptr && name.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (is4 && a->ifa_addr->sa_family == AF_INET) {
      const auto* s = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      // 127.0.0.0/8 is all on the loopback device.
      const bool loop4 = (ntohl(v4.s_addr) >> 24) == 127 && (a->ifa_flags & IFF_LOOPBACK);
      if (s->sin_addr.s_addr == v4.s_addr || loop4) name = a->ifa_name;
    } else if (is6 && a->ifa_addr->sa_family == AF_INET6) {
      const auto* s = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      if (std::memcmp(&s->sin6_addr, &v6, sizeof(v6)) == 0) name = a->ifa_name;
    }
  }
  freeifaddrs(list);
  if (name.empty())
    return absl::NotFoundError(
        absl::StrCat("no local network interface holds ", host, " (from ", listen, ")"));
  return name;
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
