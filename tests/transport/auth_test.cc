// The expert service's token (--auth-token-file) and peer cap (--max-peers),
// as real processes on loopback, over every transport.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::FileSays;
using ::hmoe::testing::MakeRandomCall;
using ::hmoe::testing::ServiceProcess;
using ::hmoe::testing::TempDir;
using ::testing::HasSubstr;

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }

constexpr char kToken[] = "expert-plane-token/0123456789+abc";

std::string WriteToken(const TempDir& dir, const std::string& token) {
  const std::string path = dir.file("token");
  std::ofstream(path) << token << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

// One call of 3 tokens through `pool`.
absl::Status RunOne(ExpertPool& pool, uint64_t seed) {
  const ShardInfo& info = pool.model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 3, seed);
  std::vector<float> out(static_cast<size_t>(3 * info.hidden));
  return pool.Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
}

class AuthTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override { setenv("UCX_TLS", "tcp,sm,self", 0); }
  ExpertPoolOptions Options(const ServiceProcess& proc, std::string token) const {
    ExpertPoolOptions po;
    po.targets = {proc.target()};
    po.transport = GetParam();
    po.connect_timeout = absl::Seconds(30);
    if (!token.empty())
      po.auth_tokens = std::make_shared<AuthTokens>(std::vector<std::string>{std::move(token)});
    return po;
  }
};

TEST_P(AuthTest, EveryCallNeedsTheServicesToken) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + ModelDir(), "--auth-token-file=" + WriteToken(dir, kToken)},
                 dir.file("port")));
  {
    SCOPED_TRACE("no token");
    const absl::Time t0 = absl::Now();
    auto pool = ExpertPool::Connect(Options(proc, ""));
    ASSERT_FALSE(pool.ok());
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kUnauthenticated) << pool.status();
    EXPECT_THAT(pool.status().message(), HasSubstr("expert shard " + proc.target()));
    EXPECT_THAT(pool.status().message(), HasSubstr("sent none"));
    EXPECT_THAT(pool.status().message(), HasSubstr("--expert-auth-token-file"));
    // Refused at once, not retried until the 30 s connect timeout.
    EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  }
  {
    SCOPED_TRACE("wrong token");
    auto pool = ExpertPool::Connect(Options(proc, "expert-plane-token/0123456789+abd"));
    ASSERT_FALSE(pool.ok());
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kUnauthenticated) << pool.status();
    EXPECT_THAT(pool.status().message(), HasSubstr("does not match"));
  }
  {
    SCOPED_TRACE("the token");
    auto pool = ExpertPool::Connect(Options(proc, kToken));
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_TRUE(RunOne(**pool, 1).ok());
    EXPECT_TRUE(RunOne(**pool, 2).ok());
  }
  // Without the token: health answers, nothing else does; the gRPC data
  // plane refuses its stream with the service's code.
  ControlClient anon(MakeExpertChannel(proc.target()));
  EXPECT_EQ(anon.Check(), Health::kServing);
  // The services' own names answer too (they were NOT_FOUND).
  EXPECT_EQ(anon.Check("hmoe.expert.v1.ExpertControl"), Health::kServing);
  EXPECT_EQ(anon.Check("hmoe.expert.v1.ExpertData"), Health::kServing);
  EXPECT_EQ(anon.Check("hmoe.expert.v1.NoSuchService"), Health::kNotServing);
  EXPECT_EQ(anon.Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anon.AttachShm("/proc/self/fd/0", 1, 1).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anon.UcxConnect("x", 1).status().code(), absl::StatusCode::kUnauthenticated);
  ControlClient admitted(MakeExpertChannel(proc.target(), kToken));
  auto info = admitted.Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  GrpcStreamClient stream(MakeExpertChannel(proc.target()), info->hidden);
  auto call = MakeRandomCall(*info, info->moe_layers[0], 2, 3);
  std::vector<float> out(static_cast<size_t>(2 * info->hidden));
  auto h = stream.Submit(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(h.ok()) << h.status();
  const absl::Status st = stream.Wait(*h, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  // The service counted the two authorized calls only.
  auto stats = admitted.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->requests, 2u);

  // The service comes back with another token: once the pool's calls are
  // refused for it, grpc.health.v1 still says SERVING, but the pool's health
  // (what the worker reports) says it is not.
  auto pool = ExpertPool::Connect(Options(proc, kToken));
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->CheckHealth(), std::vector<Health>{Health::kServing});
  proc.Kill(SIGTERM);
  WriteToken(dir, "expert-plane-token/rotated-0123456789");
  ASSERT_TRUE(proc.Restart());
  absl::Status refused;
  for (int i = 0; i < 100 && !absl::IsUnauthenticated(refused); ++i) {
    refused = RunOne(**pool, 4);  // UNAVAILABLE until the transport reconnects
    if (!absl::IsUnauthenticated(refused))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  EXPECT_EQ(anon.Check(), Health::kServing);
  EXPECT_EQ((*pool)->CheckHealth(), std::vector<Health>{Health::kNotServing});
  EXPECT_EQ((*pool)->ShardsUp(), std::vector<bool>{false});
}

TEST_P(AuthTest, PeersOverTheCapAreRefusedAndTheOthersServe) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--max-peers=2"}, dir.file("port")));
  std::vector<std::unique_ptr<ExpertPool>> pools;
  for (int i = 0; i < 2; ++i) {
    auto p = ExpertPool::Connect(Options(proc, ""));
    ASSERT_TRUE(p.ok()) << p.status();
    pools.push_back(std::move(*p));
    ASSERT_TRUE(RunOne(*pools.back(), 10 + i).ok());  // its stream / segment / endpoint is up
  }
  // The third: refused at set-up (shm, UCX) or when its stream opens (gRPC).
  auto third = ExpertPool::Connect(Options(proc, ""));
  const absl::Status st = third.ok() ? RunOne(**third, 20) : third.status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(st.message(), HasSubstr("the service's cap (2, --max-peers)"));
  for (auto& p : pools) EXPECT_TRUE(RunOne(*p, 30).ok());

  if (GetParam() == TransportKind::kGrpc) {
    // A stream that ends frees its place: the third's next call (on a new
    // stream) is taken once the service has seen the first's stream close.
    pools.erase(pools.begin());
    absl::Status later;
    for (int i = 0; i < 100; ++i) {
      later = RunOne(**third, 40);
      if (later.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_TRUE(later.ok()) << later;
  }
}

// A token rotates on a running service: SIGHUP re-reads the file; while it
// lists both tokens both are accepted, then only the new one; a file that
// fails its checks leaves the tokens in force and the service serving.
TEST_P(AuthTest, SighupRotatesTheTokenWithoutARestart) {
  TempDir dir;
  ServiceProcess proc;
  const std::string log = dir.file("log");
  proc.set_stderr_file(log);
  const std::string path = WriteToken(dir, kToken);
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + ModelDir(), "--auth-token-file=" + path}, dir.file("port")));
  const std::string rotated = "expert-plane-token/rotated-0123456789";
  auto old_pool = ExpertPool::Connect(Options(proc, kToken));
  ASSERT_TRUE(old_pool.ok()) << old_pool.status();
  ASSERT_TRUE(RunOne(**old_pool, 1).ok());
  EXPECT_EQ(ExpertPool::Connect(Options(proc, rotated)).status().code(),
            absl::StatusCode::kUnauthenticated);

  WriteToken(dir, rotated + "\n" + kToken);
  proc.Signal(SIGHUP);
  ASSERT_TRUE(FileSays(log, "reloaded: 2 token(s)"));
  for (const std::string& t : {rotated, std::string(kToken)}) {
    auto pool = ExpertPool::Connect(Options(proc, t));
    ASSERT_TRUE(pool.ok()) << t << ": " << pool.status();
    EXPECT_TRUE(RunOne(**pool, 2).ok()) << t;
  }
  EXPECT_TRUE(RunOne(**old_pool, 3).ok());

  WriteToken(dir, rotated);
  proc.Signal(SIGHUP);
  ASSERT_TRUE(FileSays(log, "reloaded: 1 token(s)"));
  auto refused = ExpertPool::Connect(Options(proc, kToken));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  auto pool = ExpertPool::Connect(Options(proc, rotated));
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE(RunOne(**pool, 4).ok());
  // A pool still sending the dropped token: its health says so.
  EXPECT_EQ((*old_pool)->CheckHealth(), std::vector<Health>{Health::kNotServing});
  EXPECT_EQ((*pool)->CheckHealth(), std::vector<Health>{Health::kServing});

  ::chmod(path.c_str(), 0644);
  proc.Signal(SIGHUP);
  ASSERT_TRUE(FileSays(log, "kept the tokens in force: auth token file " + path + ": mode 0644"));
  ::chmod(path.c_str(), 0600);
  EXPECT_TRUE(RunOne(**pool, 5).ok());
  auto again = ExpertPool::Connect(Options(proc, rotated));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(RunOne(**again, 6).ok());
  EXPECT_EQ(ExpertPool::Connect(Options(proc, kToken)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthService, ABadTokenFileOrCapStopsTheServiceAtStart) {
  TempDir dir;
  const std::string open_file = dir.file("open");
  std::ofstream(open_file) << kToken << "\n";
  ::chmod(open_file.c_str(), 0644);
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--model-dir=" + ModelDir(), "--auth-token-file=" + open_file},
        std::vector<std::string>{"--model-dir=" + ModelDir(),
                                 "--auth-token-file=" + dir.file("missing")},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--max-peers=0"}}) {
    ServiceProcess proc;
    EXPECT_FALSE(proc.Start(args, dir.file("port"))) << args.back();
    EXPECT_TRUE(WIFEXITED(proc.exit_status()) && WEXITSTATUS(proc.exit_status()) == 2)
        << args.back() << ": " << proc.exit_status();
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, AuthTest,
                         ::testing::Values(TransportKind::kGrpc, TransportKind::kShm,
                                           TransportKind::kUcx),
                         [](const auto& p) { return std::string(TransportKindName(p.param)); });

}  // namespace
}  // namespace hmoe
