// The expert service's gRPC front ends (proto/expert.proto): the control
// plane (Describe, GetLoadStatus, GetStats, and the set-up of the shared-
// memory and UCX data planes: AttachShm, UcxConnect) and the gRPC data plane
// (bidirectional Moe streams), over the ServiceState that
// hmoe-expert-service's main (service_main.cc: flags and wiring) fills in.
// Every call but health needs one of the service's bearer tokens when it has
// any (UNAUTHENTICATED); a data plane that is on but not up yet is
// UNAVAILABLE (retry), one that is off FAILED_PRECONDITION.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/auth_token.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/transport/shm_server.h"
#include "expert_service/transport/ucx_server.h"
#include "grpcpp/grpcpp.h"
#include "proto/expert.pb.h"

namespace hmoe {

// Everything the RPC handlers share. The first group is fixed before the
// servers start; Main sets the rest as loading proceeds (the handlers read
// them meanwhile): `shard` once the weights are loaded.
struct ServiceState {
  std::string instance;     // --instance, reported by Describe
  bool shm_enabled = true;  // --shm / --ucx: the data plane is on (maybe not up yet)
  bool ucx_enabled = true;
  int64_t max_peers = 64;  // --max-peers: the gRPC MoE stream cap
  // --auth-token-file's tokens (empty: open); re-read in place on SIGHUP.
  std::shared_ptr<AuthTokens> auth_tokens = std::make_shared<AuthTokens>();
  std::atomic<ExpertShard*> shard{nullptr};
  ExpertShard::LoadProgress progress;
  std::atomic<int> load_state{expert::v1::LoadStatus::LOADING};  // a LoadStatus::State
  std::string load_error;
  double load_seconds = 0;
  std::atomic<uint64_t> streams{0};
  // Set by Main once the shard is loaded (RPC handlers read them meanwhile).
  std::atomic<ShmServer*> shm{nullptr};
  std::atomic<UcxServer*> ucx{nullptr};
  // A data plane that is on but not up yet: UNAVAILABLE (retry), not "off".
  grpc::Status DataPlaneDown(bool enabled, const char* name) const;
  // The call's bearer token against auth_tokens.
  grpc::Status Authorize(const grpc::ServerContext* ctx) const;
};

// The control plane (expert::v1::ExpertControl) and the gRPC data plane
// (expert::v1::ExpertData) over `state`, which must outlive them.
std::unique_ptr<grpc::Service> MakeControlService(ServiceState* state);
std::unique_ptr<grpc::Service> MakeDataService(ServiceState* state);

}  // namespace hmoe
