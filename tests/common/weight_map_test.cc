#include "common/weight_map.h"

#include <cstring>
#include <fstream>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;

std::string Configs() { return testing::FixturesDir() + "/configs"; }

// Counts must equal what transformers reports for the same config
// (tests/fixtures/configs/make_configs.py built each model on the meta device).
TEST(WeightMap, ParameterCountsMatchTransformers) {
  std::ifstream in(Configs() + "/param_counts.json");
  json want = json::parse(in);
  int checked = 0;
  for (auto it = want.begin(); it != want.end(); ++it) {
    if (it.key()[0] == '_') continue;
    SCOPED_TRACE(it.key());
    auto c = LoadModelConfig(Configs() + "/" + it.key());
    // deepseek_v32 and glm_moe_dsa (the DSA indexer) do not load yet.
    if (absl::IsUnimplemented(c.status())) continue;
    ASSERT_TRUE(c.ok()) << c.status();
    ParamCounts n = CountParameters(*c);
    EXPECT_EQ(n.total, it.value()["total"].get<int64_t>());
    EXPECT_EQ(n.routed_experts, it.value()["routed_experts"].get<int64_t>());
    EXPECT_EQ(n.active, it.value()["active"].get<int64_t>());
    ++checked;
  }
  EXPECT_GE(checked, 9);  // ..., kimi_k2, glm4_5, deepseek_v4_flash and deepseek_v4_pro
}

TEST(WeightMap, TinyFixturesMatchTheirWeightMaps) {
  for (const char* name : {"deepseek_v3_tiny", "deepseek_v2_tiny", "qwen3_moe_tiny", "mixtral_tiny",
                           "glm4_moe_tiny", "deepseek_v3_kimi_tiny"}) {
    SCOPED_TRACE(name);
    const std::string dir = testing::FixturesDir() + "/" + name;
    auto c = LoadModelConfig(dir);
    ASSERT_TRUE(c.ok()) << c.status();
    auto ck = Checkpoint::Open(dir);
    ASSERT_TRUE(ck.ok()) << ck.status();
    EXPECT_TRUE(CheckWeights(*c, **ck).ok()) << CheckWeights(*c, **ck);
    // The map names every tensor in the checkpoint: nothing unexpected is left over.
    std::set<std::string> expected;
    for (const auto& w : ExpectedWeights(*c)) expected.insert(w.name);
    for (const auto& n : (*ck)->Names()) EXPECT_TRUE(expected.count(n)) << n;
  }
}

TEST(WeightMap, DsaIndexerTensors) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v32_tiny";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_TRUE(CheckWeights(*c, **ck).ok()) << CheckWeights(*c, **ck);
  std::set<std::string> expected;
  for (const auto& w : ExpectedWeights(*c)) expected.insert(w.name);
  for (const auto& n : (*ck)->Names()) EXPECT_TRUE(expected.count(n)) << n;
  for (const char* t :
       {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"})
    EXPECT_TRUE(expected.count(std::string("model.layers.2.self_attn.indexer.") + t)) << t;
}

// DeepSeek-V4's tensors under the published checkpoint's names, and its
// hash layers' tid2eid tables checked at load: dtype, shape, ids in range.
TEST(WeightMap, DeepseekV4TensorsAndHashTables) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v4_tiny";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_TRUE(CheckWeights(*c, **ck).ok()) << CheckWeights(*c, **ck);
  std::set<std::string> expected;
  for (const auto& w : ExpectedWeights(*c)) expected.insert(w.name);
  for (const auto& n : (*ck)->Names()) EXPECT_TRUE(expected.count(n)) << n;
  for (const char* t :
       {"model.layers.0.ffn.gate.tid2eid", "model.layers.2.ffn.gate.bias",
        "model.layers.1.attn.indexer.compressor.ape", "model.layers.2.attn.compressor.wkv.weight",
        "model.hc_head.hc_fn", "model.layers.3.hc_ffn_fn", "head.weight"})
    EXPECT_TRUE(expected.count(t)) << t;
  EXPECT_EQ(ExpertWeightName(*c, 2, 5, ExpertProj::kUp), "model.layers.2.ffn.experts.5.w3.weight");

  // The checkpoint with one tensor replaced: the load names it.
  const std::string table = "model.layers.1.ffn.gate.tid2eid";
  auto with = [&](DType dtype, const Shape& shape, const std::vector<int64_t>& ids) {
    testing::TempDir tmp;
    testing::RewriteCheckpoint(
        dir, tmp.path(), [&](const std::string& name, const Tensor& t, SafetensorsWriter& w) {
          if (name != table) return testing::Keep(name, t, w);
          std::vector<uint8_t> bytes(ids.size() * DTypeBytes(dtype, 1));
          for (size_t i = 0; i < ids.size(); ++i) {
            if (dtype == DType::kI32) {
              const int32_t v = static_cast<int32_t>(ids[i]);
              std::memcpy(bytes.data() + i * 4, &v, 4);
            } else {  // I64, or F32 read as raw bytes
              std::memcpy(bytes.data() + i * DTypeBytes(dtype, 1), &ids[i], DTypeBytes(dtype, 1));
            }
          }
          EXPECT_TRUE(w.Add(name, dtype, shape, bytes.data(), bytes.size()).ok());
          return true;
        });
    auto ck2 = Checkpoint::Open(tmp.path());
    return ck2.ok() ? CheckWeights(*c, **ck2) : ck2.status();
  };
  const int64_t V = c->vocab_size, K = c->moe.experts_per_token, E = c->moe.num_experts;
  std::vector<int64_t> ids(static_cast<size_t>(V * K));
  auto sized = [](std::vector<int64_t> v, size_t n) {
    v.resize(n);
    return v;
  };
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i) % E;
  EXPECT_TRUE(with(DType::kI32, {V, K}, ids).ok()) << with(DType::kI32, {V, K}, ids);
  absl::Status s = with(DType::kI64, {V, K + 1}, sized(ids, static_cast<size_t>(V * (K + 1))));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(table), HasSubstr("expected [256, 2]")));
  s = with(DType::kF32, {V, K}, ids);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(table), HasSubstr("I64 or I32"))) << s;
  ids[2 * 77 + 1] = E;  // token 77's second expert
  s = with(DType::kI64, {V, K}, ids);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(table), HasSubstr("tid2eid"), HasSubstr("token id 77 expert 6"),
                    HasSubstr("n_routed_experts")))
      << s;
  ids[2 * 77 + 1] = -1;
  s = with(DType::kI64, {V, K}, ids);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token id 77 expert -1")) << s;
}

TEST(WeightMap, NamesFollowEachFamily) {
  auto c = LoadModelConfig(Configs() + "/mixtral_8x7b");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ExpertWeightName(*c, 2, 5, ExpertProj::kGate),
            "model.layers.2.block_sparse_moe.experts.5.w1.weight");
  EXPECT_EQ(ExpertWeightName(*c, 2, 5, ExpertProj::kDown),
            "model.layers.2.block_sparse_moe.experts.5.w2.weight");
  EXPECT_EQ(ExpertWeightName(*c, 2, 5, ExpertProj::kUp),
            "model.layers.2.block_sparse_moe.experts.5.w3.weight");
  auto d = LoadModelConfig(Configs() + "/deepseek_v2_lite");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(ExpertWeightName(*d, 1, 63, ExpertProj::kUp),
            "model.layers.1.mlp.experts.63.up_proj.weight");
  std::set<std::string> names;
  for (const auto& w : ExpectedWeights(*d)) names.insert(w.name);
  EXPECT_TRUE(names.count("model.layers.0.self_attn.q_proj.weight"));  // no q_lora
  EXPECT_FALSE(names.count("model.layers.0.self_attn.q_a_proj.weight"));
  EXPECT_TRUE(names.count("model.layers.0.mlp.gate_proj.weight"));  // dense first layer
  EXPECT_TRUE(names.count("model.layers.1.mlp.shared_experts.gate_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(ScaleInvName("a.weight"), "a.weight_scale_inv");
}

// A small checkpoint written from the weight map, then broken in several ways:
// one error must list every problem.
class CheckWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    json j;
    std::ifstream(testing::FixturesDir() + "/deepseek_v3_tiny/config.json") >> j;
    config_text_ = j.dump();
    auto c = ParseModelConfig(config_text_, "tiny");
    ASSERT_TRUE(c.ok()) << c.status();
    config_ = *c;
  }
  // Writes every expected tensor as bf16 zeros, applying `edit` to each spec first
  // (return false to drop the tensor).
  template <typename Edit>
  void Write(Edit edit, bool fp8 = false) {
    SafetensorsWriter w;
    for (WeightSpec spec : ExpectedWeights(config_)) {
      if (!edit(spec)) continue;
      if (fp8 && spec.matrix()) {
        std::vector<uint8_t> z(static_cast<size_t>(NumElements(spec.shape)), 0);
        ASSERT_TRUE(w.Add(spec.name, DType::kF8E4M3, spec.shape, z.data(), z.size()).ok());
        Shape s{(spec.shape[0] + 127) / 128, (spec.shape[1] + 127) / 128};
        std::vector<float> ones(static_cast<size_t>(NumElements(s)), 1.0f);
        ASSERT_TRUE(
            w.Add(ScaleInvName(spec.name), DType::kF32, s, ones.data(), ones.size() * 4).ok());
      } else {
        std::vector<uint16_t> z(static_cast<size_t>(NumElements(spec.shape)), 0);
        ASSERT_TRUE(w.Add(spec.name, DType::kBF16, spec.shape, z.data(), z.size() * 2).ok());
      }
    }
    ASSERT_TRUE(w.Write(dir_.file("model.safetensors")).ok());
  }
  absl::Status Check() {
    auto ck = Checkpoint::Open(dir_.path());
    if (!ck.ok()) return ck.status();
    return CheckWeights(config_, **ck);
  }
  testing::TempDir dir_;
  std::string config_text_;
  ModelConfig config_;
};

TEST_F(CheckWeightsTest, CompleteCheckpointPasses) {
  Write([](WeightSpec&) { return true; });
  EXPECT_TRUE(Check().ok()) << Check();
}

// A config.json without n_shared_experts (parsed as 0) beside a checkpoint
// that has them: refused, not run without the shared experts.
TEST_F(CheckWeightsTest, SharedExpertsTheConfigDoesNotDeclareAreRefused) {
  ASSERT_GT(config_.moe.num_shared_experts, 0);
  Write([](WeightSpec&) { return true; });
  json j = json::parse(config_text_);
  j.erase("n_shared_experts");
  auto c = ParseModelConfig(j.dump(), "tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  config_ = *c;
  absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(".mlp.shared_experts."), HasSubstr("set n_shared_experts")));
}

TEST_F(CheckWeightsTest, ListsAllMissing) {
  Write([](WeightSpec& s) {
    return s.name != "model.layers.1.mlp.experts.3.up_proj.weight" && s.name != "lm_head.weight" &&
           s.name != "model.layers.2.mlp.gate.e_score_correction_bias";
  });
  absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(
      std::string(s.message()),
      AllOf(HasSubstr("3 missing"), HasSubstr("model.layers.1.mlp.experts.3.up_proj.weight"),
            HasSubstr("lm_head.weight"), HasSubstr("e_score_correction_bias"),
            HasSubstr(dir_.path())));
}

TEST_F(CheckWeightsTest, ListsMissingAndMisShapedTogether) {
  Write([](WeightSpec& s) {
    if (s.name == "model.layers.0.self_attn.kv_b_proj.weight") s.shape[0] += 1;
    if (s.name == "model.norm.weight") s.shape = {7};
    return s.name != "model.embed_tokens.weight";
  });
  absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("1 missing"), HasSubstr("model.embed_tokens.weight"),
                    HasSubstr("2 mis-shaped"),
                    HasSubstr("model.layers.0.self_attn.kv_b_proj.weight has shape"),
                    HasSubstr("model.norm.weight")));
}

TEST_F(CheckWeightsTest, Fp8CheckpointNeedsScales) {
  json j = json::parse(config_text_);
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  auto c = ParseModelConfig(j.dump(), "tiny-fp8");
  ASSERT_TRUE(c.ok()) << c.status();
  config_ = *c;
  Write([](WeightSpec&) { return true; }, /*fp8=*/true);
  EXPECT_TRUE(Check().ok()) << Check();
  // Same tensors without their scales.
  SafetensorsWriter w;
  for (const auto& spec : ExpectedWeights(config_)) {
    std::vector<uint8_t> z(static_cast<size_t>(NumElements(spec.shape)) * 2, 0);
    DType t = spec.matrix() ? DType::kF8E4M3 : DType::kBF16;
    ASSERT_TRUE(w.Add(spec.name, t, spec.shape, z.data(),
                      static_cast<size_t>(DTypeBytes(t, NumElements(spec.shape))))
                    .ok());
  }
  ASSERT_TRUE(w.Write(dir_.file("model.safetensors")).ok());
  absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("model.layers.0.self_attn.q_a_proj.weight_scale_inv"));
}

TEST_F(CheckWeightsTest, WrongDtype) {
  SafetensorsWriter w;
  for (const auto& spec : ExpectedWeights(config_)) {
    const bool bad = spec.name == "model.norm.weight";
    DType t = bad ? DType::kI32 : DType::kBF16;
    std::vector<uint8_t> z(static_cast<size_t>(DTypeBytes(t, NumElements(spec.shape))), 0);
    ASSERT_TRUE(w.Add(spec.name, t, spec.shape, z.data(), z.size()).ok());
  }
  ASSERT_TRUE(w.Write(dir_.file("model.safetensors")).ok());
  absl::Status s = Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("model.norm.weight has dtype I32"), Not(HasSubstr("missing"))));
}

}  // namespace
}  // namespace hmoe
