// DeepSeek-V4's plain f32 forward pass (gpu_worker/cpu/deepseek_v4_reference)
// against transformers on deepseek_v4_tiny: every prompt position's logits
// within 1e-3 relative, and the greedy continuation (recomputed in full over
// prompt + continuation) identical, with its step logits within 1e-3.
#include "gpu_worker/cpu/deepseek_v4_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cpu/reference_experts.h"
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

// Each V4 feature moves the logits far past the tolerance on this fixture,
// so the match above checks it: the indexer's selection, the Sinkhorn
// iterations, the experts' clamp, the routed scaling, the compressed
// branches' own RoPE.
TEST(DeepseekV4Reference, EachFeatureMatters) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v4_tiny";
  const testing::ReferenceOutputs ref = testing::LoadReference(dir);
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const int64_t P = static_cast<int64_t>(ref.prompt.size()), V = ref.vocab;
  auto err = [&](const ModelConfig& m) {
    auto logits = cpu::DeepseekV4Logits(m, **ck, ref.prompt);
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return 0.0;
    double e = 0;
    for (int64_t p = 0; p < P; ++p)
      e = std::max(e, testing::RelErr(logits->data() + p * V, ref.prefill.data() + p * V, V));
    return e;
  };
  struct Change {
    const char* what;
    void (*apply)(ModelConfig&);
  };
  for (const Change& ch : {
           Change{"index_topk 4096 (no selection)", [](ModelConfig& m) { m.dsa.topk = 4096; }},
           Change{"hc_sinkhorn_iters 1", [](ModelConfig& m) { m.v4.hc_sinkhorn_iters = 1; }},
           Change{"swiglu_limit 1000", [](ModelConfig& m) { m.v4.swiglu_limit = 1000; }},
           Change{"routed_scaling_factor 1",
                  [](ModelConfig& m) { m.moe.routed_scaling_factor = 1; }},
           Change{"compressed branches on the main rope",
                  [](ModelConfig& m) { m.v4.compress_rope = m.rope; }},
       }) {
    ModelConfig m = *c;
    ch.apply(m);
    EXPECT_GT(err(m), 1e-2) << ch.what;
  }
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

// The in-process reference experts clamp as V4's experts do (gate <=
// swiglu_limit, |up| <= swiglu_limit): hidden states large enough that the
// clamp binds give the clamped MLP's output, not the plain one.
TEST(DeepseekV4Reference, ReferenceExpertsClampAtTheSwigluLimit) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v4_tiny";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto experts = MakeReferenceRoutedExperts(*c, **ck, 1);
  ASSERT_TRUE(experts.ok()) << experts.status();
  const int64_t H = c->hidden_size, I = c->moe.intermediate_size, T = 3;
  const float limit = static_cast<float>(c->v4.swiglu_limit);
  std::vector<float> hidden(static_cast<size_t>(T * H));
  for (size_t i = 0; i < hidden.size(); ++i)
    hidden[i] = 3.0f * std::sin(0.7f * static_cast<float>(i));
  const std::vector<int32_t> ids = {1, 4, 0, 5, 3, 2};
  const std::vector<float> weights = {0.75f, 0.5f, 1.0f, 0.25f, 0.5f, 0.5f};
  ExpertBatch b;
  b.layer = 3;
  b.num_tokens = T;
  b.hidden_size = H;
  b.hidden = hidden.data();
  b.top_k = 2;
  b.expert_ids = ids.data();
  b.weights = weights.data();
  std::vector<float> out(static_cast<size_t>(T * H));
  ASSERT_TRUE((*experts)->Forward(b, out.data()).ok());
  auto mat = [&](const std::string& name, int64_t n) {
    auto v = cpu::LoadVector(**ck, name, n);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<float>(static_cast<size_t>(n));
  };
  int clamped = 0;
  double err = 0, scale = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> want(static_cast<size_t>(H), 0.0);
    for (int k = 0; k < 2; ++k) {
      const int e = ids[static_cast<size_t>(t * 2 + k)];
      const std::string p = "model.layers.3.ffn.experts." + std::to_string(e) + ".";
      const auto w1 = mat(p + "w1.weight", I * H), w3 = mat(p + "w3.weight", I * H),
                 w2 = mat(p + "w2.weight", H * I);
      std::vector<double> act(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          g += static_cast<double>(w1[static_cast<size_t>(i * H + h)]) *
               hidden[static_cast<size_t>(t * H + h)];
          u += static_cast<double>(w3[static_cast<size_t>(i * H + h)]) *
               hidden[static_cast<size_t>(t * H + h)];
        }
        clamped += g > limit || std::abs(u) > limit;
        g = std::min<double>(g, limit);
        u = std::clamp<double>(u, -limit, limit);
        act[static_cast<size_t>(i)] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i)
          y += w2[static_cast<size_t>(h * I + i)] * act[static_cast<size_t>(i)];
        want[static_cast<size_t>(h)] += weights[static_cast<size_t>(t * 2 + k)] * y;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      err = std::max(err,
                     std::abs(out[static_cast<size_t>(t * H + h)] - want[static_cast<size_t>(h)]));
      scale = std::max(scale, std::abs(want[static_cast<size_t>(h)]));
    }
  }
  EXPECT_GT(clamped, 10);  // the clamp binds on these inputs
  EXPECT_LT(err, 1e-5 * scale) << err << " of " << scale;
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
