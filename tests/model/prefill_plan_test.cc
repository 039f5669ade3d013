// Hybrid prefill's cost model (gpu_worker/driver/prefill_plan.h) on
// synthetic measurements: it picks the CPU, streaming or the split where
// each is fastest, the split lands near the two-sided bound, the GPU gets
// the experts with the most tokens, and bad rates are refused.
#include "gpu_worker/driver/prefill_plan.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "gpu_worker/routed_experts.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

constexpr int64_t kExpertBytes = 24 << 20;        // ~ds-v3 int4
constexpr double kFlops = 2.0 * 3 * 7168 * 2048;  // per token
PrefillRates Rates(double pcie_gbps, double cpu_us_at_256) {
  PrefillRates r;
  r.pcie_gbps = pcie_gbps;
  r.gpu_tflops = 400;
  r.cpu_tokens = {1, 16, 256};
  r.cpu_us = {200, 400, cpu_us_at_256};
  return r;
}

TEST(PrefillPlan, CpuTimeInterpolatesAndExtrapolates) {
  const PrefillRates r = Rates(50, 2000);
  EXPECT_EQ(r.CpuUs(0), 0);
  EXPECT_DOUBLE_EQ(r.CpuUs(1), 200);
  EXPECT_DOUBLE_EQ(r.CpuUs(8), 200 + 7.0 / 15.0 * 200);
  EXPECT_DOUBLE_EQ(r.CpuUs(16), 400);
  EXPECT_DOUBLE_EQ(r.CpuUs(136), 400 + 0.5 * 1600);
  EXPECT_DOUBLE_EQ(r.CpuUs(512), 4000);
}

// A token per expert over a slow link: one expert's upload (~8 ms at 3
// GB/s) costs more than the CPU's whole layer, so nothing moves. (Over
// 55.6 GB/s the same layer splits: streaming an expert, ~0.45 ms, beats
// the CPU's 0.2 ms per expert once the CPU's queue is longer than the
// GPU's; the next test's first half.)
TEST(PrefillPlan, FewTokensOverASlowLinkStayOnTheCpu) {
  std::vector<int64_t> tokens(256, 0);
  for (int e = 0; e < 32; ++e) tokens[static_cast<size_t>(e * 4)] = 1;
  auto p = PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, Rates(3, 2000));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kCpu) << p->Describe();
  EXPECT_TRUE(p->gpu_experts.empty());
  EXPECT_DOUBLE_EQ(p->cpu_us, 32 * 200.0);
  EXPECT_EQ(p->gpu_us, 0);
  auto fast = PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, Rates(55.6, 2000));
  ASSERT_TRUE(fast.ok()) << fast.status();
  EXPECT_EQ(fast->choice, PrefillChoice::kSplit) << fast->Describe();
  EXPECT_LT(fast->us, p->us);
}

TEST(PrefillPlan, ManyTokensAndASlowCpuStreamEverything) {
  const std::vector<int64_t> tokens(8, 256);
  auto p = PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, Rates(55.6, 20000));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kStream) << p->Describe();
  EXPECT_EQ(p->gpu_experts.size(), 8u);
  EXPECT_EQ(p->cpu_us, 0);
  const double upload = kExpertBytes / 55.6e3;
  EXPECT_NEAR(p->gpu_us, 8 * upload, 1e-6);  // upload-bound, not compute-bound
  EXPECT_DOUBLE_EQ(p->us, p->gpu_us);
}

TEST(PrefillPlan, BalancedSidesSplitNearTheTwoSidedBound) {
  const std::vector<int64_t> tokens(8, 256);
  const PrefillRates r = Rates(55.6, 2000);
  auto p = PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kSplit) << p->Describe();
  ASSERT_GT(p->gpu_experts.size(), 0u);
  ASSERT_LT(p->gpu_experts.size(), 8u);
  const double upload = kExpertBytes / 55.6e3, cpu = 2000;
  // Faster than either side alone, and within one expert of the bound
  // 1 / (1 / t_stream + 1 / t_cpu) that a continuous split would reach.
  const double t_stream = 8 * upload, t_cpu = 8 * cpu;
  EXPECT_LT(p->us, std::min(t_stream, t_cpu));
  const double bound = 1 / (1 / t_stream + 1 / t_cpu);
  EXPECT_GE(p->us, bound - 1e-6);
  EXPECT_LE(p->us, bound + std::max(upload, cpu));
  EXPECT_DOUBLE_EQ(p->us, std::max(p->cpu_us, p->gpu_us));
}

// The service's cost per pass token of a call at all: paid by the CPU and
// the split, not by streaming; large enough, it turns the balanced split
// into streaming everything.
TEST(PrefillPlan, ACallsCostPerTokenIsPaidByTheCpuSideOnly) {
  const std::vector<int64_t> tokens(8, 256);  // 256 tokens of k = 8
  PrefillRates r = Rates(55.6, 2000);
  r.cpu_call_us_per_token = 1;
  auto p = PlanPrefillLayer(tokens, 256, kExpertBytes, kFlops, r);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->choice, PrefillChoice::kSplit) << p->Describe();
  const double cpu_experts = static_cast<double>(8 - p->gpu_experts.size());
  EXPECT_DOUBLE_EQ(p->cpu_us, 256 * 1.0 + cpu_experts * 2000);
  r.cpu_call_us_per_token = 20;  // 5.1 ms: more than streaming all (3.6 ms)
  p = PlanPrefillLayer(tokens, 256, kExpertBytes, kFlops, r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kStream) << p->Describe();
  EXPECT_EQ(p->cpu_us, 0);
  // Over a slow link the CPU keeps the layer and pays for the call.
  std::vector<int64_t> few(256, 0);
  for (int e = 0; e < 32; ++e) few[static_cast<size_t>(e * 4)] = 1;
  r = Rates(3, 2000);
  r.cpu_call_us_per_token = 2;
  p = PlanPrefillLayer(few, 4, kExpertBytes, kFlops, r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kCpu) << p->Describe();
  EXPECT_DOUBLE_EQ(p->cpu_us, 4 * 2.0 + 32 * 200.0);
  r.cpu_call_us_per_token = -1;
  EXPECT_EQ(PlanPrefillLayer(few, 4, kExpertBytes, kFlops, r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PrefillPlan, TheGpuTakesTheExpertsWithTheMostTokens) {
  std::vector<int64_t> tokens = {3, 900, 1, 0, 700, 5, 700, 2};
  auto p = PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, Rates(55.6, 2000));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->choice, PrefillChoice::kSplit) << p->Describe();
  // The top ones by count, ties to the lower id: 1, then 4 and 6.
  std::vector<int32_t> want = {1, 4, 6};
  want.resize(std::min(want.size(), p->gpu_experts.size()));
  std::vector<int32_t> got = p->gpu_experts;
  got.resize(want.size());
  EXPECT_EQ(got, want);
  for (int32_t e : p->gpu_experts) EXPECT_NE(tokens[static_cast<size_t>(e)], 0) << e;
  EXPECT_FALSE(p->Describe().empty());
}

TEST(PrefillPlan, NoTokensCostNothing) {
  auto p =
      PlanPrefillLayer(std::vector<int64_t>(16, 0), 0, kExpertBytes, kFlops, Rates(55.6, 2000));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->choice, PrefillChoice::kCpu);
  EXPECT_EQ(p->us, 0);
}

TEST(PrefillPlan, RefusesBadRates) {
  const std::vector<int64_t> tokens(8, 16);
  PrefillRates r = Rates(0, 2000);
  EXPECT_EQ(PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r = Rates(50, 2000);
  r.cpu_tokens = {16, 1, 256};
  EXPECT_EQ(PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, r).status().code(),
            absl::StatusCode::kInvalidArgument);
  r = Rates(50, 2000);
  r.cpu_us.pop_back();
  EXPECT_EQ(PlanPrefillLayer(tokens, 0, kExpertBytes, kFlops, r).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPrefillLayer(tokens, 0, 0, kFlops, Rates(50, 2000)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Records each call: tokens per expert, and answers `fail` once set.
class CountingExperts : public RoutedExperts {
 public:
  absl::Status Forward(const ExpertBatch& b, float* out) override {
    if (!fail.ok()) return fail;
    std::map<int32_t, int64_t> per;
    for (int64_t s = 0; s < b.num_tokens * b.top_k; ++s) ++per[b.expert_ids[s]];
    calls.push_back(per);
    layers.push_back(b.layer);
    std::fill(out, out + b.num_tokens * b.hidden_size, 0.0f);
    return absl::OkStatus();
  }
  std::vector<std::map<int32_t, int64_t>> calls;
  std::vector<int> layers;
  absl::Status fail = absl::OkStatus();
};

TEST(PrefillPlan, MeasureExpertRatesGivesEveryExpertNTokens) {
  auto config = LoadModelConfig(testing::ModelFixturesRoot() + "/qwen3_moe_tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  int moe = -1;
  for (int l = 0; l < config->num_layers && moe < 0; ++l)
    if (config->layers[static_cast<size_t>(l)].moe) moe = l;
  ASSERT_GE(moe, 0);
  CountingExperts x;
  PrefillRates r;
  ASSERT_TRUE(MeasureExpertRates(x, *config, moe, {4, 32}, &r).ok());
  ASSERT_EQ(x.calls.size(), 4u) << "a warm-up, one call per point, one with a single token routed";
  EXPECT_EQ(r.cpu_tokens, (std::vector<int64_t>{4, 32}));
  ASSERT_EQ(r.cpu_us.size(), 2u);
  for (double us : r.cpu_us) EXPECT_GT(us, 0);
  const int64_t E = config->moe.num_experts;
  for (size_t c = 1; c < 3; ++c) {
    const int64_t n = c == 1 ? 4 : 32;
    EXPECT_EQ(static_cast<int64_t>(x.calls[c].size()), E);
    for (const auto& [e, count] : x.calls[c]) {
      EXPECT_TRUE(e >= 0 && e < E) << e;
      // n * E / k tokens rounded up: each expert n tokens, a few one more.
      EXPECT_GE(count, n) << "expert " << e;
      EXPECT_LE(count, n + 1) << "expert " << e;
    }
    EXPECT_EQ(x.layers[c], moe);
  }
  // The call cost's measurement: token 0's k slots only.
  const int64_t K = config->moe.experts_per_token;
  int64_t routed = 0;
  for (const auto& [e, count] : x.calls[3])
    if (e >= 0) routed += count;
  EXPECT_EQ(routed, K);
  EXPECT_GE(r.cpu_call_us_per_token, 0);
  // Errors: a dense layer, a bad list, the experts' own failure.
  EXPECT_EQ(MeasureExpertRates(x, *config, -1, {4}, &r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureExpertRates(x, *config, moe, {}, &r).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureExpertRates(x, *config, moe, {8, 8}, &r).code(),
            absl::StatusCode::kInvalidArgument);
  x.fail = absl::UnavailableError("service gone");
  EXPECT_EQ(MeasureExpertRates(x, *config, moe, {4}, &r).code(), absl::StatusCode::kUnavailable);
}

TEST(PrefillPlan, RatesJsonRoundTripsAndBadFilesAreNamed) {
  PrefillRates r = Rates(55.5, 2000);
  r.cpu_call_us_per_token = 1.5;
  auto back = ParsePrefillRates(PrefillRatesJson(r), "rates.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->pcie_gbps, r.pcie_gbps);
  EXPECT_EQ(back->gpu_tflops, r.gpu_tflops);
  EXPECT_EQ(back->cpu_tokens, r.cpu_tokens);
  EXPECT_EQ(back->cpu_us, r.cpu_us);
  EXPECT_EQ(back->cpu_call_us_per_token, r.cpu_call_us_per_token);
  struct Bad {
    std::string text, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"[1]", "not a JSON object"},
           {R"({"format": "hmoe-routing-stats-1"})", "format"},
           {R"({"format": "hmoe-prefill-rates-1", "gpu_tflops": 1, "cpu": []})", "pcie_gbps"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "gpu_tflops": 400, "cpu": 3})",
            "cpu: an array"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "gpu_tflops": 400,
                "cpu": [{"tokens": 1.5, "us": 2}]})",
            "cpu[]"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "gpu_tflops": 400,
                "cpu": [{"tokens": 16, "us": 2}, {"tokens": 8, "us": 3}]})",
            "not positive or not ascending"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 0, "gpu_tflops": 400,
                "cpu": [{"tokens": 16, "us": 2}]})",
            "must be > 0"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "gpu_tflops": 400,
                "cpu": [{"tokens": 16, "us": 2}], "cpu_call_us_per_token": "x"})",
            "cpu_call_us_per_token: a number"},
           {R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "gpu_tflops": 400,
                "cpu": [{"tokens": 16, "us": 2}], "cpu_call_us_per_token": -2})",
            "must be >= 0"},
       }) {
    auto p = ParsePrefillRates(b.text, "rates.json");
    ASSERT_FALSE(p.ok()) << b.text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << b.text;
    EXPECT_NE(p.status().message().find("rates.json"), std::string::npos) << p.status();
    EXPECT_NE(p.status().message().find(b.says), std::string::npos) << p.status();
  }
}

}  // namespace
}  // namespace hmoe
