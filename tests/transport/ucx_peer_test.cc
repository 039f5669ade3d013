// A failed endpoint on the UCX service's side: the service drops it and the
// client's requests stop arriving, while the client's own endpoint reports
// nothing. One call ends by its deadline; the next ones must be answered (the
// client re-handshakes after a deadline), not lost until every deadline.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/transport/grpc_client.h"
#include "common/transport/grpc_status.h"
#include "common/transport/ucx_transport.h"
#include "gtest/gtest.h"
#include "proto/expert.grpc.pb.h"
#include "tests/testing/scoped_env.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

namespace pb = ::hmoe::expert::v1;

// The control plane's UcxConnect, in process, in front of one UcxServer.
class Control final : public pb::ExpertControl::Service {
 public:
  explicit Control(UcxServer* ucx) : ucx_(ucx) {}
  grpc::Status UcxConnect(grpc::ServerContext*, const pb::UcxConnectRequest* req,
                          pb::UcxConnectResponse* r) override {
    auto addr = ucx_->Connect(req->client_worker_address(), req->client_id());
    if (!addr.ok()) return ToGrpcStatus(addr.status());
    r->set_server_worker_address(*addr);
    return grpc::Status::OK;
  }

 private:
  UcxServer* ucx_;
};

absl::Status OneCall(UcxClient& client, const ShardInfo& info, absl::Duration timeout) {
  auto rc = testing::MakeRandomCall(info, info.moe_layers[0], 3, 11);
  std::vector<float> out(static_cast<size_t>(rc.tokens * info.hidden), -1.f);
  auto h = client.Submit(rc.call(), out.data(), absl::Now() + timeout);
  if (!h.ok()) return h.status();
  absl::Status st = client.Wait(*h, absl::Now() + timeout);
  if (!st.ok()) return st;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] != static_cast<float>(i / static_cast<size_t>(info.hidden) + 1))
      return absl::InternalError(absl::StrCat("out[", i, "] = ", out[i]));
  }
  return absl::OkStatus();
}

TEST(UcxPeer, DroppedByTheServiceOneDeadlineThenAnsweredAgain) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  testing::RowHandler handler;
  auto ucx = UcxServer::Create(&handler);
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  Control control_service(ucx->get());
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&control_service);
  std::unique_ptr<grpc::Server> grpc_server = b.BuildAndStart();
  ASSERT_NE(grpc_server, nullptr);
  ASSERT_GT(port, 0);
  auto control =
      std::make_shared<ControlClient>(MakeExpertChannel(absl::StrCat("127.0.0.1:", port)));
  auto client = UcxClient::Create(control, handler.info());
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(OneCall(**client, handler.info(), absl::Seconds(10)).ok());
  EXPECT_EQ((*ucx)->endpoints(), 1u);

  (*ucx)->FailPeersForTesting();
  EXPECT_EQ((*ucx)->endpoints(), 0u);
  EXPECT_EQ((*ucx)->peer_failures(), 1u);
  // The client is not told (its endpoint looks fine) and its requests no
  // longer reach the service: the first call can only end by its deadline.
  absl::Status lost = OneCall(**client, handler.info(), absl::Milliseconds(300));
  EXPECT_EQ(lost.code(), absl::StatusCode::kDeadlineExceeded) << lost;
  // The next ones, from four threads at once, are answered: one Submit
  // re-handshakes, the others wait for it instead of sending on the dead
  // endpoint meanwhile.
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(12);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3; ++i)
        results[static_cast<size_t>(t * 3 + i)] =
            OneCall(**client, handler.info(), absl::Seconds(5));
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < results.size(); ++i)
    EXPECT_TRUE(results[i].ok()) << "call " << i << " after the deadline: " << results[i];
  EXPECT_EQ((*ucx)->endpoints(), 1u);
  client->reset();
  grpc_server->Shutdown();
}

}  // namespace
}  // namespace hmoe
