// A failed endpoint on the UCX service's side: the service drops it and the
// client's requests stop arriving, while the client's own endpoint reports
// nothing. One call ends by its deadline; the next ones must be answered (the
// client re-handshakes after a deadline), not lost until every deadline.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
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

// The control plane's Describe (the handler's shard, as a reconnect checks
// it) and UcxConnect, in process, in front of one UcxServer.
class Control final : public pb::ExpertControl::Service {
 public:
  Control(UcxServer* ucx, const ShardInfo& info) : ucx_(ucx), info_(info) {}
  grpc::Status Describe(grpc::ServerContext*, const pb::DescribeRequest*,
                        pb::ShardDescription* d) override {
    ShardInfo i = info_;
    i.pid = ::getpid();
    ToShardDescription(i, d);
    return grpc::Status::OK;
  }
  grpc::Status UcxConnect(grpc::ServerContext*, const pb::UcxConnectRequest* req,
                          pb::UcxConnectResponse* r) override {
    auto addr = ucx_->Connect(req->client_worker_address(), req->client_id());
    if (!addr.ok()) return ToGrpcStatus(addr.status());
    r->set_server_worker_address(*addr);
    return grpc::Status::OK;
  }

 private:
  UcxServer* ucx_;
  ShardInfo info_;
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

// One 5-token call answered exactly by a MixHandler-like shard.
template <typename H>
bool OneCallOk(UcxClient& client, const H& handler) {
  auto rc = testing::MakeRandomCall(handler.info(), 0, 5, 77);
  std::vector<float> want(static_cast<size_t>(5 * handler.info().hidden)), out(want.size());
  handler.Compute(rc.call(), want.data());
  auto h = client.Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(10));
  return h.ok() && client.Wait(*h, absl::Now() + absl::Seconds(10)).ok() && out == want;
}

// A UcxServer in front of `handler`, its control plane in process, and a
// client connected to it.
struct Rig {
  std::unique_ptr<UcxServer> ucx;
  std::unique_ptr<Control> control_service;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<UcxClient> client;

  absl::Status Start(MoeHandler& handler, const UcxServerOptions& server_opts = {},
                     const UcxClientOptions& client_opts = {}) {
    auto u = UcxServer::Create(&handler, server_opts);
    if (!u.ok()) return u.status();
    ucx = std::move(*u);
    control_service = std::make_unique<Control>(ucx.get(), handler.info());
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(control_service.get());
    grpc_server = b.BuildAndStart();
    if (grpc_server == nullptr || port == 0) return absl::InternalError("no control server");
    auto control =
        std::make_shared<ControlClient>(MakeExpertChannel(absl::StrCat("127.0.0.1:", port)));
    auto c = UcxClient::Create(control, handler.info(), client_opts);
    if (!c.ok()) return c.status();
    client = std::move(*c);
    return absl::OkStatus();
  }
  ~Rig() {
    client.reset();
    if (grpc_server) grpc_server->Shutdown();
  }
};

TEST(UcxPeer, DroppedByTheServiceOneDeadlineThenAnsweredAgain) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  testing::RowHandler handler;
  Rig rig;
  absl::Status started = rig.Start(handler);
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_TRUE(OneCall(*rig.client, handler.info(), absl::Seconds(10)).ok());
  UcxServer& ucx = *rig.ucx;
  UcxClient& client = *rig.client;
  EXPECT_EQ(ucx.endpoints(), 1u);

  ucx.FailPeersForTesting();
  EXPECT_EQ(ucx.endpoints(), 0u);
  EXPECT_EQ(ucx.peer_failures(), 1u);
  // The client is not told (its endpoint looks fine) and its requests no
  // longer reach the service: the first call can only end by its deadline.
  absl::Status lost = OneCall(client, handler.info(), absl::Milliseconds(300));
  EXPECT_EQ(lost.code(), absl::StatusCode::kDeadlineExceeded) << lost;
  // The next ones, from four threads at once, are answered: one Submit
  // re-handshakes, the others wait for it instead of sending on the dead
  // endpoint meanwhile.
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(12);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3; ++i)
        results[static_cast<size_t>(t * 3 + i)] = OneCall(client, handler.info(), absl::Seconds(5));
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < results.size(); ++i)
    EXPECT_TRUE(results[i].ok()) << "call " << i << " after the deadline: " << results[i];
  EXPECT_EQ(ucx.endpoints(), 1u);
}

// RowHandler that counts the calls it has answered.
class CountingHandler : public testing::RowHandler {
 public:
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override {
    absl::Status st = RowHandler::Handle(call, out, compute_ns);
    std::lock_guard<std::mutex> lock(mu_);
    ++answered_;
    cv_.notify_all();
    return st;
  }
  void WaitAnswered(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return answered_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int answered_ = 0;
};

// The service's drain: once the last Handle has returned it closes the UCX
// server. An answer still on its way (here every answer takes UCX's
// rendezvous path, as a large prefill answer does) must reach the client,
// not be cancelled by the endpoint's forced close.
TEST(UcxPeer, ClosingTheServerDeliversAnswersAlreadyComputed) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  testing::ScopedEnv rndv("UCX_RNDV_THRESH", "256");  // 3 tokens x 32 x f32 = 384 bytes
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    CountingHandler handler;
    Rig rig;
    absl::Status started = rig.Start(handler);
    ASSERT_TRUE(started.ok()) << started;
    ASSERT_TRUE(OneCall(*rig.client, handler.info(), absl::Seconds(10)).ok());
    const ShardInfo& info = handler.info();
    auto rc = testing::MakeRandomCall(info, info.moe_layers[0], 3, 11);
    std::vector<float> out(static_cast<size_t>(rc.tokens * info.hidden), -1.f);
    auto h = rig.client->Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(h.ok()) << h.status();
    handler.WaitAnswered(2);
    rig.ucx.reset();  // as the drain does once in_flight is 0
    absl::Status st = rig.client->Wait(*h, absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(st.ok()) << st;
    if (st.ok()) {
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_EQ(out[i], static_cast<float>(i / static_cast<size_t>(info.hidden) + 1)) << i;
    }
  }
}

// A shard whose answer depends on every byte of the request: row t, column
// h is hidden[t][h] x (sum of row t's weights) + (sum of its expert ids), so
// a fragment landed in the wrong place, twice or not at all changes it.
class MixHandler : public MoeHandler {
 public:
  MixHandler() {
    info_.hidden = 1536;
    info_.top_k = 4;
    info_.num_experts = 16;
    info_.expert_end = 16;
    info_.max_tokens = 700;
    info_.moe_layers = {0};
  }
  const ShardInfo& info() const override { return info_; }
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override {
    if (absl::Status st = ValidateMoeCall(info_, call); !st.ok()) return st;
    Compute(call, out);
    if (compute_ns) *compute_ns = 0;
    return absl::OkStatus();
  }
  void Compute(const MoeCall& call, float* out) const {
    for (int64_t t = 0; t < call.tokens; ++t) {
      float w = 0, ids = 0;
      for (int j = 0; j < call.top_k; ++j) {
        w += call.weights[t * call.top_k + j];
        ids += static_cast<float>(call.ids[t * call.top_k + j]);
      }
      for (int64_t h = 0; h < info_.hidden; ++h)
        out[t * info_.hidden + h] = Bf16ToF32(call.hidden[t * info_.hidden + h]) * w + ids;
    }
  }

 private:
  ShardInfo info_;
};

// Large calls (up to 2.2 MB of request, 4.3 MB of answer) cut into
// fragments of several sizes on either side, some calls at once from
// several threads: every answer is exactly the in-process one.
TEST(UcxPeer, CallsInFragmentsAnswerExactly) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  MixHandler handler;
  const ShardInfo& info = handler.info();
  struct Sizes {
    uint64_t client, server;
  };
  for (const Sizes sz : {Sizes{0, 0}, Sizes{kMinFragmentBytes, kMinFragmentBytes}, Sizes{100000, 0},
                         Sizes{0, 333333}, Sizes{1 << 20, 1 << 20}}) {
    SCOPED_TRACE(absl::StrCat("fragments: client ", sz.client, ", server ", sz.server));
    UcxServerOptions so;
    so.fragment_bytes = sz.server;
    UcxClientOptions co;
    co.fragment_bytes = sz.client;
    Rig rig;
    absl::Status started = rig.Start(handler, so, co);
    ASSERT_TRUE(started.ok()) << started;
    std::vector<std::thread> threads;
    std::vector<std::string> failures(3);
    for (int th = 0; th < 3; ++th) {
      threads.emplace_back([&, th] {
        int seed = th * 100;
        for (const int32_t tokens : {1, 7, 333, 700, 42}) {
          auto rc = testing::MakeRandomCall(info, 0, tokens, static_cast<uint64_t>(++seed));
          std::vector<float> want(static_cast<size_t>(tokens * info.hidden));
          handler.Compute(rc.call(), want.data());
          std::vector<float> out(want.size(), -1.f);
          auto h = rig.client->Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(20));
          absl::Status st =
              h.ok() ? rig.client->Wait(*h, absl::Now() + absl::Seconds(20)) : h.status();
          if (!st.ok()) {
            failures[static_cast<size_t>(th)] += absl::StrCat(tokens, " tokens: ", st.ToString());
          } else if (out != want) {
            failures[static_cast<size_t>(th)] += absl::StrCat(tokens, " tokens: answer differs; ");
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& f : failures) EXPECT_EQ(f, "");
    // A refused call in fragments is answered once, with the field named.
    auto rc = testing::MakeRandomCall(info, 0, 700, 5);
    MoeCall bad = rc.call();
    bad.top_k = 3;  // the ids and weights no longer match
    std::vector<float> out(static_cast<size_t>(700 * info.hidden));
    auto h = rig.client->Submit(bad, out.data(), absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(h.ok());
    absl::Status st = rig.client->Wait(*h, absl::Now() + absl::Seconds(20));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(OneCallOk(*rig.client, handler)) << "served after the refusal";
  }
  UcxServerOptions so;
  so.fragment_bytes = 1000;
  EXPECT_EQ(UcxServer::Create(&handler, so).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
