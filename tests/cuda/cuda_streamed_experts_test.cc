// Hybrid prefill on the cuda backend (CudaOptions::prefill_experts): a
// 48-token prefill (over the slots' 32, so the large-pass path) with every
// MoE layer's routed experts streamed to the GPU ("stream") or placed by the
// cost model ("auto", which measures the in-process experts first), against
// the same model with them on the experts ("cpu"), on every fixture, with
// the streamed copies in bf16, int8 and int4; then decode steps on the same
// sequence (its KV cache came from the streamed pass). "stream" streams
// every slot of every MoE layer; "auto" streams
// what its per-layer choices say. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/experts/weight_format.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

using testing::ModelFixturesRoot;

struct Out {
  std::vector<std::vector<float>> logits;
  ModelStats stats;
};

Out Generate(const std::string& dir, const std::string& policy, const std::string& fmt) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.cuda.prefill_experts = *ParsePrefillExperts(policy);
  o.cuda.hot_format = *ParseWeightFormat(fmt);
  o.cuda.hot_group = 32;
  auto m = Model::Load(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
  Out r;
  if (!m.ok()) return r;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 48; ++i) prompt.push_back((7 * i + 3) % 50);
  r.logits = testing::PrefillThenDecode(**m, prompt, 3);
  r.stats = (*m)->stats();
  return r;
}

class CudaStreamedExperts : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

TEST_P(CudaStreamedExperts, EqualTheServicePathWithinTolerance) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t moe_layers = config->num_moe_layers(), K = config->moe.experts_per_token;
  const Out cpu = Generate(dir, "cpu", "bf16");
  ASSERT_EQ(cpu.logits.size(), 4u);
  EXPECT_EQ(cpu.stats.streamed_slots, 0);
  // bf16: the streamed side rounds silu(gate) * up to bf16 (cuBLAS's bf16
  // inputs), the in-process experts do not; int4: quantized weights against
  // the checkpoint's.
  for (const std::string policy : {"stream", "auto"}) {
    for (const auto& [fmt, tol] :
         {std::pair<std::string, double>{"bf16", 2e-2}, {"int8", 1e-1}, {"int4", 2.5e-1}}) {
      SCOPED_TRACE(::testing::Message() << GetParam() << ", " << policy << ", " << fmt);
      const Out st = Generate(dir, policy, fmt);
      ASSERT_EQ(st.logits.size(), cpu.logits.size());
      const double worst = testing::MaxScaledDiff(st.logits, cpu.logits);
      EXPECT_LE(worst, tol);
      const ModelStats& s = st.stats;
      EXPECT_EQ(s.prefill_cpu_layers + s.prefill_stream_layers + s.prefill_split_layers, moe_layers)
          << "one choice per MoE layer of the one large pass";
      if (policy == "stream") {
        EXPECT_EQ(s.prefill_stream_layers, moe_layers);
        EXPECT_EQ(s.streamed_slots, 48 * K * moe_layers);
      } else {
        // What auto streamed is what its layers' choices say: none for cpu
        // layers, every slot for stream layers.
        EXPECT_GE(s.streamed_slots, 48 * K * s.prefill_stream_layers);
        EXPECT_LE(s.streamed_slots, 48 * K * (s.prefill_stream_layers + s.prefill_split_layers));
        if (s.prefill_split_layers == 0) {
          EXPECT_EQ(s.streamed_slots, 48 * K * s.prefill_stream_layers);
        }
      }
      std::printf(
          "[ stream   ] %s %s %s: max rel diff %.3g; layers cpu/stream/split %lld/%lld/%lld, "
          "%lld slots streamed\n",
          GetParam().c_str(), policy.c_str(), fmt.c_str(), worst,
          static_cast<long long>(s.prefill_cpu_layers),
          static_cast<long long>(s.prefill_stream_layers),
          static_cast<long long>(s.prefill_split_layers), static_cast<long long>(s.streamed_slots));
    }
  }
}

// Uploading the next MoE layer's experts ahead (prefill_prefetch) changes
// when bytes cross PCIe, never what is computed: over several large passes
// (a prompt in two chunks, so the second pass's guesses come from the
// first's choices and are partly wrong, then a second sequence) and decode
// steps, the logits with and without it are equal bit for bit, and with it
// the later layers compute from experts uploaded ahead.
TEST_P(CudaStreamedExperts, PrefetchChangesNoResult) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t moe_layers = config->num_moe_layers();
  struct Run {
    std::vector<std::vector<float>> logits;
    ModelStats stats;
  };
  auto run = [&](bool prefetch, const std::string& fmt) {
    ModelOptions o;
    o.backend = "cuda";
    o.num_threads = 2;
    o.cuda.prefill_experts = PrefillExperts::kStream;
    o.cuda.prefill_prefetch = prefetch;
    o.cuda.hot_format = *ParseWeightFormat(fmt);
    o.cuda.hot_group = 32;
    Run r;
    auto m = Model::Load(dir, o);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    auto prompt = [](int n, int a, int b) {
      std::vector<int32_t> p;
      for (int i = 0; i < n; ++i) p.push_back((a * i + b) % 50);
      return p;
    };
    auto keep = [&](const absl::StatusOr<std::vector<float>>& l) {
      EXPECT_TRUE(l.ok()) << l.status();
      if (l.ok()) r.logits.push_back(*l);
    };
    auto s1 = (*m)->NewSequence();
    keep((*m)->Prefill(*s1, prompt(48, 7, 3), LogitsMode::kLast));
    keep((*m)->Prefill(*s1, prompt(40, 11, 5), LogitsMode::kLast));
    auto s2 = (*m)->NewSequence();
    keep((*m)->Prefill(*s2, prompt(64, 13, 1), LogitsMode::kLast));
    keep((*m)->Decode(*s1, 9));
    keep((*m)->Decode(*s2, 4));
    r.stats = (*m)->stats();
    return r;
  };
  for (const std::string fmt : {"bf16", "int4"}) {
    SCOPED_TRACE(::testing::Message() << GetParam() << ", " << fmt);
    const Run off = run(false, fmt), on = run(true, fmt);
    ASSERT_EQ(off.logits.size(), 5u);
    ASSERT_EQ(on.logits.size(), off.logits.size());
    for (size_t i = 0; i < off.logits.size(); ++i)
      EXPECT_EQ(on.logits[i], off.logits[i]) << "pass " << i << " differs with prefetch";
    EXPECT_EQ(on.stats.streamed_slots, off.stats.streamed_slots);
    EXPECT_EQ(off.stats.prefetched_experts, 0);
    EXPECT_EQ(off.stats.prefetch_used_experts, 0);
    EXPECT_LE(on.stats.prefetch_used_experts, on.stats.prefetched_experts);
    // With two MoE layers both stages end up holding a layer each, and a
    // guess of what a layer streamed before finds it there already: only a
    // first pass that streams every expert uploads ahead (16 experts do,
    // 48 need not). A third MoE layer makes the stages turn over.
    if (moe_layers >= 3) {
      EXPECT_GT(on.stats.prefetched_experts, 0);
      EXPECT_GT(on.stats.prefetch_used_experts, 0);
    }
    std::printf("[ prefetch ] %s %s: %lld experts uploaded ahead, %lld of them used\n",
                GetParam().c_str(), fmt.c_str(),
                static_cast<long long>(on.stats.prefetched_experts),
                static_cast<long long>(on.stats.prefetch_used_experts));
  }
}

// A policy is an enum, parsed at the flag edge: a name that is not one is
// refused there (a load can no longer be given one).
TEST(CudaStreamedExpertsOptions, UnknownPolicyIsRefused) {
  EXPECT_FALSE(ParsePrefillExperts("gpu").has_value());
  for (PrefillExperts p : {PrefillExperts::kCpu, PrefillExperts::kStream, PrefillExperts::kAuto})
    EXPECT_EQ(ParsePrefillExperts(PrefillExpertsName(p)), p);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaStreamedExperts,
                         ::testing::ValuesIn(testing::CudaModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace hmoe
