// What hmoe-expert-service's main starts around its ExpertShard, apart from
// flags and wiring (service_main.cc): the process's CPU / NUMA placement,
// the gRPC server (the control and data services of grpc_services.h and
// grpc.health.v1), the shared-memory and UCX data planes, the port file
// a launcher waits for, and the drain at the end.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/server/grpc_services.h"
#include "expert_service/transport/shm_server.h"
#include "expert_service/transport/ucx_server.h"
#include "grpcpp/grpcpp.h"

namespace hmoe {

// Binds this process (and the threads it starts later) before the weights
// load: to NUMA node `numa_node` (>= 0; its memory too, strictly) or to the
// CPUs of `cores` ("0-7,16"; empty: unbound). Errors name --numa-node /
// --cores: INVALID_ARGUMENT for a node or list this machine lacks,
// FAILED_PRECONDITION when libnuma reports NUMA unavailable.
absl::Status BindProcess(int numa_node, const std::string& cores);

// UCX's TCP transport listens on every network device it uses: keeps it on
// `listen`'s host's (sets UCX_NET_DEVICES, which the address checker child
// inherits; one already set in the environment wins), said through `log`.
// Call before any thread starts.
void PinUcxToListenDevice(const std::string& listen,
                          const std::function<void(const std::string&)>& log);

// The gRPC data plane's request bound is fixed before the model's shape is
// known (the server is up while the weights load): --max-tokens rows of
// hidden sizes up to kGrpcMaxHidden and top-k up to kGrpcMaxTopK. gRPC
// refuses a larger message (RESOURCE_EXHAUSTED) before allocating or parsing
// it.
inline constexpr int64_t kGrpcMaxHidden = 32768, kGrpcMaxTopK = 64;
int GrpcMaxRequestBytes(int64_t max_tokens);
// A warning for a shard whose hidden size or top-k exceeds those bounds
// (its largest gRPC calls will be refused); "" when within them.
std::string GrpcShapeWarning(const ShardInfo& info);

// The gRPC server: the control and data services over a ServiceState, and
// grpc.health.v1 (NOT_SERVING until the main says otherwise).
struct GrpcFrontEnd {
  std::unique_ptr<grpc::Service> control, data;
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the bound port
};
// Listens on `listen` with `credentials`; requests up to
// GrpcMaxRequestBytes(max_tokens). No SO_REUSEPORT (a second service on a
// taken port fails instead of splitting the connections); keepalive pings
// end a dead client's stream within ~40 s. UNAVAILABLE "cannot listen on
// LISTEN" when the port cannot be bound. `state` must outlive the server.
absl::StatusOr<std::unique_ptr<GrpcFrontEnd>> StartGrpcFrontEnd(
    const std::string& listen, const std::shared_ptr<grpc::ServerCredentials>& credentials,
    int64_t max_tokens, ServiceState* state);

// The shared-memory and UCX data planes over a loaded shard.
struct DataPlaneOptions {
  bool shm = true;
  bool ucx = true;
  int64_t max_peers = 64;           // shm segments / UCX clients at once
  uint64_t ucx_fragment_bytes = 0;  // UcxServerOptions::fragment_bytes
  int ucx_lanes = 1;
};
struct DataPlanes {
  std::unique_ptr<ShmServer> shm;
  std::unique_ptr<UcxServer> ucx;
};
// Starts the planes `o` turns on over `shard` and publishes them in
// `state` (state->shm / state->ucx). A UCX plane that cannot start is left
// off, said through `log`; the service serves without it. The UCX address
// checker is this binary run as `--check-ucx-address`.
DataPlanes StartDataPlanes(ExpertShard* shard, const DataPlaneOptions& o, ServiceState* state,
                           const std::function<void(const std::string&)>& log);

// The log line of a shard that is ready: port, weights, load time, experts
// and intermediate range, ISA, threads and nodes.
std::string ReadyLine(const ExpertShard& shard, int port, double load_seconds);

// How StopServing drains.
struct DrainOptions {
  // The whole drain is bounded by this.
  double timeout_s = 10;
  // Calls go on being served until none arrived for this long (the
  // generations of the workers attached finish: each of their steps is
  // calls); then new calls are refused and those in flight waited on.
  double quiet_s = 1;
};

// Stops serving `shard`: health NOT_SERVING and `state` DRAINING; calls are
// served until the data planes have been quiet for `drain.quiet_s`, then new
// calls are refused and those in flight waited on, all within
// `drain.timeout_s`; then the gRPC server is shut down (200 ms grace) and the
// data planes taken out of `state` and closed.
void StopServing(ExpertShard& shard, const DrainOptions& drain, GrpcFrontEnd& grpc,
                 DataPlanes& planes, ServiceState* state);

// --port-file: the bound port, written so that whoever reads it finds the
// service SERVING. Prepare (at start, before the load) removes a file left
// by an earlier run and checks the place can be written; WriteTemp (before
// SERVING) writes PATH.tmp and reads it back; Publish (after) renames it
// into place. With an empty path each is a no-op. Errors name --port-file
// and the system's reason.
class PortFile {
 public:
  explicit PortFile(std::string path) : path_(std::move(path)) {}
  absl::Status Prepare() const;
  absl::Status WriteTemp(int port) const;
  absl::Status Publish() const;
  // Removes PATH.tmp (after a failed WriteTemp or Publish).
  void RemoveTemp() const;

 private:
  std::string path_;
};

}  // namespace hmoe
