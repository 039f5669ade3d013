// The one mapping between our status and gRPC's (common/transport/grpc_status.h).
#include "common/transport/grpc_status.h"

#include "gtest/gtest.h"

namespace hmoe {
namespace {

TEST(GrpcStatus, CodesAndMessagesMapBothWays) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const absl::Status s = FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "gone");
  const grpc::Status g = ToGrpcStatus(absl::ResourceExhaustedError("full"));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(g.error_message(), "full");
}

// gRPC's "failed to connect to all addresses; last error: " with nothing
// after it (seen after an expert service died) and an empty message say so.
TEST(GrpcStatus, AnEmptyLastErrorOrMessageIsNamed) {
  const absl::Status s = FromGrpcStatus(grpc::Status(
      grpc::StatusCode::UNAVAILABLE, "failed to connect to all addresses; last error: "));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            "failed to connect to all addresses; last error: none recorded (the connection "
            "attempts ended without one)");
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::INTERNAL, "")).message(),
            "gRPC gave no detail");
  // A last error that says something is kept as is.
  const std::string full =
      "failed to connect to all addresses; last error: UNKNOWN: Connection refused";
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, full)).message(), full);
}

}  // namespace
}  // namespace hmoe
