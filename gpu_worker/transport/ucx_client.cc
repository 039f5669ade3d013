#include "gpu_worker/transport/ucx_client.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/fragments.h"
#include "common/transport/ucx_lanes.h"
#include "gpu_worker/transport/grpc_client.h"

namespace hmoe {
namespace {

using ucx::Arrival;
using ucx::Cut;
using ucx::CutPayload;
using ucx::kAmRequest;
using ucx::kAmResponse;
using ucx::kPooledBuffers;
using ucx::Worker;

// The longest error message a client takes in an answer.
constexpr uint64_t kMaxErrorMessageBytes = 64 << 10;

constexpr absl::Duration kConnectTimeout = absl::Seconds(2);
constexpr absl::Duration kSuspectConnectTimeout = absl::Milliseconds(250);
constexpr std::chrono::seconds kSuspectRetry{1};

}  // namespace

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
    CloseEndpoints();
    std::lock_guard<std::mutex> lock(mu);
    connected = false;
    FailGeneration(generation, st.ToString());
    return st;
  }

  // Every lane's endpoint closed, each on its lane's thread.
  void CloseEndpoints() {
    for (const auto& l : lanes) {
      Lane* lane = l.get();
      lane->worker->Call<int>([lane] {
        if (lane->ep) lane->worker->CloseEp(lane->ep);
        lane->ep = nullptr;
        return 0;
      });
    }
  }

  // Every lane's endpoint closed and its thread stopped.
  void Close() {
    CloseEndpoints();
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
  // The lanes made so far stop with `c` if one fails.
  RETURN_IF_ERROR(ucx::AddLanes(impl, opts.lanes, kAmResponse, opts.spin_us));
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
