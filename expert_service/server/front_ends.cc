#include "expert_service/server/front_ends.h"

#include <numa.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/runtime/numa.h"
#include "expert_service/kernels/isa.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/expert.grpc.pb.h"

namespace hmoe {
namespace pb = ::hmoe::expert::v1;

absl::Status BindProcess(int numa_node, const std::string& cores) {
  if (numa_node >= 0) {
    if (numa_available() < 0) {
      return absl::FailedPreconditionError("--numa-node: libnuma reports NUMA unavailable");
    }
    if (numa_node > numa_max_node()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--numa-node: ", numa_node, " > max node ", numa_max_node()));
    }
    if (numa_run_on_node(numa_node) != 0) {
      return absl::InternalError(absl::StrCat("numa_run_on_node: ", std::strerror(errno)));
    }
    bitmask* nodes = numa_allocate_nodemask();
    numa_bitmask_setbit(nodes, static_cast<unsigned>(numa_node));
    numa_set_membind(nodes);  // strict: the experts' memory stays on the node
    numa_bitmask_free(nodes);
  }
  if (!cores.empty()) {
    cpu_set_t set;
    if (absl::Status st = ParseCpuList(cores, &set); !st.ok())
      return absl::InvalidArgumentError(absl::StrCat("--cores: ", st.message()));
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--cores: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

void PinUcxToListenDevice(const std::string& listen,
                          const std::function<void(const std::string&)>& log) {
  if (std::getenv("UCX_NET_DEVICES") != nullptr) return;
  absl::StatusOr<std::string> dev = UcxNetDeviceFor(listen);
  if (!dev.ok()) {
    log("warning: UCX data plane on every network device: " + std::string(dev.status().message()));
  } else if (!dev->empty()) {
    ::setenv("UCX_NET_DEVICES", dev->c_str(), 1);
    log("UCX data plane on network device " + *dev + " (the --listen host's)");
  }
}

// The ids and weights for top-k up to kGrpcMaxTopK, plus framing, beside
// the bf16 rows.
int GrpcMaxRequestBytes(int64_t max_tokens) {
  const int64_t bytes = max_tokens * (2 * kGrpcMaxHidden + 8 * kGrpcMaxTopK) + (64 << 10);
  return static_cast<int>(std::min<int64_t>(bytes, std::numeric_limits<int>::max()));
}

std::string GrpcShapeWarning(const ShardInfo& info) {
  if (info.hidden <= kGrpcMaxHidden && info.top_k <= kGrpcMaxTopK) return "";
  return absl::StrCat("warning: hidden ", info.hidden, " / top_k ", info.top_k, " over the ",
                      kGrpcMaxHidden, " / ", kGrpcMaxTopK,
                      " the gRPC data plane is sized for: its largest calls will be refused "
                      "(RESOURCE_EXHAUSTED); shm and UCX are not limited");
}

absl::StatusOr<std::unique_ptr<GrpcFrontEnd>> StartGrpcFrontEnd(
    const std::string& listen, const std::shared_ptr<grpc::ServerCredentials>& credentials,
    int64_t max_tokens, ServiceState* state) {
  auto fe = std::make_unique<GrpcFrontEnd>();
  fe->control = MakeControlService(state);
  fe->data = MakeDataService(state);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, credentials, &fe->port);
  builder.SetMaxReceiveMessageSize(GrpcMaxRequestBytes(max_tokens));
  // gRPC sets SO_REUSEPORT by default: a second service on a taken port
  // would start and split the connections with the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Pings to idle clients: a stream from a host that died ends within ~40 s
  // and frees its --max-peers place. Clients ping every 10 s (grpc_client.cc).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(fe->control.get());
  builder.RegisterService(fe->data.get());
  fe->server = builder.BuildAndStart();
  if (!fe->server || fe->port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  auto* health = fe->server->GetHealthCheckService();
  // The services' own names answer as the server does (every later
  // SetServingStatus(bool) sets them too).
  health->SetServingStatus(pb::ExpertControl::service_full_name(), false);
  health->SetServingStatus(pb::ExpertData::service_full_name(), false);
  health->SetServingStatus(false);
  return fe;
}

DataPlanes StartDataPlanes(ExpertShard* shard, const DataPlaneOptions& o, ServiceState* state,
                           const std::function<void(const std::string&)>& log) {
  DataPlanes planes;
  if (o.shm) {
    planes.shm = std::make_unique<ShmServer>(shard, static_cast<size_t>(o.max_peers));
    state->shm = planes.shm.get();
  }
  if (o.ucx) {
    UcxServerOptions uo;
    uo.address_checker = {"/proc/self/exe", "--check-ucx-address"};
    uo.max_endpoints = static_cast<size_t>(o.max_peers);
    uo.fragment_bytes = o.ucx_fragment_bytes;
    uo.lanes = o.ucx_lanes;
    auto u = UcxServer::Create(shard, uo);
    if (u.ok()) {
      planes.ucx = std::move(*u);
      state->ucx = planes.ucx.get();
    } else {
      log("UCX data plane off: " + std::string(u.status().message()));
    }
  }
  return planes;
}

std::string ReadyLine(const ExpertShard& sh, int port, double load_seconds) {
  return absl::StrCat("ready: port ", port, ", ", sh.weight_bytes(), " packed ",
                      sh.info().weight_format, " weight bytes in ", load_seconds, " s; experts [",
                      sh.info().expert_begin, ", ", sh.info().expert_end, "), intermediate [",
                      sh.info().i_begin, ", ", sh.info().i_end, "); isa ",
                      std::string(IsaName(sh.isa())), ", ", sh.pool().num_threads(), " threads on ",
                      sh.pool().num_nodes(), " node(s)", DescribeMemoryRemap(sh.pool().nodes()),
                      NumaAvailable() ? ""
                                      : "; libnuma unavailable here (a container refusing the "
                                        "NUMA calls?): memory not bound, all cores one node",
                      sh.aliased_experts() > 0
                          ? absl::StrCat("; ALIASED EXPERTS (", sh.aliased_experts(),
                                         " distinct weight sets): FIT CHECK, not a speed figure")
                          : "");
}

void StopServing(ExpertShard& shard, const DrainOptions& drain, GrpcFrontEnd& grpc,
                 DataPlanes& planes, ServiceState* state) {
  grpc.server->GetHealthCheckService()->SetServingStatus(false);
  state->load_state = pb::LoadStatus::DRAINING;
  using Clock = std::chrono::steady_clock;
  const auto drain_until =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(drain.timeout_s * 1000));
  const auto quiet = std::chrono::milliseconds(static_cast<int64_t>(drain.quiet_s * 1000));
  // Served while calls keep coming: a generation in flight is many calls.
  uint64_t seen = shard.counters().requests.load();
  auto last_call = Clock::now();
  while (Clock::now() < drain_until) {
    const uint64_t now_seen = shard.counters().requests.load();
    if (now_seen != seen) {
      seen = now_seen;
      last_call = Clock::now();
    } else if (shard.counters().in_flight.load() == 0 && Clock::now() - last_call >= quiet) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  shard.SetDraining();
  while (shard.counters().in_flight.load() > 0 && std::chrono::steady_clock::now() < drain_until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  grpc.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  state->shm = nullptr;
  state->ucx = nullptr;
  planes.shm.reset();
  planes.ucx.reset();
}

absl::Status PortFile::Prepare() const {
  if (path_.empty()) return absl::OkStatus();
  // A file left by an earlier run must not announce this one before READY;
  // a place that cannot be written fails now, not after a long load.
  if (std::remove(path_.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove the old --port-file ", path_, ": ", std::strerror(errno)));
  }
  const std::string tmp = path_ + ".tmp";
  if (!std::ofstream(tmp)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write --port-file ", path_, ": ", std::strerror(errno)));
  }
  std::remove(tmp.c_str());
  return absl::OkStatus();
}

absl::Status PortFile::WriteTemp(int port) const {
  if (path_.empty()) return absl::OkStatus();
  const std::string tmp = path_ + ".tmp";
  errno = 0;
  std::ofstream(tmp) << port << "\n";
  const int write_errno = errno;
  std::ifstream check(tmp);
  int read_back = 0;
  if (!(check >> read_back) || read_back != port) {
    std::remove(tmp.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write --port-file ", path_, ": ",
                     std::strerror(write_errno != 0 ? write_errno : errno)));
  }
  return absl::OkStatus();
}

absl::Status PortFile::Publish() const {
  if (path_.empty()) return absl::OkStatus();
  const std::string tmp = path_ + ".tmp";
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot rename ", tmp, " to --port-file ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void PortFile::RemoveTemp() const {
  if (!path_.empty()) std::remove((path_ + ".tmp").c_str());
}

}  // namespace hmoe
