// Our status <-> grpc::Status: the one mapping, both directions (codes are
// numerically identical in Abseil and gRPC). Header-only so that thin clients
// (sdk/) use it without linking the transports.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace hmoe {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace hmoe
