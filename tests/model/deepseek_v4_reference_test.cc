// DeepSeek-V4's plain f32 forward pass (gpu_worker/cpu/deepseek_v4_reference)
// against transformers on deepseek_v4_tiny: every prompt position's logits
// within 1e-3 relative, and the greedy continuation (recomputed in full over
// prompt + continuation) identical, with its step logits within 1e-3.
#include "gpu_worker/cpu/deepseek_v4_reference.h"

#include <algorithm>
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

TEST(DeepseekV4Reference, MatchesTransformers) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v4_tiny";
  const testing::ReferenceOutputs ref = testing::LoadReference(dir);
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const int64_t P = static_cast<int64_t>(ref.prompt.size()), V = ref.vocab;
  const int64_t N = static_cast<int64_t>(ref.greedy.size());
  std::vector<int32_t> seq = ref.prompt;
  seq.insert(seq.end(), ref.greedy.begin(), ref.greedy.end() - 1);
  auto logits = cpu::DeepseekV4Logits(*c, **ck, seq);
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(static_cast<int64_t>(logits->size()), (P + N - 1) * V);
  double prefill_err = 0, step_err = 0;
  for (int64_t p = 0; p < P; ++p)
    prefill_err = std::max(prefill_err,
                           testing::RelErr(logits->data() + p * V, ref.prefill.data() + p * V, V));
  for (int64_t i = 0; i < N; ++i) {
    const float* row = logits->data() + (P - 1 + i) * V;
    step_err = std::max(step_err, testing::RelErr(row, ref.steps.data() + i * V, V));
    EXPECT_EQ(std::max_element(row, row + V) - row, ref.greedy[static_cast<size_t>(i)]) << i;
  }
  EXPECT_LT(prefill_err, 1e-3);
  EXPECT_LT(step_err, 1e-3);
  std::printf("[ v4 ref   ] max rel err vs transformers: prefill %.2e, greedy steps %.2e\n",
              prefill_err, step_err);
}

TEST(DeepseekV4Reference, RefusesOtherModelsAndBadIds) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v4_tiny";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(cpu::DeepseekV4Logits(*c, **ck, {1, 256}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ModelConfig other = *c;
  other.arch = Architecture::kDeepseekV3;
  EXPECT_EQ(cpu::DeepseekV4Logits(other, **ck, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Until the driver runs V4's kinds, loading the model refuses it cleanly,
// naming the model type.
TEST(DeepseekV4Reference, CpuBackendRefusesTheModelNamingIt) {
  ModelOptions opt;
  opt.backend = "cpu";
  opt.num_threads = 2;
  auto m = Model::Load(testing::FixturesDir() + "/deepseek_v4_tiny", opt);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(std::string(m.status().message()).find("deepseek_v4"), std::string::npos) << m.status();
}

// The CUDA backend refuses it too, naming the model type (runs on the GPU machine).
TEST(DeepseekV4Reference, CudaBackendRefusesIt) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  ModelOptions opt;
  opt.backend = "cuda";
  opt.num_threads = 2;
  auto m = Model::Load(testing::FixturesDir() + "/deepseek_v4_tiny", opt);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_NE(std::string(m.status().message()).find("deepseek_v4"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace hmoe
