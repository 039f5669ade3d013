// The C++ client against an in-process fake of hmoe.api.v1.Generation: what
// it does with answers the worker would never send.
#include "sdk/client.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace hmoe {
namespace {

// Streams one chunk whose finish_reason is `reason`.
class FakeGeneration final : public api::v1::Generation::Service {
 public:
  explicit FakeGeneration(int reason) : reason_(reason) {}
  grpc::Status Generate(grpc::ServerContext*, const api::v1::GenerateRequest*,
                        grpc::ServerWriter<api::v1::GenerateResponse>* w) override {
    api::v1::GenerateResponse r;
    r.set_text("hi");
    r.add_token_ids(7);
    r.set_finish_reason(static_cast<api::v1::FinishReason>(reason_));
    w->Write(r);
    return grpc::Status::OK;
  }

 private:
  int reason_;
};

absl::StatusOr<GenerateResult> GenerateFrom(int reason) {
  FakeGeneration service(reason);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server || port == 0) return absl::InternalError("the fake did not start");
  ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(port);
  auto client = Client::Connect(o);
  if (!client.ok()) return client.status();
  auto r = (*client)->Generate(api::v1::GenerateRequest());
  server->Shutdown();
  return r;
}

TEST(SdkClient, AFinishReasonThatIsNotOneIsRefused) {
  auto ok = GenerateFrom(api::v1::FINISH_REASON_STOP);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->finish_reason, api::v1::FINISH_REASON_STOP);
  EXPECT_EQ(ok->text, "hi");
  auto bad = GenerateFrom(42);  // was passed on as a FinishReason
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("finish_reason = 42"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace hmoe
