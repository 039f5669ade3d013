// The UCX plumbing both ends of the UCX data plane (ucx_wire.h) are built
// from: one UCP context per side, its lanes (a UCP worker each, driven by
// its own progress thread), active-message arrival and fragment sends.
// Internal to the transports (UCP types in the interface).
#pragma once

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status.h"
#include "common/transport/fragments.h"

namespace hmoe::ucx {

// Active message ids: requests (worker -> service), responses (back).
inline constexpr uint16_t kAmRequest = 1;
inline constexpr uint16_t kAmResponse = 2;

// UNAVAILABLE "UCX <what>: <UCX's status string>".
absl::Status UcsError(const char* what, ucs_status_t s);

// The UCP context one side's lanes share (and the address checker's own).
// `threads`: its workers run on several threads at once.
absl::Status InitContext(bool threads, ucp_context_h* context);
// A worker driven by one thread at a time.
absl::Status InitWorker(ucp_context_h context, ucp_worker_h* worker);

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

// Buffers kept for reuse per side (shared by its lanes): a call's request
// and answer, a few calls in flight.
inline constexpr size_t kPooledBuffers = 4;

// A payload of `total` bytes cut every frag_bytes (0 or >= total: one
// message): fragment j is [offset(j), offset(j) + len(j)).
struct Cut {
  uint64_t total = 0, step = 0, count = 1;
  uint64_t offset(uint64_t j) const { return j * step; }
  uint64_t len(uint64_t j) const { return std::min(step, total - j * step); }
};
Cut CutPayload(uint64_t total, uint64_t frag_bytes);

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
                                                        int spin_us);

  ~Worker();

  // Ends the progress thread (tasks posted later never run). A side with
  // several lanes stops every lane before it destroys any: a lane's thread
  // may post to another.
  void Stop();

  const std::string& address() const { return address_; }

  void Post(std::function<void()> fn);

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
  void Drain();

  absl::StatusOr<ucp_ep_h> CreateEp(const std::string& remote, ucp_err_handler_cb_t cb, void* arg);

  void CloseEp(ucp_ep_h ep);

  // Receives an arrival's len bytes into dst (which must stay valid until
  // `done` runs; progress thread, now or later; ok false if the transfer
  // failed, e.g. the peer went away).
  void Receive(const Arrival& a, uint8_t* dst, std::function<void(bool ok)> done);

  // Sends fragments first, first + stride, ... of `payload` cut as `cut`,
  // each with header(its offset). The payload is shared by the fragments
  // (of every lane) until the last completes. on_error runs for each
  // fragment whose send fails.
  void SendFragments(ucp_ep_h ep, uint16_t id,
                     const std::function<std::string(uint64_t offset)>& header,
                     const std::shared_ptr<Bytes>& payload, const Cut& cut, uint64_t first,
                     uint64_t stride, const std::function<void(ucs_status_t)>& on_error = nullptr);

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
               uint64_t offset, uint64_t len, const std::function<void(ucs_status_t)>& on_error);

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_len, void* data, size_t len,
                           const ucp_am_recv_param_t* param);

  void Loop();

  // Progress thread only; the epoll fd is the worker's, closed with it.
  void pollfd_wait(int ms);

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

// Adds lanes 0..n-1 to impl->lanes, their workers on one new UCP context
// (shared by threads when n > 1): each a new Impl::Lane with `impl`,
// `index` and `worker` set, whose worker takes active messages `am_id` into
// impl->OnArrival(lane, message) on its progress thread. On an error the
// lanes made so far stay in impl->lanes (they stop with it).
template <typename Impl>
absl::Status AddLanes(Impl* impl, int n, uint16_t am_id, int spin_us) {
  auto context = Context::Create(n > 1);
  if (!context.ok()) return context.status();
  for (int i = 0; i < n; ++i) {
    auto lane = std::make_unique<typename Impl::Lane>();
    lane->impl = impl;
    lane->index = static_cast<size_t>(i);
    auto w = Worker::Create(
        *context, am_id, [impl, l = lane.get()](const Arrival& m) { impl->OnArrival(l, m); },
        spin_us);
    if (!w.ok()) return w.status();
    lane->worker = std::move(*w);
    impl->lanes.push_back(std::move(lane));
  }
  return absl::OkStatus();
}

}  // namespace hmoe::ucx
