#include "common/metrics.h"

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

TEST(Metrics, CountersAndGaugesRenderExactly) {
  MetricsRegistry reg;
  auto reqs = reg.AddCounterFamily("hmoe_requests_total", "Requests by outcome.", {"outcome"});
  ASSERT_TRUE(reqs.ok()) << reqs.status();
  Counter* stop = *reqs->WithLabels({"stop"});
  Counter* length = *reqs->WithLabels({"length"});
  stop->Increment();
  stop->Increment(2);
  length->Increment(0.5);
  length->Increment(-7);  // ignored: counters only go up
  Gauge* waiting = *reg.AddGauge("hmoe_waiting", "Queued requests.");
  waiting->Set(4);
  waiting->Add(-1.25);
  Counter* plain = *reg.AddCounter("hmoe_a_total", "First by name.");
  plain->Increment(1234567890123);
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_a_total First by name.\n"
            "# TYPE hmoe_a_total counter\n"
            "hmoe_a_total 1234567890123\n"
            "# HELP hmoe_requests_total Requests by outcome.\n"
            "# TYPE hmoe_requests_total counter\n"
            "hmoe_requests_total{outcome=\"length\"} 0.5\n"
            "hmoe_requests_total{outcome=\"stop\"} 3\n"
            "# HELP hmoe_waiting Queued requests.\n"
            "# TYPE hmoe_waiting gauge\n"
            "hmoe_waiting 2.75\n");
  // The same child again is the same object.
  EXPECT_EQ(*reqs->WithLabels({"stop"}), stop);
}

TEST(Metrics, HistogramBucketsAreCumulativeWithInf) {
  MetricsRegistry reg;
  auto h =
      reg.AddHistogramFamily("hmoe_latency_seconds", "Latency.", {0.005, 0.1, 1, 2.5}, {"shard"});
  ASSERT_TRUE(h.ok()) << h.status();
  Histogram* a = *h->WithLabels({"a:1"});
  for (double v : {0.001, 0.005, 0.05, 0.1, 3.0, 100.0}) a->Observe(v);
  Histogram* b = *h->WithLabels({"b:2"});
  (void)b;
  Histogram* plain = *reg.AddHistogram("hmoe_plain_seconds", "No labels.", {1.0, INFINITY});
  plain->Observe(0.25);
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_latency_seconds Latency.\n"
            "# TYPE hmoe_latency_seconds histogram\n"
            "hmoe_latency_seconds_bucket{shard=\"a:1\",le=\"0.005\"} 2\n"
            "hmoe_latency_seconds_bucket{shard=\"a:1\",le=\"0.1\"} 4\n"
            "hmoe_latency_seconds_bucket{shard=\"a:1\",le=\"1\"} 4\n"
            "hmoe_latency_seconds_bucket{shard=\"a:1\",le=\"2.5\"} 4\n"
            "hmoe_latency_seconds_bucket{shard=\"a:1\",le=\"+Inf\"} 6\n"
            "hmoe_latency_seconds_sum{shard=\"a:1\"} 103.156\n"
            "hmoe_latency_seconds_count{shard=\"a:1\"} 6\n"
            "hmoe_latency_seconds_bucket{shard=\"b:2\",le=\"0.005\"} 0\n"
            "hmoe_latency_seconds_bucket{shard=\"b:2\",le=\"0.1\"} 0\n"
            "hmoe_latency_seconds_bucket{shard=\"b:2\",le=\"1\"} 0\n"
            "hmoe_latency_seconds_bucket{shard=\"b:2\",le=\"2.5\"} 0\n"
            "hmoe_latency_seconds_bucket{shard=\"b:2\",le=\"+Inf\"} 0\n"
            "hmoe_latency_seconds_sum{shard=\"b:2\"} 0\n"
            "hmoe_latency_seconds_count{shard=\"b:2\"} 0\n"
            "# HELP hmoe_plain_seconds No labels.\n"
            "# TYPE hmoe_plain_seconds histogram\n"
            "hmoe_plain_seconds_bucket{le=\"1\"} 1\n"
            "hmoe_plain_seconds_bucket{le=\"+Inf\"} 1\n"
            "hmoe_plain_seconds_sum 0.25\n"
            "hmoe_plain_seconds_count 1\n");
  const Histogram::Snapshot s = a->snapshot();
  EXPECT_EQ(s.count, 6u);
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 4, 4, 4, 6}));
}

TEST(Metrics, LabelValuesAndHelpAreEscaped) {
  MetricsRegistry reg;
  auto f = reg.AddGaugeFamily("hmoe_escape", "Help with \\ backslash\nand \"quotes\".",
                              {"path", "other"});
  ASSERT_TRUE(f.ok()) << f.status();
  (*f->WithLabels({"C:\\dir\n\"x\"", ""}))->Set(1);
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_escape Help with \\\\ backslash\\nand \"quotes\".\n"
            "# TYPE hmoe_escape gauge\n"
            "hmoe_escape{path=\"C:\\\\dir\\n\\\"x\\\"\",other=\"\"} 1\n");
}

TEST(Metrics, SpecialValuesRenderAsPrometheusDoes) {
  MetricsRegistry reg;
  auto f = reg.AddGaugeFamily("hmoe_values", "Values.", {"v"});
  ASSERT_TRUE(f.ok());
  (*f->WithLabels({"a_nan"}))->Set(NAN);
  (*f->WithLabels({"b_pinf"}))->Set(INFINITY);
  (*f->WithLabels({"c_ninf"}))->Set(-INFINITY);
  (*f->WithLabels({"d_big"}))->Set(1e20);
  (*f->WithLabels({"e_small"}))->Set(1e-7);
  (*f->WithLabels({"f_neg"}))->Set(-3);
  (*f->WithLabels({"g_third"}))->Set(1.0 / 3);
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_values Values.\n"
            "# TYPE hmoe_values gauge\n"
            "hmoe_values{v=\"a_nan\"} NaN\n"
            "hmoe_values{v=\"b_pinf\"} +Inf\n"
            "hmoe_values{v=\"c_ninf\"} -Inf\n"
            "hmoe_values{v=\"d_big\"} 1e+20\n"
            "hmoe_values{v=\"e_small\"} 1e-07\n"
            "hmoe_values{v=\"f_neg\"} -3\n"
            "hmoe_values{v=\"g_third\"} 0.3333333333333333\n");
}

TEST(Metrics, CallbackGaugesAreSampledAtRenderUntilTheirHandleGoes) {
  MetricsRegistry reg;
  double kv = 7;
  auto used = reg.AddCallbackGauge("hmoe_kv_blocks", "KV blocks.", {"state"}, {"used"},
                                   [&kv] { return kv; });
  ASSERT_TRUE(used.ok()) << used.status();
  auto fam = reg.AddGaugeFamily("hmoe_kv_blocks", "KV blocks.", {"state"});
  ASSERT_TRUE(fam.ok()) << fam.status();
  (*fam->WithLabels({"total"}))->Set(64);
  // A plain gauge cannot take a callback's place, nor a second callback.
  EXPECT_EQ(fam->WithLabels({"used"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      reg.AddCallbackGauge("hmoe_kv_blocks", "KV blocks.", {"state"}, {"used"}, [] { return 0.0; })
          .status()
          .code(),
      absl::StatusCode::kAlreadyExists);
  kv = 9;
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_kv_blocks KV blocks.\n"
            "# TYPE hmoe_kv_blocks gauge\n"
            "hmoe_kv_blocks{state=\"total\"} 64\n"
            "hmoe_kv_blocks{state=\"used\"} 9\n");
  used->reset();
  EXPECT_EQ(reg.RenderPrometheus(),
            "# HELP hmoe_kv_blocks KV blocks.\n"
            "# TYPE hmoe_kv_blocks gauge\n"
            "hmoe_kv_blocks{state=\"total\"} 64\n");
  // Its label values are free again.
  EXPECT_TRUE(
      reg.AddCallbackGauge("hmoe_kv_blocks", "KV blocks.", {"state"}, {"used"}, [] { return 1.0; })
          .ok());
}

TEST(Metrics, RegistrationIsCheckedAndIdempotent) {
  MetricsRegistry reg;
  auto code = [](const auto& s) { return s.status().code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(reg.AddCounter("hmoe_requests", "no _total")), kInvalid);
  EXPECT_EQ(code(reg.AddGauge("hmoe_gauge_total", "a gauge named like a counter")), kInvalid);
  EXPECT_EQ(code(reg.AddGauge("9lives", "")), kInvalid);
  EXPECT_EQ(code(reg.AddGauge("has-dash", "")), kInvalid);
  EXPECT_EQ(code(reg.AddGaugeFamily("hmoe_g", "", {"__reserved"})), kInvalid);
  EXPECT_EQ(code(reg.AddGaugeFamily("hmoe_g", "", {"a", "a"})), kInvalid);
  EXPECT_EQ(code(reg.AddGaugeFamily("hmoe_g", "", {"bad label"})), kInvalid);
  EXPECT_EQ(code(reg.AddHistogramFamily("hmoe_h", "", {1}, {"le"})), kInvalid);
  EXPECT_EQ(code(reg.AddHistogram("hmoe_h", "", {2, 1})), kInvalid);
  EXPECT_EQ(code(reg.AddHistogram("hmoe_h", "", {1, 1})), kInvalid);
  EXPECT_EQ(code(reg.AddHistogram("hmoe_h", "", {NAN})), kInvalid);
  EXPECT_EQ(code(reg.AddCallbackGauge("hmoe_cb", "", {}, {}, nullptr)), kInvalid);
  EXPECT_EQ(code(reg.AddCallbackGauge("hmoe_cb", "", {"a"}, {}, [] { return 0.0; })), kInvalid);
  EXPECT_EQ(reg.RenderPrometheus(), "");  // nothing was registered

  auto c1 = reg.AddCounterFamily("hmoe_calls_total", "Calls.", {"shard"});
  auto c2 = reg.AddCounterFamily("hmoe_calls_total", "Calls.", {"shard"});
  ASSERT_TRUE(c1.ok() && c2.ok());
  EXPECT_EQ(*c1->WithLabels({"x"}), *c2->WithLabels({"x"}));
  EXPECT_EQ(code(c1->WithLabels({})), kInvalid);
  EXPECT_EQ(code(c1->WithLabels({"x", "y"})), kInvalid);
  const auto kExists = absl::StatusCode::kAlreadyExists;
  EXPECT_EQ(code(reg.AddCounterFamily("hmoe_calls_total", "Other help.", {"shard"})), kExists);
  EXPECT_EQ(code(reg.AddCounterFamily("hmoe_calls_total", "Calls.", {"target"})), kExists);
  EXPECT_EQ(code(reg.AddHistogram("hmoe_t", "", {1})), absl::StatusCode::kOk);
  EXPECT_EQ(code(reg.AddHistogram("hmoe_t", "", {1, 2})), kExists);
  EXPECT_EQ(code(reg.AddGauge("hmoe_t", "")), kExists);
}

TEST(Metrics, ExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(0.001, 2, 4), (std::vector<double>{0.001, 0.002, 0.004, 0.008}));
  EXPECT_TRUE(ExponentialBuckets(0, 2, 4).empty());
  EXPECT_TRUE(ExponentialBuckets(1, 1, 4).empty());
}

// Increments from several threads, children looked up concurrently, sum exactly.
TEST(Metrics, ConcurrentUpdatesSumExactly) {
  MetricsRegistry reg;
  auto fam = *reg.AddCounterFamily("hmoe_ops_total", "Ops.", {"thread_group"});
  Counter* shared = *reg.AddCounter("hmoe_shared_total", "Shared.");
  Gauge* gauge = *reg.AddGauge("hmoe_level", "Level.");
  Histogram* hist = *reg.AddHistogram("hmoe_obs_seconds", "Obs.", {0.5, 1.5});
  constexpr int kThreads = 8, kIters = 50000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter* mine = *fam.WithLabels({t % 2 ? "odd" : "even"});
      for (int i = 0; i < kIters; ++i) {
        shared->Increment();
        mine->Increment(2);
        gauge->Add(1);
        gauge->Add(-1);
        hist->Observe(i % 2);                             // 0 or 1
        if (i % 5000 == 0) (void)reg.RenderPrometheus();  // a scrape meanwhile
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(shared->value(), double{kThreads} * kIters);
  EXPECT_EQ((*fam.WithLabels({"odd"}))->value(), 2.0 * kThreads / 2 * kIters);
  EXPECT_EQ((*fam.WithLabels({"even"}))->value(), 2.0 * kThreads / 2 * kIters);
  EXPECT_EQ(gauge->value(), 0);
  const Histogram::Snapshot s = hist->snapshot();
  EXPECT_EQ(s.count, uint64_t{kThreads} * kIters);
  EXPECT_EQ(s.cumulative[0], uint64_t{kThreads} * kIters / 2);
  EXPECT_EQ(s.sum, double{kThreads} * kIters / 2);
  EXPECT_THAT(reg.RenderPrometheus(), HasSubstr("hmoe_shared_total 400000\n"));
}

// Prometheus' own checker (Debian's `prometheus` package) accepts the text,
// lint included.
TEST(Metrics, PromtoolAcceptsARenderedRegistry) {
  const char* promtool = "/usr/bin/promtool";
  if (access(promtool, X_OK) != 0)
    GTEST_SKIP()
        << "promtool not installed (apt-get install prometheus; deploy/install-deps.sh --tests)";
  MetricsRegistry reg;
  auto outcome =
      *reg.AddCounterFamily("hmoe_requests_finished_total", "Requests by outcome.", {"outcome"});
  (*outcome.WithLabels({"stop"}))->Increment(3);
  (*outcome.WithLabels({"error"}))->Increment();
  *reg.AddCounterFamily("hmoe_unused_total", "A family with no children yet.", {"x"});
  (*reg.AddGauge("hmoe_requests_waiting", "Waiting."))->Set(2);
  auto hist = *reg.AddHistogramFamily("hmoe_expert_call_seconds", "Expert call latency.",
                                      ExponentialBuckets(0.0005, 2, 12), {"transport", "shard"});
  Histogram* h = *hist.WithLabels({"shm", "10.0.0.1:50051"});
  for (double v : {0.001, 0.002, 0.5, 9.0}) h->Observe(v);
  auto esc = *reg.AddGaugeFamily("hmoe_escaped", "Odd \\ help\nline.", {"v"});
  (*esc.WithLabels({"a\"b\\c\nd"}))->Set(NAN);
  auto cb =
      reg.AddCallbackGauge("hmoe_kv_blocks_used", "KV blocks in use.", {}, {}, [] { return 12.0; });
  ASSERT_TRUE(cb.ok());

  ::hmoe::testing::TempDir dir;
  const std::string in = dir.file("metrics.txt"), out = dir.file("promtool.out");
  {
    std::ofstream f(in);
    f << reg.RenderPrometheus();
  }
  const std::string cmd = absl::StrCat(promtool, " check metrics < '", in, "' > '", out, "' 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream o(out);
  const std::string said((std::istreambuf_iterator<char>(o)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(rc)) << cmd;
  EXPECT_EQ(WEXITSTATUS(rc), 0) << said << "\n--- input:\n" << reg.RenderPrometheus();
}

}  // namespace
}  // namespace hmoe
