// ExpertPoolOptions::metrics: per-shard call counts by outcome, latency of
// the calls sent, and the shard-up gauge, over every transport against two
// real service processes (tp split).
#include <signal.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::MakeRandomCall;
using ::hmoe::testing::ServiceProcess;
using ::hmoe::testing::TempDir;

// The value of `series` (name plus labels, as rendered) in the text; -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ')
      return std::stod(line.substr(series.size() + 1));
  return -1;
}

class PoolMetricsTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(PoolMetricsTest, CallsLatencyAndShardUpPerShard) {
  setenv("UCX_TLS", "tcp,sm,self", 0);
  const std::string model_dir = ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny";
  TempDir dir;
  ServiceProcess procs[2];
  ExpertPoolOptions po;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(procs[i].Start(
        {"--model-dir=" + model_dir, absl::StrCat("--shard=", i, "/2"), "--split=tp"},
        dir.file(absl::StrCat("port", i))));
    po.targets.push_back(procs[i].target());
  }
  MetricsRegistry reg;
  po.transport = GetParam();
  po.metrics = &reg;
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::string t = TransportKindName(GetParam());
  auto series = [&](const char* name, int shard, const std::string& more) {
    return absl::StrCat(name, "{transport=\"", t, "\",shard=\"", po.targets[shard], "\"", more,
                        "}");
  };
  auto calls = [&](const std::string& text, int shard, const char* outcome) {
    return Sample(
        text, series("hmoe_expert_calls_total", shard, absl::StrCat(",outcome=\"", outcome, "\"")));
  };
  auto up = [&](const std::string& text, int shard) {
    return Sample(text, absl::StrCat("hmoe_expert_shard_up{shard=\"", po.targets[shard], "\"}"));
  };

  std::string text = reg.RenderPrometheus();
  EXPECT_EQ(up(text, 0), 1);
  EXPECT_EQ(up(text, 1), 1);
  EXPECT_EQ(calls(text, 0, "ok"), 0);

  const ShardInfo info = (*pool)->model();
  auto call = MakeRandomCall(info, info.moe_layers[0], 8, 5);
  std::vector<float> out(static_cast<size_t>(8 * info.hidden));
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE((*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  // A deadline already passed: counted, not sent (no latency observed).
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      (*pool)->Run(call.call(), out.data(), absl::Now() - absl::Seconds(1))));
  text = reg.RenderPrometheus();
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(calls(text, s, "ok"), 3) << text;
    EXPECT_EQ(calls(text, s, "deadline_exceeded"), 1) << text;
    EXPECT_EQ(Sample(text, series("hmoe_expert_call_seconds_count", s, "")), 3) << text;
    EXPECT_GT(Sample(text, series("hmoe_expert_call_seconds_sum", s, "")), 0) << text;
    EXPECT_EQ(up(text, s), 1);
  }

  // Shard 1 hung: its part misses the deadline (sent, so timed); a health
  // check finds it down, and up again once it runs.
  procs[1].Signal(SIGSTOP);
  absl::Status st = (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  text = reg.RenderPrometheus();
  EXPECT_EQ(calls(text, 1, "deadline_exceeded"), 2) << text;
  EXPECT_EQ(calls(text, 0, "ok"), 4) << text;
  EXPECT_EQ(Sample(text, series("hmoe_expert_call_seconds_count", 1, "")), 4) << text;
  EXPECT_NE((*pool)->CheckHealth(absl::Milliseconds(200))[1], Health::kServing);
  text = reg.RenderPrometheus();
  EXPECT_EQ(up(text, 0), 1);
  EXPECT_EQ(up(text, 1), 0);
  procs[1].Signal(SIGCONT);
  EXPECT_EQ((*pool)->CheckHealth(absl::Seconds(5))[1], Health::kServing);
  EXPECT_EQ(up(reg.RenderPrometheus(), 1), 1);
  st = (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;

  // Shard 1 killed: its part fails UNAVAILABLE and it is down; shard 0 is not.
  procs[1].Kill(SIGKILL);
  st = (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  text = reg.RenderPrometheus();
  EXPECT_EQ(calls(text, 1, "unavailable"), 1) << text;
  EXPECT_EQ(calls(text, 1, "ok"), 4) << text;
  EXPECT_EQ(calls(text, 0, "ok"), 6) << text;
  EXPECT_EQ(up(text, 0), 1);
  EXPECT_EQ(up(text, 1), 0);
}

// Two pools on one registry (a worker that reconnects) share the series.
TEST(PoolMetrics, ARegistryOutlivesAndIsSharedByPools) {
  const std::string model_dir = ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny";
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + model_dir}, dir.file("port")));
  MetricsRegistry reg;
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  po.metrics = &reg;
  for (int i = 0; i < 2; ++i) {
    auto pool = ExpertPool::Connect(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    const ShardInfo info = (*pool)->model();
    auto call = MakeRandomCall(info, info.moe_layers[0], 2, 1);
    std::vector<float> out(static_cast<size_t>(2 * info.hidden));
    ASSERT_TRUE((*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10)).ok());
  }
  EXPECT_EQ(Sample(reg.RenderPrometheus(),
                   absl::StrCat("hmoe_expert_calls_total{transport=\"grpc\",shard=\"",
                                proc.target(), "\",outcome=\"ok\"}")),
            2);
}

INSTANTIATE_TEST_SUITE_P(Transports, PoolMetricsTest,
                         ::testing::Values(TransportKind::kGrpc, TransportKind::kShm,
                                           TransportKind::kUcx),
                         [](const ::testing::TestParamInfo<TransportKind>& p) {
                           return std::string(TransportKindName(p.param));
                         });

}  // namespace
}  // namespace hmoe
