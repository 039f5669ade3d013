// The expert service's protobuf messages (proto/expert.proto) <-> the call
// contract's structs (moe_call.h), as both ends read and write them. The
// gRPC data plane's raw-buffer encoding of the same messages: grpc_moe_wire.h.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/transport/moe_call.h"

namespace hmoe {
namespace expert::v1 {
class ShardDescription;
class MoeRequest;
class MoeResponse;
}  // namespace expert::v1

// ShardInfo <-> the control plane's Describe answer (every field; the
// service adds `instance`). DATA_LOSS for a split that is not a SplitMode.
void ToShardDescription(const ShardInfo& info, expert::v1::ShardDescription* d);
absl::StatusOr<ShardInfo> FromShardDescription(const expert::v1::ShardDescription& d);

// What a MoE response that should carry `out_bytes` of f32 says: its own
// status (an out-of-range code is UNKNOWN, named), or DATA_LOSS for another
// output type or size.
absl::Status MoeResponseStatus(const expert::v1::MoeResponse& resp, int64_t out_bytes);
// The same for an answer whose `out` held `got_bytes` (read apart from it).
absl::Status MoeResponseStatus(const expert::v1::MoeResponse& resp, uint64_t got_bytes,
                               int64_t out_bytes);
// The call a MoE request carries, as the service checks it
// (ValidateMoeCall): shape and byte sizes from its fields, pointers into
// `req`'s bytes (valid while `req` is unchanged).
MoeCall MoeCallOf(const expert::v1::MoeRequest& req);
// The reverse: `call`'s shape and bytes into `req` (request_id and output
// left as they are).
void ToMoeRequest(const MoeCall& call, expert::v1::MoeRequest* req);

}  // namespace hmoe
