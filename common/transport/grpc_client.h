// gRPC clients of the expert service: the control plane (describe, health,
// stats, data-plane set-up) and the portable data plane, a bidirectional
// stream of MoE requests with many in flight.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/transport/grpc_status.h"
#include "common/transport/moe_call.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace hmoe {

// A channel with our settings: unlimited message size, fast reconnect.
std::shared_ptr<grpc::Channel> MakeExpertChannel(const std::string& target);

struct ShardStats {
  uint64_t requests = 0, failed = 0, invalid = 0, tokens = 0, compute_ns = 0, in_flight = 0;
  uint64_t shm_sessions = 0, shm_discarded = 0, ucx_endpoints = 0, ucx_peer_failures = 0;
  uint64_t grpc_streams = 0;
};

enum class Health { kUnknown, kServing, kNotServing };

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
class GrpcStreamClient : public MoeClient {
 public:
  GrpcStreamClient(std::shared_ptr<grpc::Channel> channel, int64_t hidden);
  ~GrpcStreamClient() override;
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out) override;
  absl::Status Wait(uint64_t handle, absl::Time deadline) override;
  const char* transport() const override { return "grpc"; }

 private:
  struct Stream;
  struct Pending {
    float* out = nullptr;
    int64_t elems = 0;
    bool done = false;
    absl::Status status;
  };
  void ReadLoop(Stream* s);
  absl::Status EnsureStream();  // mu_ held

  std::shared_ptr<grpc::Channel> channel_;
  int64_t hidden_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<Stream> stream_;
  bool broken_ = true;
  std::thread reader_;
  std::mutex write_mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
};

}  // namespace hmoe
