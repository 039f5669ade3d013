// The GPU memory plan (gpu_worker/memory_plan.h) against the CUDA backend:
// on every fixture and a few option sets, what the backend holds after load
// (ModelStats::gpu_bytes, its --gpu-mem-gb accounting) equals the plan's
// total within 2%, and the KV pool is the plan's; a plan that does not fit
// is refused at load with its message, and a bound above the device's free
// memory names both. Skips without a GPU.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_placement.h"
#include "gmock/gmock.h"
#include "gpu_worker/memory_plan.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::ModelFixturesRoot;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

class CudaMemoryPlan : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

struct Case {
  const char* name;
  int64_t max_seq_len;
  int64_t kv_sequences;
  bool hot;
  PrefillExperts prefill;
};

TEST_P(CudaMemoryPlan, BackendHoldsWhatThePlanSays) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  for (const Case& k : {Case{"defaults", 0, 16, false, PrefillExperts::kCpu},
                        Case{"short context, 3 sequences", 300, 3, false, PrefillExperts::kCpu},
                        Case{"hot experts int4", 1024, 8, true, PrefillExperts::kCpu},
                        Case{"streamed prefill", 2048, 4, false, PrefillExperts::kStream}}) {
    SCOPED_TRACE(::testing::Message() << GetParam() << ": " << k.name);
    ModelOptions o;
    o.backend = "cuda";
    o.num_threads = 2;
    o.max_seq_len = k.max_seq_len;
    o.cuda.gpu_mem_gb = 4;
    o.cuda.kv_sequences = k.kv_sequences;
    o.cuda.prefill_experts = k.prefill;
    o.cuda.prefill_stream_tokens = 512;
    if (k.hot && config->num_moe_layers() > 0) {
      auto p = std::make_shared<Placement>();
      p->model_type = config->model_type;
      p->num_experts = config->moe.num_experts;
      p->experts_per_token = config->moe.experts_per_token;
      for (int l = 0; l < config->num_layers; ++l) {
        if (!config->layers[static_cast<size_t>(l)].moe) continue;
        for (int32_t e = 0; e < config->moe.num_experts; e += 2) p->hot[l].push_back(e);
        p->num_hot += static_cast<int64_t>(p->hot[l].size());
      }
      o.cuda.hot_experts = p;
      o.cuda.hot_format = WeightFormat::kInt4;
      o.cuda.hot_group = 32;
    }
    auto m = Model::Load(dir, o);
    ASSERT_TRUE(m.ok()) << m.status();
    const ModelOptions& resolved = (*m)->options();
    auto plan =
        PlanCudaBackend(*config, resolved, static_cast<int64_t>(4 * kGiB), {DenseWeights::kBf16});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->fits) << plan->message;
    EXPECT_EQ((*m)->kv_blocks_total(), plan->kv_blocks);
    const double held = static_cast<double>((*m)->stats().gpu_bytes);
    const double planned = static_cast<double>(plan->total_bytes);
    EXPECT_NEAR(held / planned, 1.0, 0.02)
        << "held " << held << " bytes, planned " << planned << ":\n"
        << FormatPlan(*plan);
  }
}

TEST_P(CudaMemoryPlan, FewerSequencesWhenTheBatchDoesNotFit) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  // A bound with room for a few sequences of a long context, not 4096 of them.
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.max_seq_len = 1 << 16;
  o.cuda.kv_sequences = 4096;
  const int64_t per_seq =
      (o.max_seq_len / kKvBlockTokens) * kKvBlockTokens * *KvBytesPerToken(*config, KvDtype::kF32);
  o.cuda.gpu_mem_gb = 0.25 + 3.5 * static_cast<double>(per_seq) / kGiB;
  auto m = Model::Load(dir, o);
  ASSERT_TRUE(m.ok()) << m.status();
  auto plan = PlanCudaBackend(*config, (*m)->options(),
                              static_cast<int64_t>(std::llround(o.cuda.gpu_mem_gb * kGiB)),
                              {DenseWeights::kBf16});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GE(plan->batch, 1);
  EXPECT_LT(plan->batch, 4096);
  EXPECT_EQ((*m)->kv_blocks_total(), plan->kv_blocks);
  EXPECT_EQ(plan->kv_blocks, plan->batch * (o.max_seq_len / kKvBlockTokens));
}

TEST_P(CudaMemoryPlan, RefusesAtLoadWhatDoesNotFit) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.cuda.gpu_mem_gb = 1;
  o.cuda.kv_blocks = int64_t{1} << 30;  // far more than 1 GiB of KV cache
  auto m = Model::Load(dir, o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("GPU memory plan: does not fit"));
  EXPECT_THAT(m.status().message(), HasSubstr("the 1.00 GiB bound"));
  // A bound above the device's free memory names both.
  o.cuda.kv_blocks = 0;
  o.cuda.gpu_mem_gb = 100000;
  m = Model::Load(dir, o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted) << m.status();
  EXPECT_THAT(m.status().message(), HasSubstr("--gpu-mem-gb 100000 exceeds GPU 0's free memory"));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaMemoryPlan,
                         ::testing::ValuesIn(testing::CudaModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace hmoe
