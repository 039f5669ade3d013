// The one mapping between our status and gRPC's (common/transport/grpc_status.h),
// and how the expert clients read the service's answers (grpc_messages.h):
// unknown enum values and codes are refused, named.
#include "common/transport/grpc_status.h"

#include "common/transport/grpc_messages.h"
#include "gtest/gtest.h"
#include "proto/expert.pb.h"

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

namespace pb = ::hmoe::expert::v1;

TEST(ExpertAnswers, ShardDescriptionRoundTripsAndAnUnknownSplitIsRefused) {
  ShardInfo info;
  info.model_type = "deepseek_v3";
  info.hidden = 64;
  info.num_experts = 16;
  info.split = SplitMode::kEp;
  info.expert_begin = 4;
  info.expert_end = 8;
  pb::ShardDescription d;
  ToShardDescription(info, &d);
  auto back = FromShardDescription(d);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->split, SplitMode::kEp);
  EXPECT_EQ(back->expert_begin, 4);
  EXPECT_EQ(back->hidden, 64);
  d.set_split(static_cast<pb::SplitMode>(7));  // was taken as tp
  back = FromShardDescription(d);
  EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(back.status().message().find("ShardDescription.split = 7"), std::string::npos)
      << back.status();
}

TEST(ExpertAnswers, MoeResponsesAreCheckedBeforeTheirBytesAreUsed) {
  pb::MoeResponse r;
  r.set_out(std::string(32, '\0'));
  EXPECT_TRUE(MoeResponseStatus(r, 32).ok());
  // Another size, another output type (was read as f32), an error, an
  // out-of-range code.
  EXPECT_EQ(MoeResponseStatus(r, 16).code(), absl::StatusCode::kDataLoss);
  r.set_output(pb::OUTPUT_BF16);
  absl::Status st = MoeResponseStatus(r, 32);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("MoeResponse.output = 1"), std::string::npos) << st;
  r.set_output(static_cast<pb::OutputType>(99));
  EXPECT_EQ(MoeResponseStatus(r, 32).code(), absl::StatusCode::kDataLoss);
  r.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
  r.set_message("busy");
  st = MoeResponseStatus(r, 32);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "busy");
  r.set_code(99);
  st = MoeResponseStatus(r, 32);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnknown);
  EXPECT_NE(st.message().find("MoeResponse.code = 99"), std::string::npos) << st;
  EXPECT_NE(st.message().find("busy"), std::string::npos) << st;
}

}  // namespace
}  // namespace hmoe
