// A failed endpoint on the UCX service's side: the service drops it and the
// client's requests stop arriving, while the client's own endpoint reports
// nothing. One call ends by its deadline; the next ones must be answered (the
// client re-handshakes after a deadline), not lost until every deadline.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/transport/fragments.h"
#include "common/transport/grpc_messages.h"
#include "common/transport/grpc_status.h"
#include "expert_service/transport/ucx_server.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gpu_worker/transport/ucx_client.h"
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
  int port = 0;  // the control plane's

  absl::Status Start(MoeHandler& handler, const UcxServerOptions& server_opts = {},
                     const UcxClientOptions& client_opts = {}) {
    auto u = UcxServer::Create(&handler, server_opts);
    if (!u.ok()) return u.status();
    ucx = std::move(*u);
    control_service = std::make_unique<Control>(ucx.get(), handler.info());
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

// Calls of 1 to 700 tokens (up to 2.2 MB of request, 4.3 MB of answer)
// from `threads` threads at once, each compared with the in-process
// answer: the failures, "" if none.
std::string ExactCalls(UcxClient& client, const MixHandler& handler, int threads) {
  const ShardInfo& info = handler.info();
  std::vector<std::thread> running;
  std::vector<std::string> failures(static_cast<size_t>(threads));
  for (int th = 0; th < threads; ++th) {
    running.emplace_back([&, th] {
      int seed = th * 100;
      for (const int32_t tokens : {1, 7, 333, 700, 42}) {
        auto rc = testing::MakeRandomCall(info, 0, tokens, static_cast<uint64_t>(++seed));
        std::vector<float> want(static_cast<size_t>(tokens * info.hidden));
        handler.Compute(rc.call(), want.data());
        std::vector<float> out(want.size(), -1.f);
        auto h = client.Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(20));
        absl::Status st = h.ok() ? client.Wait(*h, absl::Now() + absl::Seconds(20)) : h.status();
        if (!st.ok()) {
          failures[static_cast<size_t>(th)] += absl::StrCat(tokens, " tokens: ", st.ToString());
        } else if (out != want) {
          failures[static_cast<size_t>(th)] += absl::StrCat(tokens, " tokens: answer differs; ");
        }
      }
    });
  }
  for (auto& t : running) t.join();
  std::string all;
  for (const auto& f : failures) all += f;
  return all;
}

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
    EXPECT_EQ(ExactCalls(*rig.client, handler, 3), "");
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

// The same calls on 1, 2 and 4 lanes a side, fragments of several sizes (a
// call of one fragment on lane 0, larger ones striped over the lanes), from
// four threads at once: every answer is exactly the in-process one.
TEST(UcxPeer, CallsOnLanesAnswerExactly) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  MixHandler handler;
  for (const int lanes : {1, 2, 4}) {
    for (const uint64_t frag : {uint64_t{0}, kMinFragmentBytes, uint64_t{1} << 20}) {
      SCOPED_TRACE(absl::StrCat(lanes, " lanes, fragments of ", frag));
      UcxServerOptions so;
      so.lanes = lanes;
      so.fragment_bytes = frag;
      UcxClientOptions co;
      co.lanes = lanes;
      co.fragment_bytes = frag;
      Rig rig;
      absl::Status started = rig.Start(handler, so, co);
      ASSERT_TRUE(started.ok()) << started;
      EXPECT_EQ(rig.client->lanes(), lanes);
      EXPECT_EQ(ExactCalls(*rig.client, handler, 4), "");
      EXPECT_EQ(rig.ucx->endpoints(), 1u);  // one client, whatever its lanes
    }
  }
}

// Each side's lanes differ: the calls use the fewer.
TEST(UcxPeer, LanesMismatchUseTheFewer) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  MixHandler handler;
  struct Lanes {
    int client, server;
  };
  for (const Lanes l : {Lanes{4, 2}, Lanes{1, 4}, Lanes{3, 1}, Lanes{2, 3}}) {
    SCOPED_TRACE(absl::StrCat("client ", l.client, " lanes, server ", l.server));
    UcxServerOptions so;
    so.lanes = l.server;
    so.fragment_bytes = kMinFragmentBytes;
    UcxClientOptions co;
    co.lanes = l.client;
    co.fragment_bytes = kMinFragmentBytes;
    Rig rig;
    absl::Status started = rig.Start(handler, so, co);
    ASSERT_TRUE(started.ok()) << started;
    EXPECT_EQ(rig.client->lanes(), std::min(l.client, l.server));
    EXPECT_EQ(ExactCalls(*rig.client, handler, 2), "");
  }
  UcxClientOptions co;
  co.lanes = 0;
  EXPECT_EQ(UcxClient::Create(nullptr, handler.info(), co).status().code(),
            absl::StatusCode::kInvalidArgument);
  UcxServerOptions so;
  so.lanes = kMaxUcxLanes + 1;
  const absl::Status st = UcxServer::Create(&handler, so).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lanes"), std::string::npos) << st;
}

// MixHandler whose Handle can be held at a gate (and says when a call is
// waiting there).
class GatedMixHandler : public MixHandler {
 public:
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++entered_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    lock.unlock();
    return MixHandler::Handle(call, out, compute_ns);
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void WaitEntered(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int entered_ = 0;
};

// One of the client's lanes reports an endpoint error (here lane 2 while a
// call is being computed): that connection's calls fail UNAVAILABLE at once
// and the next Submit reconnects every lane, replacing the client's
// endpoints at the service (a cap of one client still admits it).
TEST(UcxPeer, AClientLaneFailingFailsItsCallsThenReconnects) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  GatedMixHandler handler;
  UcxServerOptions so;
  so.max_endpoints = 1;
  so.fragment_bytes = kMinFragmentBytes;
  UcxClientOptions co;
  co.fragment_bytes = kMinFragmentBytes;
  Rig rig;
  absl::Status started = rig.Start(handler, so, co);
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_EQ(rig.client->lanes(), 4);
  ASSERT_TRUE(OneCallOk(*rig.client, handler));
  for (const int32_t tokens : {1, 700}) {  // one fragment; striped over every lane
    SCOPED_TRACE(tokens);
    handler.Close();
    auto rc = testing::MakeRandomCall(handler.info(), 0, tokens, 9);
    std::vector<float> out(static_cast<size_t>(tokens * handler.info().hidden), -1.f);
    auto h = rig.client->Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(h.ok()) << h.status();
    handler.WaitEntered(tokens == 1 ? 2 : 4);
    rig.client->FailLaneForTesting(2);
    const absl::Time before = absl::Now();
    absl::Status st = rig.client->Wait(*h, absl::Now() + absl::Seconds(10));
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
    EXPECT_NE(st.message().find("lane 2"), std::string::npos) << st;
    EXPECT_LT(absl::Now() - before, absl::Seconds(1)) << "failed at once, not by the deadline";
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float f) { return f == -1.f; }));
    handler.Open();
    EXPECT_TRUE(OneCallOk(*rig.client, handler)) << "answered after the reconnect";
    EXPECT_EQ(rig.client->lanes(), 4);
    EXPECT_EQ(rig.ucx->endpoints(), 1u);
  }
  EXPECT_EQ(ExactCalls(*rig.client, handler, 2), "");
  // The cap counts clients, not lanes: a second client is one too many.
  auto control =
      std::make_shared<ControlClient>(MakeExpertChannel(absl::StrCat("127.0.0.1:", rig.port)));
  auto second = UcxClient::Create(control, handler.info(), co);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
}

// The service sees an endpoint error on one lane (the last of four): it
// drops the client, all its lanes, and the client is not told. One call
// (striped over every lane) ends by its deadline; the next ones, from four
// threads, are answered after the client's re-handshake.
TEST(UcxPeer, AServiceLaneFailingDropsTheClientOneDeadlineThenAnswered) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  MixHandler handler;
  UcxServerOptions so;
  so.fragment_bytes = kMinFragmentBytes;
  UcxClientOptions co;
  co.fragment_bytes = kMinFragmentBytes;
  Rig rig;
  absl::Status started = rig.Start(handler, so, co);
  ASSERT_TRUE(started.ok()) << started;
  ASSERT_TRUE(OneCallOk(*rig.client, handler));
  rig.ucx->FailPeersForTesting(3);
  EXPECT_EQ(rig.ucx->endpoints(), 0u);
  EXPECT_EQ(rig.ucx->peer_failures(), 1u);
  auto rc = testing::MakeRandomCall(handler.info(), 0, 700, 3);
  std::vector<float> out(static_cast<size_t>(700 * handler.info().hidden));
  auto h = rig.client->Submit(rc.call(), out.data(), absl::Now() + absl::Milliseconds(300));
  ASSERT_TRUE(h.ok()) << h.status();
  absl::Status lost = rig.client->Wait(*h, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(lost.code(), absl::StatusCode::kDeadlineExceeded) << lost;
  EXPECT_EQ(ExactCalls(*rig.client, handler, 4), "");
  EXPECT_EQ(rig.ucx->endpoints(), 1u);
  EXPECT_EQ(rig.client->lanes(), 4);
}

// MixHandler that counts the calls it has answered.
class CountingMixHandler : public MixHandler {
 public:
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override {
    absl::Status st = MixHandler::Handle(call, out, compute_ns);
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

// The drain with lanes: an answer striped over four lanes (66 fragments,
// each over the rendezvous threshold) whose Handle has returned must reach
// the client whole when the server closes right after.
TEST(UcxPeer, ClosingTheServerDeliversStripedAnswers) {
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  testing::ScopedEnv rndv("UCX_RNDV_THRESH", "256");
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    CountingMixHandler handler;
    UcxServerOptions so;
    so.fragment_bytes = kMinFragmentBytes;
    UcxClientOptions co;
    co.fragment_bytes = kMinFragmentBytes;
    Rig rig;
    absl::Status started = rig.Start(handler, so, co);
    ASSERT_TRUE(started.ok()) << started;
    ASSERT_TRUE(OneCallOk(*rig.client, handler));
    auto rc = testing::MakeRandomCall(handler.info(), 0, 700, 21);
    std::vector<float> want(static_cast<size_t>(700 * handler.info().hidden));
    handler.Compute(rc.call(), want.data());
    std::vector<float> out(want.size(), -1.f);
    auto h = rig.client->Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(h.ok()) << h.status();
    handler.WaitAnswered(2);
    rig.ucx.reset();  // as the drain does once in_flight is 0
    absl::Status st = rig.client->Wait(*h, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(out == want);
  }
}

// The handshake's lane list: one address goes bare, several round-trip;
// a malformed list is refused INVALID_ARGUMENT naming the field, before any
// endpoint is made.
TEST(UcxPeer, LaneListsRoundTripAndMalformedOnesAreRefused) {
  EXPECT_EQ(EncodeUcxAddresses({"abc"}), "abc");
  const std::vector<std::string> three = {"first", std::string(1000, 'x'), "z"};
  auto back = DecodeUcxAddresses(EncodeUcxAddresses(three), "f");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, three);
  auto bare = DecodeUcxAddresses("abc", "f");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(*bare, std::vector<std::string>{"abc"});
  const std::string list = EncodeUcxAddresses(three);
  auto le32 = [](uint32_t v) {
    return std::string{static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16),
                       static_cast<char>(v >> 24)};
  };
  const std::string magic = list.substr(0, 8);
  const std::vector<std::string> bad = {
      "",
      std::string(kMaxUcxAddressBytes + 1, 'a'),
      magic,                            // no count
      list.substr(0, list.size() - 1),  // the last address cut short
      list + "!",                       // bytes after the last address
      magic + le32(0),                  // no addresses
      magic + le32(kMaxUcxLanes + 1),   // too many
      magic + le32(1) + le32(0),        // an empty address
      magic + le32(2) + le32(1) + "a" + le32(kMaxUcxAddressBytes + 1),
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    auto d = DecodeUcxAddresses(bad[i], "client_worker_address");
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << i;
    EXPECT_NE(d.status().message().find("client_worker_address"), std::string::npos)
        << i << ": " << d.status();
  }
  testing::ScopedEnv tls("UCX_TLS", "tcp,sm,self");
  MixHandler handler;
  auto server = UcxServer::Create(&handler);
  ASSERT_TRUE(server.ok()) << server.status();
  for (size_t i = 0; i < bad.size(); ++i) {
    EXPECT_EQ((*server)->Connect(bad[i], 7).status().code(), absl::StatusCode::kInvalidArgument)
        << i;
  }
  EXPECT_EQ((*server)->endpoints(), 0u);
}

}  // namespace
}  // namespace hmoe
