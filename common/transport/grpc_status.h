// Our status <-> grpc::Status: the one mapping, both directions (codes are
// numerically identical in Abseil and gRPC). Header-only so that thin clients
// (sdk/) use it without linking the transports.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace hmoe {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// gRPC's own messages may end in an empty "last error: " (a connection
// attempt that ended without one) or be empty: those say so instead.
inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  std::string m = s.error_message();
  constexpr std::string_view kLast = "last error:";
  std::string_view trimmed(m);
  while (!trimmed.empty() && trimmed.back() == ' ') trimmed.remove_suffix(1);
  if (trimmed.empty()) {
    m = "gRPC gave no detail";
  } else if (trimmed.size() >= kLast.size() &&
             trimmed.substr(trimmed.size() - kLast.size()) == kLast) {
    m = std::string(trimmed) + " none recorded (the connection attempts ended without one)";
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), m);
}

}  // namespace hmoe
