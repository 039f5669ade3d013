// The worker's gRPC clients of the expert service: the control plane (describe, health,
// stats, data-plane set-up) and the portable data plane, a bidirectional
// stream of MoE requests with many in flight.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/transport/grpc_messages.h"
#include "common/transport/grpc_status.h"
#include "common/transport/moe_call.h"

namespace grpc {
class Channel;
class ChannelCredentials;
}  // namespace grpc

namespace hmoe {
class AuthTokens;

// A channel with our settings: unlimited message size, fast reconnect; every
// call carries the first of `auth_tokens` in force when it starts
// (grpc_auth.h; none when null); TLS with `credentials` (grpc_tls.h),
// plaintext when null.
std::shared_ptr<grpc::Channel> MakeExpertChannel(
    const std::string& target, std::shared_ptr<const AuthTokens> auth_tokens,
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
// The same with a fixed token (none when empty).
std::shared_ptr<grpc::Channel> MakeExpertChannel(
    const std::string& target, const std::string& auth_token = "",
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

struct ShardStats {
  uint64_t requests = 0, failed = 0, invalid = 0, tokens = 0, compute_ns = 0, in_flight = 0;
  uint64_t shm_sessions = 0, shm_discarded = 0, ucx_endpoints = 0, ucx_peer_failures = 0;
  uint64_t grpc_streams = 0;
};

enum class Health { kUnknown, kServing, kNotServing };

// The time one control RPC may take inside a data-plane call with `deadline`:
// `own` (the transport's timeout), or what is left before `deadline` if that
// is less (then *capped is set); never negative.
absl::Duration ControlBudget(absl::Time deadline, absl::Duration own, bool* capped);
// The status of a control RPC `what` that failed within ControlBudget, for
// the data-plane caller: running out of the caller's time stays
// DEADLINE_EXCEEDED; running out of the transport's own is UNAVAILABLE (the
// service did not answer); other codes pass; the message names `what`.
absl::Status ControlFailure(const absl::Status& st, bool capped, const std::string& what);
// The service's refusals, codes a caller sees as they are (not folded into
// UNAVAILABLE): UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED.
bool IsServiceRefusal(absl::StatusCode code);
// A data plane's set-up failure (from ControlFailure) as its caller sees it:
// the service's refusals (UNAUTHENTICATED, PERMISSION_DENIED,
// RESOURCE_EXHAUSTED) and DEADLINE_EXCEEDED keep their code, anything else is
// UNAVAILABLE (the service is not there to set up with).
absl::Status SetupFailure(const absl::Status& st);

class ControlClient {
 public:
  explicit ControlClient(std::shared_ptr<grpc::Channel> channel);
  ~ControlClient();
  absl::StatusOr<ShardInfo> Describe(absl::Duration timeout = absl::Seconds(5));
  absl::StatusOr<ShardStats> Stats(absl::Duration timeout = absl::Seconds(5));
  // grpc.health.v1 Check of `service` ("" = the whole server). Unreachable -> kNotServing.
  Health Check(const std::string& service = "", absl::Duration timeout = absl::Seconds(1));
  absl::StatusOr<uint64_t> AttachShm(const std::string& path, int64_t pid, uint64_t nonce,
                                     absl::Duration timeout = absl::Seconds(5));
  absl::StatusOr<std::string> UcxConnect(const std::string& client_address, uint64_t client_id,
                                         absl::Duration timeout = absl::Seconds(5));

 private:
  struct Stubs;
  std::unique_ptr<Stubs> stubs_;
};

// MoeClient over one bidi stream (reopened after a failure on the next Submit).
// Submit never writes to the stream itself: it queues the request for the
// stream's writer thread, so a service that stops reading (flow control
// closes the window) cannot block it; when the queue holds more than
// `max_queued_bytes` (one call of any size is always taken into an empty
// queue), Submit waits for room until its deadline. Requests abandoned
// before the writer reaches them (Wait's deadline passed) are never sent.
// With `check` set, every stream (the first too: it opens at the first
// Submit, perhaps long after the caller's own Describe) writes its first
// call only once the service still describes itself as `check.info`
// (ServedDifference): a service restarted with other weights fails the
// stream's calls FAILED_PRECONDITION naming the difference; one that cannot
// describe itself within the first call's deadline fails them as set-up
// failures do (UNAVAILABLE, DEADLINE_EXCEEDED, refusals keep their code).
class GrpcStreamClient : public MoeClient {
 public:
  static constexpr uint64_t kDefaultMaxQueuedBytes = uint64_t{64} << 20;
  struct ReconnectCheck {
    std::shared_ptr<ControlClient> control;
    ShardInfo info;
  };
  GrpcStreamClient(std::shared_ptr<grpc::Channel> channel, int64_t hidden,
                   uint64_t max_queued_bytes = kDefaultMaxQueuedBytes,
                   std::optional<ReconnectCheck> check = std::nullopt);
  ~GrpcStreamClient() override;
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline) override;
  absl::Status Wait(uint64_t handle, absl::Time deadline) override;
  const char* transport() const override { return "grpc"; }

 private:
  struct Stream;
  struct Outgoing;
  struct Pending {
    float* out = nullptr;
    int64_t elems = 0;
    bool done = false;
    absl::Status status;
  };
  void ReadLoop(Stream* s);
  void WriteLoop(Stream* s);
  // The check, on `s`'s writer before its first write, within `first`'s
  // deadline (mu_ held by `lock` on entry and exit); false when it failed
  // the stream.
  bool CheckStream(Stream* s, const Outgoing& first, std::unique_lock<std::mutex>& lock);
  absl::Status EnsureStream(std::unique_lock<std::mutex>& lock);  // mu_ held

  std::shared_ptr<grpc::Channel> channel_;
  int64_t hidden_;
  uint64_t max_queued_bytes_;
  std::optional<ReconnectCheck> check_;
  std::mutex mu_;
  std::condition_variable cv_;         // answers arrived; room in the outbox
  std::condition_variable writer_cv_;  // work for the writer
  std::unique_ptr<Stream> stream_;     // with its reader and writer threads
  bool broken_ = true;                 // stream_ (if any) has ended
  bool stopping_ = false;
  std::deque<std::unique_ptr<Outgoing>> outbox_;
  uint64_t queued_bytes_ = 0;
  std::atomic<uint64_t> next_id_{1};
  std::map<uint64_t, Pending> pending_;
};

}  // namespace hmoe
