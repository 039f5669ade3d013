// The expert service as real processes on loopback: every transport, 1-3
// shards, both split modes, against the in-process result (an ExpertShard in
// this process: the same packed weights and the same RunMoe kernels, so only
// the fp32 summation of TP partials / node parts differs: 1e-5); faults; bad
// input.
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>

#include "common/transport/grpc_messages.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/transport/shm_server.h"
#include "expert_service/transport/ucx_server.h"
#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gpu_worker/transport/shm_client.h"
#include "gpu_worker/transport/ucx_client.h"
#include "gtest/gtest.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::MakeRandomCall;
using ::hmoe::testing::MaxRelDiff;
using ::hmoe::testing::ServiceProcess;
using ::hmoe::testing::TempDir;

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }

void UseLoopbackUcx() { setenv("UCX_TLS", "tcp,sm,self", 0); }

const TransportKind kTransports[] = {TransportKind::kGrpc, TransportKind::kShm,
                                     TransportKind::kUcx};

std::unique_ptr<ExpertShard> LocalShard(const std::string& extra_format = "bf16") {
  ShardOptions o;
  o.model_dir = ModelDir();
  int group = 64;
  o.format = *ParseWeightFormat(extra_format, &group);
  o.group = group;
  auto s = ExpertShard::Load(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

class ShardedTest : public ::testing::TestWithParam<std::tuple<int, SplitMode>> {};

TEST_P(ShardedTest, AllTransportsEqualInProcess) {
  UseLoopbackUcx();
  const auto [n, split] = GetParam();
  TempDir dir;
  auto local = LocalShard();
  std::vector<std::unique_ptr<ServiceProcess>> procs;
  std::vector<std::string> targets;
  for (int i = 0; i < n; ++i) {
    procs.push_back(std::make_unique<ServiceProcess>());
    ASSERT_TRUE(
        procs.back()->Start({"--model-dir=" + ModelDir(), absl::StrCat("--shard=", i, "/", n),
                             absl::StrCat("--split=", SplitModeName(split))},
                            dir.file(absl::StrCat("port", i))));
    targets.push_back(procs.back()->target());
  }
  // Reverse order: the pool sorts shards by their own index.
  std::reverse(targets.begin(), targets.end());
  const ShardInfo& info = local->info();
  for (TransportKind tk : kTransports) {
    SCOPED_TRACE(TransportKindName(tk));
    ExpertPoolOptions po;
    po.targets = targets;
    po.transport = tk;
    auto pool = ExpertPool::Connect(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->num_shards(), n);
    // Several layers in flight at once, then waited in order.
    std::vector<::hmoe::testing::RandomCall> calls;
    std::vector<std::vector<float>> outs;
    std::vector<uint64_t> handles;
    uint64_t seed = 1;
    for (int32_t tokens : {1, 5, 37}) {
      for (int32_t layer : info.moe_layers) {
        calls.push_back(MakeRandomCall(info, layer, tokens, seed++));
      }
    }
    outs.resize(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      outs[i].assign(static_cast<size_t>(calls[i].tokens * info.hidden), -1.f);
      auto h = (*pool)->Submit(calls[i].call(), outs[i].data(), absl::Now() + absl::Seconds(20));
      ASSERT_TRUE(h.ok()) << h.status();
      handles.push_back(*h);
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      absl::Status st = (*pool)->Wait(handles[i], absl::Now() + absl::Seconds(20));
      ASSERT_TRUE(st.ok()) << st;
      std::vector<float> want(outs[i].size());
      ASSERT_TRUE(local->Handle(calls[i].call(), want.data(), nullptr).ok());
      EXPECT_LT(MaxRelDiff(outs[i], want), 1e-5) << "call " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shards, ShardedTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(SplitMode::kTp, SplitMode::kEp)),
                         [](const auto& p) {
                           return absl::StrCat(std::get<0>(p.param), "shards_",
                                               SplitModeName(std::get<1>(p.param)));
                         });

// ---- faults -----------------------------------------------------------------

class FaultTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  // Starts one shard of the tiny model (plus `flags`) and connects a pool to
  // it over the transport under test; shm_slots 0: the pool's default.
  void StartShard(std::vector<std::string> flags = {}, uint32_t shm_slots = 0,
                  absl::Duration fail_fast_after_miss = absl::ZeroDuration()) {
    UseLoopbackUcx();
    flags.insert(flags.begin(), "--model-dir=" + ModelDir());
    ASSERT_TRUE(proc_.Start(flags, dir_.file("port")));
    ExpertPoolOptions po;
    po.targets = {proc_.target()};
    po.transport = GetParam();
    if (shm_slots > 0) po.shm_slots = shm_slots;
    po.fail_fast_after_miss = fail_fast_after_miss;
    auto pool = ExpertPool::Connect(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }
  // Runs `call` until it is served (a restarted port is retried after the
  // channel's backoff) or 10 s pass; the last status.
  absl::Status RunUntilServed(const MoeCall& call, float* out) {
    absl::Status st;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
      st = pool_->Run(call, out, absl::Now() + absl::Seconds(2));
      if (!st.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (!st.ok() && std::chrono::steady_clock::now() < until);
    return st;
  }

  // Kills the shard and starts it on the same port as int8 (the pool
  // connected to bf16), then runs `call` while the shard is only coming
  // back (UNAVAILABLE or DEADLINE_EXCEEDED, up to 10 s) and returns the
  // first other answer; optionally with a health check before each call.
  absl::Status RestartAsInt8ThenRun(const MoeCall& call, float* out, bool check_health) {
    const int port = proc_.port();
    proc_.Kill(SIGKILL);
    if (!proc_.Start({"--model-dir=" + ModelDir(), "--format=int8"}, dir_.file("port"), port))
      return absl::InternalError("the shard did not restart");
    absl::Status st;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
      if (check_health) pool_->CheckHealth(absl::Seconds(2));
      st = pool_->Run(call, out, absl::Now() + absl::Seconds(2));
    } while ((absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) &&
             std::chrono::steady_clock::now() < until);
    return st;
  }

  TempDir dir_;
  ServiceProcess proc_;
  std::unique_ptr<ExpertPool> pool_;
};

TEST_P(FaultTest, KillMidStreamUnavailableThenRecovers) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 16, 7);
  std::vector<float> out(static_cast<size_t>(16 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());

  // Stop it so the calls are surely in flight, then kill it.
  proc_.Signal(SIGSTOP);
  std::vector<std::vector<float>> outs(3, out);
  std::vector<uint64_t> handles;
  for (auto& o : outs) {
    auto h = pool_->Submit(call.call(), o.data(), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(*h);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  proc_.Kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t h : handles) {
    absl::Status st = pool_->Wait(h, absl::Now() + absl::Seconds(10));
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 2.0);
  EXPECT_FALSE(pool_->ShardsUp()[0]);
  EXPECT_EQ(pool_->CheckHealth()[0], Health::kNotServing);

  ASSERT_TRUE(proc_.Restart());
  absl::Status st = RunUntilServed(call.call(), out.data());
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(pool_->ShardsUp()[0]);
  EXPECT_EQ(pool_->CheckHealth(absl::Seconds(2))[0], Health::kServing);
}

TEST_P(FaultTest, StoppedShardDeadlineExceededNoThreadPileUp) {
  ASSERT_NO_FATAL_FAILURE(StartShard({}, 8));
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 9);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  const int threads_before = ::hmoe::testing::ThreadCount();
  proc_.Signal(SIGSTOP);
  for (int i = 0; i < 4; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Milliseconds(200));
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  }
  EXPECT_LE(::hmoe::testing::ThreadCount(), threads_before + 1);
  proc_.Signal(SIGCONT);
  absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;
}

// A stopped (hung) shard fed large calls: the gRPC stream's flow-control
// window fills (its writes would block), the shm slots stay held by
// abandoned calls, the UCX client keeps re-handshaking. Every call still
// ends by its own deadline, DEADLINE_EXCEEDED (Submit never holds the caller
// past it), and the shard serves again once continued.
TEST_P(FaultTest, StoppedShardLargeCallsEndByTheirDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartShard({"--max-tokens=4096"}, 4));
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4096, 9);  // 640 KiB of request
  std::vector<float> out(static_cast<size_t>(4096 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  proc_.Signal(SIGSTOP);
  for (int i = 0; i < 40; ++i) {  // 25 MiB in all, two seconds of calls
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Milliseconds(50));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << "call " << i << ": " << st;
    // Slack for a loaded 2-core CI machine; the old blocking Write took seconds.
    EXPECT_LT(secs, 0.5) << "call " << i << " with a 50 ms deadline: " << st;
  }
  proc_.Signal(SIGCONT);
  absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;
}

// fail_fast_after_miss: after one call misses its deadline on a stopped
// shard, the next calls to it fail UNAVAILABLE at once (naming the shard)
// instead of each waiting out its own deadline; once the window has passed
// and the shard runs again, calls succeed.
TEST_P(FaultTest, FailFastAfterAMissSparesTheCallsBehindIt) {
  ASSERT_NO_FATAL_FAILURE(StartShard({}, 0, absl::Milliseconds(500)));
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 3);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  proc_.Signal(SIGSTOP);
  absl::Status missed = pool_->Run(call.call(), out.data(), absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(missed.code(), absl::StatusCode::kDeadlineExceeded) << missed;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(2));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
    EXPECT_NE(st.message().find("failing fast"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("expert shard 0"), absl::string_view::npos) << st;
    EXPECT_LT(secs, 0.3) << "call " << i << " waited instead of failing fast: " << st;
  }
  proc_.Signal(SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  absl::Status st = RunUntilServed(call.call(), out.data());
  EXPECT_TRUE(st.ok()) << st;
}

// A call whose deadline had passed before it was sent is not the shard's
// miss: the shard must not fail fast afterwards (before: a caller's expired
// deadline, or an earlier shard's slow submit, put every shard after it into
// the fail-fast window).
TEST_P(FaultTest, AnExpiredDeadlineIsNotTheShardsMiss) {
  ASSERT_NO_FATAL_FAILURE(StartShard({}, 0, absl::Seconds(30)));
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 3);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  absl::Status late = pool_->Run(call.call(), out.data(), absl::Now() - absl::Seconds(1));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;
}

// The shard dies and comes back hung (restarted, then stopped: its port
// accepts connections, nothing answers). The client's reconnect (a new
// stream; shm describe + attach; the UCX handshake) ends by each call's
// deadline rather than running out the transport's own control-plane
// timeouts (2 s) or the channel's connect timeout (20 s).
TEST_P(FaultTest, ReconnectToAHungShardEndsByTheDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 5);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  proc_.Kill(SIGKILL);
  EXPECT_FALSE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(1)).ok());
  ASSERT_TRUE(proc_.Restart());
  proc_.Signal(SIGSTOP);
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Milliseconds(50));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // DEADLINE_EXCEEDED, or UNAVAILABLE where the channel has already given
    // up on the port (a connection attempt that saw no HTTP/2 settings).
    EXPECT_TRUE(absl::IsDeadlineExceeded(st) || absl::IsUnavailable(st))
        << "call " << i << ": " << st;
    EXPECT_LT(secs, 0.5) << "call " << i << " with a 50 ms deadline: " << st;
  }
  proc_.Signal(SIGCONT);
  absl::Status st = RunUntilServed(call.call(), out.data());
  EXPECT_TRUE(st.ok()) << st;
}

// A shard restarted on the same port with other weights (here the same
// model as int8, where the worker connected to bf16) must not answer the
// worker's calls: every transport describes the service when it reconnects,
// before its first call there, and the pool's health check finds the
// difference too; calls fail FAILED_PRECONDITION naming it, never OK, until
// the shard serves the original again.
TEST_P(FaultTest, AShardRestartedWithOtherWeightsIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const ShardInfo info = pool_->model();
  ASSERT_EQ(info.weight_format, "bf16");
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 5);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  ASSERT_TRUE(pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  // No health check yet: the transport's reconnect must catch it.
  absl::Status st = RestartAsInt8ThenRun(call.call(), out.data(), /*check_health=*/false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("weight format int8 (was bf16)"), absl::string_view::npos) << st;
  // And the pool's health check finds it too: calls refused before any
  // transport is asked.
  pool_->CheckHealth(absl::Seconds(2));
  st = pool_->Run(call.call(), out.data(), absl::Now() + absl::Seconds(2));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("expert shard 0"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("weight format int8 (was bf16)"), absl::string_view::npos) << st;
  EXPECT_EQ(pool_->CheckHealth(absl::Seconds(2))[0], Health::kNotServing);
  EXPECT_FALSE(pool_->ShardsUp()[0]);

  // Back as it was: served again once a health check has seen it.
  const int port = proc_.port();
  proc_.Kill(SIGKILL);
  ASSERT_TRUE(proc_.Start({"--model-dir=" + ModelDir()}, dir_.file("port"), port));
  Health h = Health::kUnknown;
  for (int i = 0; i < 200 && h != Health::kServing; ++i) {
    h = pool_->CheckHealth(absl::Seconds(2))[0];
    if (h != Health::kServing) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(h, Health::kServing);
  st = RunUntilServed(call.call(), out.data());
  EXPECT_TRUE(st.ok()) << st;
}

// The same before the worker's first call: the gRPC stream opens only at
// the first Submit, long after the pool described the shard, and is checked
// too.
TEST_P(FaultTest, ARestartBeforeTheFirstCallIsRefusedToo) {
  ASSERT_NO_FATAL_FAILURE(StartShard());
  const ShardInfo info = pool_->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 5);
  std::vector<float> out(static_cast<size_t>(4 * info.hidden));
  const absl::Status st = RestartAsInt8ThenRun(call.call(), out.data(), /*check_health=*/false);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("weight format int8 (was bf16)"), absl::string_view::npos) << st;
}

INSTANTIATE_TEST_SUITE_P(Transports, FaultTest, ::testing::ValuesIn(kTransports),
                         [](const auto& p) { return std::string(TransportKindName(p.param)); });

// The gRPC client's send queue is bounded: behind a stopped service (its
// window full, the writer blocked) Submit waits for room only until the
// call's deadline, then says why; nothing it queued is lost once the
// service continues.
TEST(GrpcStream, StalledServiceSubmitWaitsForRoomUntilTheDeadline) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--max-tokens=4096"}, dir.file("port")));
  auto channel = MakeExpertChannel(proc.target());
  auto info = ControlClient(channel).Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  GrpcStreamClient client(channel, info->hidden, uint64_t{2} << 20);
  auto call = MakeRandomCall(*info, info->moe_layers[0], 4096, 3);
  std::vector<float> out(static_cast<size_t>(4096 * info->hidden));
  auto run = [&](absl::Duration timeout) -> absl::Status {
    const absl::Time deadline = absl::Now() + timeout;
    auto h = client.Submit(call.call(), out.data(), deadline);
    if (!h.ok()) return h.status();
    return client.Wait(*h, deadline);
  };
  ASSERT_TRUE(run(absl::Seconds(10)).ok());
  proc.Signal(SIGSTOP);
  int queue_full = 0;
  // Until the window, the socket buffers and the 2 MiB queue are full (about
  // ten calls with default socket sizes); at most 400 calls.
  for (int i = 0; i < 400 && queue_full == 0; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = run(absl::Milliseconds(50));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << "call " << i << ": " << st;
    EXPECT_LT(secs, 0.5) << "call " << i << ": " << st;
    if (st.message().find("send queue full") != absl::string_view::npos) ++queue_full;
  }
  EXPECT_GT(queue_full, 0) << "the 2 MiB queue never filled behind the stopped service";
  proc.Signal(SIGCONT);
  absl::Status st = run(absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;
}

// ---- bad input ----------------------------------------------------------------

class BadInputTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(BadInputTest, InvalidArgumentNamingFieldAndKeepsServing) {
  UseLoopbackUcx();
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--max-tokens=16"}, dir.file("port")));
  auto control = std::make_shared<ControlClient>(MakeExpertChannel(proc.target()));
  auto info = control->Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  std::unique_ptr<MoeClient> client;
  switch (GetParam()) {
    case TransportKind::kGrpc:
      client = std::make_unique<GrpcStreamClient>(MakeExpertChannel(proc.target()), info->hidden);
      break;
    case TransportKind::kShm: {
      ShmClientOptions so;
      so.max_tokens = 32;  // room for the over-capacity call, so the server must refuse it
      auto c = ShmClient::Create(control, *info, so);
      ASSERT_TRUE(c.ok()) << c.status();
      client = std::move(*c);
      break;
    }
    case TransportKind::kUcx: {
      auto c = UcxClient::Create(control, *info);
      ASSERT_TRUE(c.ok()) << c.status();
      client = std::move(*c);
      break;
    }
  }
  auto run = [&](const MoeCall& call) -> absl::Status {
    std::vector<float> out(static_cast<size_t>(std::max(call.tokens, 1) * info->hidden));
    auto h = client->Submit(call, out.data(), absl::Now() + absl::Seconds(10));
    if (!h.ok()) return h.status();
    return client->Wait(*h, absl::Now() + absl::Seconds(10));
  };
  auto good = MakeRandomCall(*info, info->moe_layers[0], 3, 5);
  ASSERT_TRUE(run(good.call()).ok());

  struct Case {
    std::string field;
    std::function<void(::hmoe::testing::RandomCall&, MoeCall&)> mutate;
  };
  auto big = MakeRandomCall(*info, info->moe_layers[0], 17, 6);
  std::vector<Case> cases = {
      {"layer", [](auto&, MoeCall& c) { c.layer = 0; }},
      {"hidden", [](auto&, MoeCall& c) { c.hidden_bytes -= 2; }},
      {"expert_ids", [](auto& r, MoeCall&) { r.ids[4] = 999; }},
      {"expert_weights", [](auto& r, MoeCall&) { r.weights[2] = std::nanf(""); }},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.field);
    auto r = good;
    MoeCall c = r.call();
    cs.mutate(r, c);
    c.ids = r.ids.data();
    c.weights = r.weights.data();
    absl::Status st = run(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(cs.field), absl::string_view::npos) << st;
    EXPECT_TRUE(run(good.call()).ok());
  }
  {
    SCOPED_TRACE("tokens over capacity");
    absl::Status st = run(big.call());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("tokens: 17"), absl::string_view::npos) << st;
    EXPECT_TRUE(run(good.call()).ok());
  }
  {
    // Sizes that wrap around 2^64 when summed: refused by the client before
    // it copies anything (before: the shm capacity check wrapped and UCX
    // sized its payload with the wrapped sum; memcpy ran off the buffers).
    SCOPED_TRACE("byte sizes that wrap");
    MoeCall c = good.call();
    c.weights_bytes = ~uint64_t{0} - c.hidden_bytes - c.ids_bytes + 1;
    absl::Status st = run(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(run(good.call()).ok());
  }
  auto stats = control->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->invalid, 5u);  // the wrapping call never reached the service
  EXPECT_EQ(control->Check(), Health::kServing);
}

INSTANTIATE_TEST_SUITE_P(Transports, BadInputTest, ::testing::ValuesIn(kTransports),
                         [](const auto& p) { return std::string(TransportKindName(p.param)); });

// ---- shared memory: the worker dies holding the segment ---------------------

// A UCX set-up that fails part-way (here: a malformed UCX_ environment value)
// is an error from Create, not a crash while the half-built worker is torn
// down.
TEST(UcxSetup, BadEnvironmentIsAnErrorNotACrash) {
  testing::ScopedEnv env("UCX_RNDV_THRESH", "not-a-size");
  auto server = UcxServer::Create(nullptr);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(std::string(server.status().message()), "");
}

// UcxConnect's address comes from the network, and UCX aborts the process on
// one it cannot parse (found by this test: an assertion in ucp_address_unpack).
// With the checker, a malformed address is an INVALID_ARGUMENT for that call;
// a real one still connects, and the server goes on serving.
// A plain UCX worker of this process: a real client worker address.
struct PlainUcxWorker {
  PlainUcxWorker() {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    if (ucp_init(&params, nullptr, &ctx) != UCS_OK) return;
    ucp_worker_params_t wp{};
    if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK) return;
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    if (ucp_worker_get_address(worker, &addr, &len) != UCS_OK) return;
    address.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker, addr);
  }
  ~PlainUcxWorker() {
    if (worker) ucp_worker_destroy(worker);
    if (ctx) ucp_cleanup(ctx);
  }
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;  // empty if UCX could not start
};

// A UcxServer (no handler) with the service's own address checker.
absl::StatusOr<std::unique_ptr<UcxServer>> CheckedUcxServer() {
  UcxServerOptions opts;
  opts.address_checker = {::hmoe::testing::ServiceBinary(), "--check-ucx-address"};
  return UcxServer::Create(nullptr, opts);
}

TEST(UcxSetup, MalformedWorkerAddressesAreRefusedNotFatal) {
  auto server = CheckedUcxServer();
  ASSERT_TRUE(server.ok()) << server.status();
  // A real client address: a plain UCX worker's.
  PlainUcxWorker client;
  ASSERT_FALSE(client.address.empty());
  const std::string& real = client.address;
  const size_t len = real.size();

  std::mt19937 rng(5);
  std::vector<std::string> bad = {"x", std::string(7, '\0'), std::string(64, '\xff'),
                                  "not-an-address", real.substr(0, 1)};
  for (int i = 0; i < 6; ++i) {
    std::string b(1 + rng() % 400, '\0');
    for (char& c : b) c = static_cast<char>(rng());
    bad.push_back(b);
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    auto r = (*server)->Connect(bad[i], 1000 + i);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("client_worker_address"), std::string::npos)
        << r.status();
  }
  auto big = (*server)->Connect(std::string(kMaxUcxAddressBytes + 1, 'a'), 7);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument) << big.status();
  // The real address with bytes changed past its header: refused or accepted,
  // never fatal.
  for (size_t at : {len / 3, len / 2, len - 1}) {
    std::string edited = real;
    edited[at] = static_cast<char>(edited[at] ^ 0x5a);
    auto r = (*server)->Connect(edited, 2000 + at);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    }
  }
  // Still up: the real address connects.
  auto ok = (*server)->Connect(real, 1);
  EXPECT_TRUE(ok.ok()) << ok.status();
  server->reset();
}

// A client that gave up (its control call's deadline passed) while the
// address check ran gets no endpoint: asked before and after the check.
TEST(UcxSetup, AClientThatGaveUpGetsNoEndpoint) {
  auto server = CheckedUcxServer();
  ASSERT_TRUE(server.ok()) << server.status();
  PlainUcxWorker client;
  ASSERT_FALSE(client.address.empty());
  const std::string& real = client.address;

  auto before = (*server)->Connect(real, 1, [] { return true; });
  EXPECT_EQ(before.status().code(), absl::StatusCode::kCancelled) << before.status();
  int asked = 0;
  auto during = (*server)->Connect(real, 2, [&asked] { return ++asked > 1; });
  EXPECT_EQ(during.status().code(), absl::StatusCode::kCancelled) << during.status();
  EXPECT_THAT(std::string(during.status().message()), ::testing::HasSubstr("no endpoint"));
  EXPECT_EQ(asked, 2);
  EXPECT_EQ((*server)->endpoints(), 0u);
  auto stayed = (*server)->Connect(real, 3, [] { return false; });
  EXPECT_TRUE(stayed.ok()) << stayed.status();
  EXPECT_EQ((*server)->endpoints(), 1u);
  server->reset();
}

// A checker that never becomes ready (here: a program that does not speak
// the protocol) or cannot be run: Create fails UNAVAILABLE within the check
// timeout, and the service runs without UCX rather than unchecked.
TEST(UcxSetup, ACheckerThatCannotStartFailsCreate) {
  UcxServerOptions opts;
  opts.check_timeout = absl::Milliseconds(300);
  for (const std::vector<std::string>& argv :
       {std::vector<std::string>{"/bin/sleep", "30"},
        std::vector<std::string>{"/nonexistent/hmoe-expert-service", "--check-ucx-address"}}) {
    SCOPED_TRACE(argv[0]);
    opts.address_checker = argv;
    const auto t0 = absl::Now();
    auto server = UcxServer::Create(nullptr, opts);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
    EXPECT_NE(std::string(server.status().message()).find("UCX address check"), std::string::npos)
        << server.status();
    EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  }
}

TEST(ShmPeerDeath, ClientKilledMidWriteSegmentDiscarded) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--no-ucx"}, dir.file("port")));
  auto control = std::make_shared<ControlClient>(MakeExpertChannel(proc.target()));
  auto info = control->Describe();
  ASSERT_TRUE(info.ok());
  ShmGeometry geo;
  geo.slots = 2;
  geo.hidden = info->hidden;
  geo.max_tokens = 8;
  geo.max_top_k = info->top_k;
  // The segment: a sealed memfd made before the fork, so the child holds it
  // at the same fd number (the service opens it as /proc/<child>/fd/<fd>).
  const std::string memfd_name = absl::StrCat("hmoe-test-", getpid());
  const int fd = memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0600), 0);
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(geo.total_bytes())), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  // The "worker": a child that only waits to be killed.
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_GT(child, 0);
  // Reaped on every exit path (a failed ASSERT must not leave it paused).
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{child};
  const std::string path = absl::StrCat("/proc/", child, "/fd/", fd);
  auto* base = static_cast<uint8_t*>(
      mmap(nullptr, geo.total_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(base, MAP_FAILED);
  auto* h = reinterpret_cast<ShmHeader*>(base);
  geo.WriteHeader(h);
  h->nonce = 0xabcdef;
  auto epoch = control->AttachShm(path, child, 0xabcdef);
  ASSERT_TRUE(epoch.ok()) << epoch.status();
  auto service_maps = [&] {
    std::ifstream maps("/proc/" + std::to_string(proc.pid()) + "/maps");
    return std::string((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
  };
  ASSERT_NE(service_maps().find("memfd:" + memfd_name), std::string::npos)
      << "the service does not map the attached segment";
  // A hostile request: offsets far outside the slot. Refused, not dereferenced.
  auto* slot = reinterpret_cast<ShmSlot*>(base + h->slots_offset);
  slot->layer = info->moe_layers[0];
  slot->tokens = 1;
  slot->top_k = static_cast<int32_t>(info->top_k);
  slot->hidden_off = 1ull << 40;
  slot->hidden_bytes = static_cast<uint64_t>(info->hidden) * 2;
  slot->state.store(kSlotRequest);
  h->doorbell.fetch_add(1);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAKE, 1, nullptr, nullptr, 0);
  for (int i = 0; i < 200 && slot->state.load() != kSlotDone; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(slot->state.load(), kSlotDone);
  EXPECT_EQ(slot->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(std::string(slot->msg, slot->msg_len).find("hidden"), std::string::npos);
  // The header stays writable by the worker: geometry rewritten after the
  // attach (slots far outside the file, hidden 0, a huge response region)
  // changes nothing on the server, which keeps the copy it checked. A full
  // (max_tokens) call still lands where it should.
  const uint64_t slots_offset = h->slots_offset, slot_bytes = h->slot_bytes;
  h->slots_offset = 1ull << 40;
  h->num_slots = 4000;
  h->hidden = 0;
  h->resp_capacity = 1ull << 40;
  {
    auto rc = MakeRandomCall(*info, info->moe_layers[0], geo.max_tokens, 5);
    uint8_t* data = reinterpret_cast<uint8_t*>(slot) + 256;
    const uint64_t hb = rc.hidden.size() * 2, ib = rc.ids.size() * 4, wb = rc.weights.size() * 4;
    const uint64_t io = (hb + 63) / 64 * 64, wo = io + (ib + 63) / 64 * 64;
    std::memcpy(data, rc.hidden.data(), hb);
    std::memcpy(data + io, rc.ids.data(), ib);
    std::memcpy(data + wo, rc.weights.data(), wb);
    slot->layer = rc.layer;
    slot->tokens = rc.tokens;
    slot->top_k = rc.top_k;
    slot->hidden_off = 0;
    slot->hidden_bytes = hb;
    slot->ids_off = io;
    slot->ids_bytes = ib;
    slot->weights_off = wo;
    slot->weights_bytes = wb;
    slot->state.store(kSlotRequest);
    h->doorbell.fetch_add(1);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->doorbell), FUTEX_WAKE, 1, nullptr, nullptr,
            0);
    for (int i = 0; i < 400 && slot->state.load() != kSlotDone; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(slot->state.load(), kSlotDone);
    EXPECT_EQ(slot->code, 0) << std::string(slot->msg, slot->msg_len);
    EXPECT_EQ(slot->out_bytes, static_cast<uint64_t>(geo.max_tokens) * info->hidden * 4);
  }
  // Half-written second request, then the worker dies.
  auto* slot1 = reinterpret_cast<ShmSlot*>(base + slots_offset + slot_bytes);
  slot1->tokens = 3;
  ::kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t discarded = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3)) {
    auto st = control->Stats();
    ASSERT_TRUE(st.ok());
    discarded = st->shm_discarded;
    if (discarded == 1 && st->shm_sessions == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(discarded, 1u);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  // and the service no longer maps it (not kept until the next attach)
  EXPECT_EQ(service_maps().find("memfd:" + memfd_name), std::string::npos)
      << "the dead worker's segment is still mapped";
  munmap(base, geo.total_bytes());
  // Still serving a healthy worker.
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  po.transport = TransportKind::kShm;
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto call = MakeRandomCall(*info, info->moe_layers[0], 2, 3);
  std::vector<float> out(static_cast<size_t>(2 * info->hidden));
  EXPECT_TRUE((*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace hmoe
