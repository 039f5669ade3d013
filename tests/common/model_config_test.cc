#include "common/model_config.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::string Configs() { return testing::FixturesDir() + "/configs"; }

TEST(ModelConfig, DeepseekV3Published) {
  auto c = LoadModelConfig(Configs() + "/deepseek_v3_published");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV3);
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->num_layers, 61);
  EXPECT_EQ(c->mla.q_lora_rank, 1536);
  EXPECT_EQ(c->mla.kv_lora_rank, 512);
  EXPECT_EQ(c->mla.qk_head_dim(), 192);
  EXPECT_EQ(c->moe.num_experts, 256);
  EXPECT_EQ(c->moe.experts_per_token, 8);
  EXPECT_EQ(c->moe.scoring, ScoringFunc::kSigmoid);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(c->moe.score_correction_bias);
  EXPECT_EQ(c->moe.n_group, 8);
  EXPECT_EQ(c->moe.topk_group, 4);
  EXPECT_DOUBLE_EQ(c->moe.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c->moe.norm_topk_prob);
  EXPECT_EQ(c->first_k_dense_replace, 3);
  EXPECT_EQ(c->num_moe_layers(), 58);
  EXPECT_FALSE(c->layers[2].moe);
  EXPECT_TRUE(c->layers[3].moe);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  // Published YaRN spelling: rope_scaling {"type": "yarn"} + top-level rope_theta.
  EXPECT_EQ(c->rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c->rope.factor, 40);
  EXPECT_DOUBLE_EQ(c->rope.theta, 10000);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rope.mscale_all_dim, 1.0);
  EXPECT_TRUE(c->rope.interleave);  // MLA default
  EXPECT_EQ(c->quantization.method, "fp8");
  EXPECT_THAT(c->quantization.weight_block, ::testing::ElementsAre(128, 128));
}

TEST(ModelConfig, DeepseekV3TransformersDefaults) {
  auto c = LoadModelConfig(Configs() + "/deepseek_v3_default");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kDefault);  // rope_parameters {"rope_type": "default"}
  EXPECT_TRUE(c->rope.interleave);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  EXPECT_EQ(c->num_moe_layers(), 58);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{1});
}

TEST(ModelConfig, TinyFixturesRopeParameters) {
  // transformers 5 spelling: rope_parameters with rope_type yarn.
  auto c = LoadModelConfig(testing::FixturesDir() + "/deepseek_v3_tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c->rope.mscale_all_dim, 0.8);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 1024);
  for (const char* name : {"deepseek_v2_tiny", "qwen3_moe_tiny", "mixtral_tiny", "glm4_moe_tiny",
                           "deepseek_v3_kimi_tiny"}) {
    auto other = LoadModelConfig(testing::FixturesDir() + "/" + name);
    EXPECT_TRUE(other.ok()) << name << ": " << other.status();
  }
}

// generation_config.json's eos ids join config.json's; a bad one is refused
// naming the file and field.
TEST(ModelConfig, GenerationConfigEosIdsJoinTheConfigs) {
  testing::TempDir dir;
  std::filesystem::copy_file(Configs() + "/deepseek_v3_published/config.json",
                             dir.file("config.json"));
  auto with = [&](const std::string& text) {
    std::ofstream(dir.file("generation_config.json")) << text;
    return LoadModelConfig(dir.path());
  };
  auto c = with(R"({"eos_token_id": [1, 7, 1], "temperature": 0.6})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{1, 7}));
  c = with(R"({"eos_token_id": 9})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{1, 9}));
  c = with(R"({"do_sample": true})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{1}));
  for (const char* bad :
       {R"({"eos_token_id": "x"})", R"({"eos_token_id": [1, 129280]})", R"([1])", "{"}) {
    c = with(bad);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("generation_config.json")) << bad;
  }
}

TEST(ModelConfig, DeepseekV2Lite) {
  auto c = LoadModelConfig(Configs() + "/deepseek_v2_lite");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV2);
  EXPECT_FALSE(c->mla.q_lora_rank.has_value());  // q_lora_rank: null
  EXPECT_EQ(c->moe.scoring, ScoringFunc::kSoftmax);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kGreedy);
  EXPECT_FALSE(c->moe.score_correction_bias);
  EXPECT_FALSE(c->moe.norm_topk_prob);
  EXPECT_EQ(c->moe.num_shared_experts, 2);
  EXPECT_EQ(c->num_moe_layers(), 26);
  EXPECT_DOUBLE_EQ(c->rope.mscale, 0.707);
}

TEST(ModelConfig, Qwen3AndMixtral) {
  auto q = LoadModelConfig(Configs() + "/qwen3_30b_a3b");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(q->head_dim, 128);  // explicit, != hidden / heads
  EXPECT_EQ(q->num_kv_heads, 4);
  EXPECT_EQ(q->moe.num_experts, 128);  // published "num_experts"
  EXPECT_TRUE(q->moe.norm_topk_prob);
  EXPECT_EQ(q->num_moe_layers(), 48);
  EXPECT_DOUBLE_EQ(q->rope.theta, 1e6);
  // config.json says 151645 (<|im_end|>); generation_config.json adds
  // 151643 (<|endoftext|>), where transformers' generate also stops.
  EXPECT_EQ(q->eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  auto m = LoadModelConfig(Configs() + "/mixtral_8x7b");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->arch, Architecture::kMixtral);
  EXPECT_EQ(m->moe.num_experts, 8);
  EXPECT_EQ(m->moe.intermediate_size, 14336);
  EXPECT_EQ(m->head_dim, 128);
  EXPECT_EQ(m->layers[0].sliding_window, 0);
}

// GLM-4.5's published config: GQA with partial RoPE and q/k norm, biases,
// sigmoid + correction-bias routing, 3 dense layers before 89 MoE ones.
TEST(ModelConfig, Glm45Published) {
  auto c = LoadModelConfig(Configs() + "/glm4_5_published");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kGlm4Moe);
  EXPECT_EQ(c->model_type, "glm4_moe");
  EXPECT_EQ(c->head_dim, 128);  // explicit, != 5120 / 96
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_DOUBLE_EQ(c->rope.partial_rotary_factor, 0.5);  // top level, as published
  EXPECT_DOUBLE_EQ(c->rope.theta, 1e6);
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  EXPECT_FALSE(c->rope.interleave);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->moe.num_experts, 160);
  EXPECT_EQ(c->moe.experts_per_token, 8);
  EXPECT_EQ(c->moe.num_shared_experts, 1);
  EXPECT_EQ(c->moe.intermediate_size, 1536);
  EXPECT_EQ(c->moe.scoring, ScoringFunc::kSigmoid);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(c->moe.score_correction_bias);
  EXPECT_EQ(c->moe.n_group, 1);
  EXPECT_DOUBLE_EQ(c->moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(c->num_moe_layers(), 89);
  EXPECT_FALSE(c->layers[2].moe);
  EXPECT_TRUE(c->layers[3].moe);
  EXPECT_EQ(c->layers[3].attention, AttentionKind::kGqa);
  EXPECT_EQ(c->layers[3].router, RouterKind::kSigmoidGroupedTopk);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{151329, 151336, 151338}));
  // transformers 5 writes the factor inside rope_parameters (the tiny fixture).
  auto t = LoadModelConfig(testing::FixturesDir() + "/glm4_moe_tiny");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_DOUBLE_EQ(t->rope.partial_rotary_factor, 0.5);
  EXPECT_EQ(t->head_dim, 32);
  EXPECT_EQ(t->moe.n_group, 4);
  EXPECT_EQ(t->moe.topk_group, 2);
  EXPECT_EQ(t->num_moe_layers(), 2);
}

// Glm4MoeConfig's defaults for what a config.json leaves out, and the
// rotary share's bounds.
TEST(ModelConfig, Glm4MoeDefaultsAndRotaryBounds) {
  json g = ReadJson(Configs() + "/glm4_5_published/config.json");
  for (const char* f : {"partial_rotary_factor", "use_qk_norm", "routed_scaling_factor", "n_group",
                        "topk_group", "norm_topk_prob", "rms_norm_eps", "first_k_dense_replace"})
    g.erase(f);
  auto c = ParseModelConfig(g.dump(), "glm/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope.partial_rotary_factor, 0.5);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_DOUBLE_EQ(c->moe.routed_scaling_factor, 1.0);
  EXPECT_EQ(c->moe.n_group, 1);
  EXPECT_TRUE(c->moe.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->first_k_dense_replace, 1);
  EXPECT_EQ(c->num_moe_layers(), 91);
  for (const json& bad : {json(0.0), json(1.5), json(0.01), json(-1), json("half")}) {
    json j = ReadJson(Configs() + "/glm4_5_published/config.json");
    j["partial_rotary_factor"] = bad;  // 0.01 of 128: 1 dim, not a pair
    auto e = ParseModelConfig(j.dump(), "glm/config.json");
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << bad.dump();
    EXPECT_THAT(std::string(e.status().message()), HasSubstr("\"partial_rotary_factor\""))
        << e.status();
  }
  json j = ReadJson(Configs() + "/glm4_5_published/config.json");
  j["first_k_dense_replace"] = 93;
  auto e = ParseModelConfig(j.dump(), "glm/config.json");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("\"first_k_dense_replace\""));
  j = ReadJson(Configs() + "/glm4_5_published/config.json");
  j["n_routed_experts"] = 1 << 20;
  e = ParseModelConfig(j.dump(), "glm/config.json");
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("\"n_routed_experts\""));
}

// Kimi-K2's published config: DeepSeek-V3 under model_type kimi_k2, 384
// experts without group limits, one dense layer.
TEST(ModelConfig, KimiK2Published) {
  auto c = LoadModelConfig(Configs() + "/kimi_k2_published");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV3);
  EXPECT_EQ(c->model_type, "kimi_k2");
  EXPECT_TRUE(c->is_mla());
  EXPECT_EQ(c->num_heads, 64);
  EXPECT_EQ(c->moe.num_experts, 384);
  EXPECT_EQ(c->moe.n_group, 1);
  EXPECT_EQ(c->moe.topk_group, 1);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  EXPECT_DOUBLE_EQ(c->moe.routed_scaling_factor, 2.827);
  EXPECT_EQ(c->num_moe_layers(), 60);
  EXPECT_EQ(c->rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c->rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c->rope.beta_fast, 1.0);
  EXPECT_DOUBLE_EQ(c->rope.theta, 50000.0);
  EXPECT_TRUE(c->rope.interleave);
  EXPECT_EQ(c->quantization.method, "fp8");
  EXPECT_STREQ(ArchitectureName(c->arch), "deepseek_v3");
}

// Fields a config.json leaves out take the transformers config class's
// defaults (they change routing, RoPE and norms, not shapes: no weight
// check would notice): DeepseekV3Config n_group 8, topk_group 4,
// routed_scaling_factor 2.5; MixtralConfig rope_theta 1e6, rms_norm_eps
// 1e-5, max_position_embeddings 131072; Qwen3MoeConfig 32768;
// DeepseekV2Config 2048.
TEST(ModelConfig, MissingFieldsTakeTransformersClassDefaults) {
  json v3 = ReadJson(Configs() + "/deepseek_v3_published/config.json");
  for (const char* f : {"n_group", "topk_group", "routed_scaling_factor"}) v3.erase(f);
  auto a = ParseModelConfig(v3.dump(), "v3/config.json");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->moe.n_group, 8);
  EXPECT_EQ(a->moe.topk_group, 4);
  EXPECT_DOUBLE_EQ(a->moe.routed_scaling_factor, 2.5);
  json mx = ReadJson(Configs() + "/mixtral_8x7b/config.json");
  for (const char* f : {"rope_theta", "rms_norm_eps", "max_position_embeddings"}) mx.erase(f);
  auto m = ParseModelConfig(mx.dump(), "mixtral/config.json");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DOUBLE_EQ(m->rope.theta, 1e6);
  EXPECT_DOUBLE_EQ(m->rms_norm_eps, 1e-5);
  EXPECT_EQ(m->max_position_embeddings, 131072);
  json q = ReadJson(Configs() + "/qwen3_30b_a3b/config.json");
  for (const char* f : {"rope_theta", "rms_norm_eps", "max_position_embeddings"}) q.erase(f);
  auto qc = ParseModelConfig(q.dump(), "qwen/config.json");
  ASSERT_TRUE(qc.ok()) << qc.status();
  EXPECT_DOUBLE_EQ(qc->rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(qc->rms_norm_eps, 1e-6);
  EXPECT_EQ(qc->max_position_embeddings, 32768);
  // Every Mixtral layer routes: no experts is an error naming the field.
  mx["num_local_experts"] = 0;
  auto none = ParseModelConfig(mx.dump(), "mixtral/config.json");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("\"num_local_experts\""));
}

// Mutates the published DeepSeek-V3 config and expects an exact error.
class ConfigErrorTest : public ::testing::Test {
 protected:
  json base_ = ReadJson(Configs() + "/deepseek_v3_published/config.json");
  absl::Status Parse(const json& j) { return ParseModelConfig(j.dump(), "x/config.json").status(); }
  void ExpectField(const json& j, absl::StatusCode code, const std::string& field) {
    absl::Status s = Parse(j);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("x/config.json"), HasSubstr(field))) << s;
  }
};

TEST_F(ConfigErrorTest, UnknownModelType) {
  json j = base_;
  j["model_type"] = "llama";
  ExpectField(j, absl::StatusCode::kUnimplemented, "\"llama\"");
  j.erase("model_type");
  ExpectField(j, absl::StatusCode::kInvalidArgument, "model_type");
}

TEST_F(ConfigErrorTest, InconsistentFields) {
  struct Case {
    const char* field;
    json value;
  };
  const Case cases[] = {
      {"num_experts_per_tok", 300},  // > experts
      {"n_group", 7},                // does not divide 256
      {"topk_group", 9},             // > n_group
      {"num_key_value_heads", 3},    // does not divide 128 heads
      {"hidden_size", 0},
      {"qk_rope_head_dim", 63},  // odd
      {"first_k_dense_replace", 99},
      {"vocab_size", "big"},      // mistyped
      {"kv_lora_rank", nullptr},  // required
      {"scoring_func", "relu"},
      {"topk_method", "random"},
      {"rms_norm_eps", -1},
      {"eos_token_id", 999999},
      {"norm_topk_prob", "yes"},
      // Magnitudes nothing real has (before: a bad_alloc / length_error
      // terminated the process, or a float cast past int64 was undefined).
      {"num_hidden_layers", 1000000000000},
      {"hidden_size", 1e300},
      {"vocab_size", 1e18},
      {"max_position_embeddings", 4611686018427387904},
      {"moe_intermediate_size", 1 << 30},
      {"n_routed_experts", 1 << 20},
  };
  for (const auto& c : cases) {
    json j = base_;
    j[c.field] = c.value;
    SCOPED_TRACE(c.field);
    ExpectField(j, absl::StatusCode::kInvalidArgument, c.field);
  }
  json j = base_;
  j["num_experts_per_tok"] = 8;
  j["topk_group"] = 1;  // 1 group of 32 experts still holds 8
  EXPECT_TRUE(Parse(j).ok());
  j["n_group"] = 64;  // 4 experts per group, top 1 group -> only 4 candidates for top-8
  ExpectField(j, absl::StatusCode::kInvalidArgument, "num_experts_per_tok");
}

// transformers: a yarn config without `factor` takes max_position_embeddings /
// original_max_position_embeddings (before: 1, no interpolation at all).
TEST_F(ConfigErrorTest, YarnWithoutFactorStretchesTheOriginalContext) {
  json j = base_;
  j["max_position_embeddings"] = 8192;
  j["rope_scaling"] = {{"type", "yarn"}, {"original_max_position_embeddings", 1024}};
  auto c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
  j["rope_scaling"]["factor"] = 4;  // given: taken as is
  c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope.factor, 4.0);
}

TEST_F(ConfigErrorTest, RopeAndQuantization) {
  json j = base_;
  j["rope_scaling"]["type"] = "longrope";
  ExpectField(j, absl::StatusCode::kUnimplemented, "rope_type");
  j = base_;
  j["rope_scaling"]["factor"] = 0.5;
  ExpectField(j, absl::StatusCode::kInvalidArgument, "rope_scaling.factor");
  j = base_;
  j["quantization_config"]["weight_block_size"] = {128};
  ExpectField(j, absl::StatusCode::kInvalidArgument, "quantization_config.weight_block_size");
  j = base_;
  j["quantization_config"]["quant_method"] = "gptq";
  ExpectField(j, absl::StatusCode::kUnimplemented, "gptq");
  EXPECT_EQ(ParseModelConfig("{not json", "x/config.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadModelConfig("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelConfig, QwenLayerKinds) {
  json j = ReadJson(Configs() + "/qwen3_30b_a3b/config.json");
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  j["use_sliding_window"] = true;
  j["sliding_window"] = 4096;
  j["max_window_layers"] = 4;
  auto c = ParseModelConfig(j.dump(), "q");
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<bool> moe;
  std::vector<int64_t> window;
  for (const auto& l : c->layers) {
    moe.push_back(l.moe);
    window.push_back(l.sliding_window);
  }
  EXPECT_THAT(moe, ::testing::ElementsAre(false, true, false, false, false, true));
  EXPECT_THAT(window, ::testing::ElementsAre(0, 0, 0, 0, 4096, 4096));
  j["mlp_only_layers"] = {6};
  EXPECT_EQ(ParseModelConfig(j.dump(), "q").status().code(), absl::StatusCode::kInvalidArgument);
}

// DeepSeek-V3.2: MLA + the DSA lightning indexer on every layer.
class DsaConfigTest : public ::testing::Test {
 protected:
  json base_ = ReadJson(testing::FixturesDir() + "/deepseek_v32_tiny/config.json");
  absl::Status Parse(const json& j) { return ParseModelConfig(j.dump(), "x/config.json").status(); }
  void ExpectField(const json& j, const std::string& field, const std::string& what = "") {
    absl::Status s = Parse(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr("x/config.json"), HasSubstr("\"" + field + "\""), HasSubstr(what)))
        << s;
  }
};

TEST_F(DsaConfigTest, IndexerFieldsAndLayerKinds) {
  auto c = ParseModelConfig(base_.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV32);
  EXPECT_TRUE(c->is_mla());
  EXPECT_EQ(c->dsa.n_heads, 16);
  EXPECT_EQ(c->dsa.head_dim, 24);
  EXPECT_EQ(c->dsa.topk, 16);
  EXPECT_FALSE(c->dsa.rope_interleave);  // V3.2's indexer ropes halves
  EXPECT_TRUE(c->rope.interleave);       // its MLA interleaved pairs
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  ASSERT_EQ(c->layers.size(), 3u);
  for (const LayerSpec& l : c->layers) {
    EXPECT_EQ(l.attention, AttentionKind::kMlaDsa);
    EXPECT_EQ(l.router, RouterKind::kSigmoidGroupedTopk);
  }
  EXPECT_FALSE(c->layers[0].moe);
  EXPECT_TRUE(c->layers[1].moe);
  EXPECT_STREQ(AttentionKindName(AttentionKind::kMlaDsa), "mla_dsa");
  // mlp_layer_types decides the MoE layers when given (transformers' V3.2).
  json j = base_;
  j["mlp_layer_types"] = {"sparse", "dense", "sparse"};
  c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->layers[0].moe);
  EXPECT_FALSE(c->layers[1].moe);
  EXPECT_TRUE(c->layers[2].moe);
  // Fields left out take DeepseekV32Config's defaults.
  j = base_;
  for (const char* k : {"index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
                        "first_k_dense_replace", "mlp_layer_types", "layer_types"})
    j.erase(k);
  j["num_hidden_layers"] = 4;
  c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dsa.n_heads, 64);
  EXPECT_EQ(c->dsa.head_dim, 128);
  EXPECT_EQ(c->dsa.topk, 2048);
  EXPECT_EQ(c->max_position_embeddings, 163840);
  EXPECT_EQ(c->num_moe_layers(), 1);  // 3 dense layers
}

TEST_F(DsaConfigTest, BadIndexerConfigsAreRefusedNamingTheField) {
  json j = base_;
  j["index_topk"] = 0;
  ExpectField(j, "index_topk", "must be positive");
  j["index_topk"] = -16;
  ExpectField(j, "index_topk", "must be positive");
  j["index_topk"] = 8193;  // max_position_embeddings 8192
  ExpectField(j, "index_topk", "exceeds the context limit (max_position_embeddings 8192)");
  j["index_topk"] = 8192;
  EXPECT_TRUE(Parse(j).ok()) << Parse(j);
  j = base_;
  j["index_n_heads"] = 0;
  ExpectField(j, "index_n_heads", "must be positive");
  j = base_;
  j["index_head_dim"] = 8;  // below qk_rope_head_dim 16
  ExpectField(j, "index_head_dim", "qk_rope_head_dim");
  j = base_;
  j["index_topk"] = "many";
  ExpectField(j, "index_topk", "must be an integer");
  j = base_;
  j["q_lora_rank"] = nullptr;
  ExpectField(j, "q_lora_rank", "is required");
  j = base_;
  j["layer_types"] = {"indexed_attention", "full_attention", "indexed_attention"};
  ExpectField(j, "layer_types[1]", "full_attention");
  j = base_;
  j["mlp_layer_types"] = {"dense", "moe", "sparse"};
  ExpectField(j, "mlp_layer_types[1]", "\"moe\"");
  j["mlp_layer_types"] = {"dense"};
  ExpectField(j, "mlp_layer_types", "per layer");
  // Indexed layers in an architecture without the indexer.
  json v3 = ReadJson(Configs() + "/deepseek_v3_published/config.json");
  v3["num_hidden_layers"] = 2;
  v3["first_k_dense_replace"] = 1;
  v3["layer_types"] = {"indexed_attention", "indexed_attention"};
  ExpectField(v3, "layer_types[0]", "indexed_attention");
}

// GLM-5 (glm_moe_dsa): the same indexer, interleaved rope, no expert groups.
TEST(ModelConfig, GlmMoeDsa) {
  const json base = ReadJson(testing::FixturesDir() + "/glm_moe_dsa_tiny/config.json");
  auto c = ParseModelConfig(base.dump(), "g/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kGlmMoeDsa);
  EXPECT_TRUE(c->dsa.rope_interleave);
  EXPECT_EQ(c->dsa.n_heads, 16);
  EXPECT_EQ(c->dsa.topk, 16);
  EXPECT_EQ(c->moe.n_group, 1);
  EXPECT_EQ(c->moe.topk_method, TopkMethod::kNoauxTc);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  for (const LayerSpec& l : c->layers) EXPECT_EQ(l.attention, AttentionKind::kMlaDsa);
  // GlmMoeDsaConfig's defaults for what a config leaves out.
  json j = base;
  for (const char* k : {"index_n_heads", "n_group", "topk_group", "rms_norm_eps",
                        "max_position_embeddings", "indexer_types"})
    j.erase(k);
  c = ParseModelConfig(j.dump(), "g/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dsa.n_heads, 32);
  EXPECT_EQ(c->moe.n_group, 1);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->max_position_embeddings, 202752);
  // Layers that reuse the previous layer's selection ("shared") are refused
  // naming where they come from; other entries are invalid.
  auto code_and_message = [](const json& x) {
    absl::Status s = ParseModelConfig(x.dump(), "g/config.json").status();
    return std::make_pair(s.code(), std::string(s.message()));
  };
  j = base;
  j["indexer_types"] = {"full", "shared", "full"};
  auto [code, msg] = code_and_message(j);
  EXPECT_EQ(code, absl::StatusCode::kUnimplemented) << msg;
  EXPECT_THAT(msg, AllOf(HasSubstr("indexer_types"), HasSubstr("layer 1"), HasSubstr("shared")));
  j.erase("indexer_types");
  j["index_topk_freq"] = 2;  // layers 1, 3, ... shared
  std::tie(code, msg) = code_and_message(j);
  EXPECT_EQ(code, absl::StatusCode::kUnimplemented) << msg;
  EXPECT_THAT(msg, AllOf(HasSubstr("index_topk_freq"), HasSubstr("layer 2")));
  j.erase("index_topk_freq");
  j["index_topk_pattern"] = "FFS";
  std::tie(code, msg) = code_and_message(j);
  EXPECT_EQ(code, absl::StatusCode::kUnimplemented) << msg;
  EXPECT_THAT(msg, AllOf(HasSubstr("index_topk_pattern"), HasSubstr("layer 2")));
  j["index_topk_pattern"] = "FFF";
  EXPECT_TRUE(ParseModelConfig(j.dump(), "g/config.json").ok());
  j = base;
  j["indexer_types"] = {"full", "full", "dense"};
  std::tie(code, msg) = code_and_message(j);
  EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
  EXPECT_THAT(msg, HasSubstr("indexer_types[2]"));
  j["indexer_types"] = {"full"};
  std::tie(code, msg) = code_and_message(j);
  EXPECT_EQ(code, absl::StatusCode::kInvalidArgument) << msg;
  EXPECT_THAT(msg, HasSubstr("1 entries for 3 layers"));
}

// DeepSeek-V4: per-layer attention kinds and routers, the compressed
// branches' RoPE, mHC; published spelling and transformers' alike.
class DeepseekV4ConfigTest : public ::testing::Test {
 protected:
  json base_ = ReadJson(Configs() + "/deepseek_v4_flash_published/config.json");
  absl::Status Parse(const json& j) { return ParseModelConfig(j.dump(), "x/config.json").status(); }
  void ExpectField(const json& j, const std::string& field, const std::string& what = "") {
    absl::Status s = Parse(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr("x/config.json"), HasSubstr("\"" + field + "\""), HasSubstr(what)))
        << s;
  }
};

TEST_F(DeepseekV4ConfigTest, FlashPublished) {
  auto c = LoadModelConfig(Configs() + "/deepseek_v4_flash_published");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kDeepseekV4);
  EXPECT_EQ(c->residual, ResidualKind::kHyperConnection);
  EXPECT_EQ(c->num_kv_heads, 1);
  EXPECT_EQ(c->head_dim, 512);
  EXPECT_EQ(c->v4.qk_rope_head_dim, 64);
  EXPECT_EQ(c->v4.q_lora_rank, 1024);
  EXPECT_EQ(c->v4.o_groups, 8);
  EXPECT_EQ(c->v4.hc_mult, 4);
  EXPECT_EQ(c->v4.hc_sinkhorn_iters, 20);
  EXPECT_DOUBLE_EQ(c->v4.swiglu_limit, 10.0);
  EXPECT_EQ(c->dsa.topk, 512);
  EXPECT_EQ(c->moe.scoring, ScoringFunc::kSqrtSoftplus);
  EXPECT_EQ(c->moe.experts_per_token, 6);
  EXPECT_EQ(c->num_nextn_predict_layers, 1);
  ASSERT_EQ(c->layers.size(), 43u);
  EXPECT_EQ(c->layers[0].attention, AttentionKind::kV4Hca);
  EXPECT_EQ(c->layers[0].compress_rate, 128);
  EXPECT_EQ(c->layers[3].attention, AttentionKind::kV4Csa);
  EXPECT_EQ(c->layers[3].compress_rate, 4);
  EXPECT_EQ(c->layers[4].attention, AttentionKind::kV4Hca);
  for (size_t i = 0; i < c->layers.size(); ++i) {
    EXPECT_TRUE(c->layers[i].moe);
    EXPECT_EQ(c->layers[i].sliding_window, 128);
    EXPECT_EQ(c->layers[i].router, i < 3 ? RouterKind::kHash : RouterKind::kSqrtSoftplusTopk) << i;
  }
  // Sliding layers: plain RoPE at rope_theta; compressed: YaRN x16 at
  // compress_rope_theta with attention factor 1. Both interleaved, 64 dims.
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(c->rope.theta, 10000.0);
  EXPECT_EQ(c->v4.compress_rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c->v4.compress_rope.theta, 160000.0);
  EXPECT_DOUBLE_EQ(c->v4.compress_rope.factor, 16.0);
  EXPECT_EQ(c->v4.compress_rope.original_max_position_embeddings, 65536);
  ASSERT_TRUE(c->v4.compress_rope.attention_factor.has_value());
  EXPECT_DOUBLE_EQ(*c->v4.compress_rope.attention_factor, 1.0);
  EXPECT_TRUE(c->v4.compress_rope.interleave);
  EXPECT_DOUBLE_EQ(c->v4.compress_rope.partial_rotary_factor, 0.125);
  EXPECT_STREQ(AttentionKindName(AttentionKind::kV4Csa), "v4_csa");
  EXPECT_STREQ(RouterKindName(RouterKind::kHash), "hash");
  EXPECT_STREQ(ResidualKindName(ResidualKind::kHyperConnection), "mhc");

  auto pro = LoadModelConfig(Configs() + "/deepseek_v4_pro_published");
  ASSERT_TRUE(pro.ok()) << pro.status();
  EXPECT_EQ(pro->layers.size(), 61u);
  EXPECT_EQ(pro->moe.num_experts, 384);
  EXPECT_EQ(pro->v4.o_groups, 16);
}

// transformers' spelling (layer_types, mlp_layer_types, compress_rates,
// rope_parameters {main, compress}) reads the same as the published one.
TEST_F(DeepseekV4ConfigTest, TransformersSpelling) {
  json j = base_;
  j.erase("compress_ratios");
  j.erase("num_hash_layers");
  j.erase("rope_scaling");
  j.erase("qk_rope_head_dim");
  j["partial_rotary_factor"] = 0.125;
  j["layer_types"] = json::array();
  j["mlp_layer_types"] = json::array();
  for (int i = 0; i < 43; ++i) {
    j["layer_types"].push_back(i == 5 ? "sliding_attention" : "compressed_sparse_attention");
    j["mlp_layer_types"].push_back(i < 2 ? "hash_moe" : "moe");
  }
  j["compress_rates"] = {{"compressed_sparse_attention", 8}, {"heavily_compressed_attention", 64}};
  j["rope_parameters"] = {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                          {"compress",
                           {{"rope_type", "yarn"},
                            {"rope_theta", 160000.0},
                            {"factor", 16},
                            {"attention_factor", 1.0},
                            {"original_max_position_embeddings", 65536}}}};
  auto c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[5].attention, AttentionKind::kV4Sliding);
  EXPECT_EQ(c->layers[5].compress_rate, 0);
  EXPECT_EQ(c->layers[6].attention, AttentionKind::kV4Csa);
  EXPECT_EQ(c->layers[6].compress_rate, 8);
  EXPECT_EQ(c->layers[1].router, RouterKind::kHash);
  EXPECT_EQ(c->layers[2].router, RouterKind::kSqrtSoftplusTopk);
  EXPECT_EQ(c->v4.qk_rope_head_dim, 64);
  EXPECT_EQ(c->v4.compress_rope.type, RopeType::kYarn);
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  // Without a schedule: DeepseekV4Config's (2 hca, then csa / hca alternating; 3 hash layers).
  j.erase("layer_types");
  j.erase("mlp_layer_types");
  c = ParseModelConfig(j.dump(), "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers[1].attention, AttentionKind::kV4Hca);
  EXPECT_EQ(c->layers[2].attention, AttentionKind::kV4Hca);
  EXPECT_EQ(c->layers[3].attention, AttentionKind::kV4Csa);
  EXPECT_EQ(c->layers[2].router, RouterKind::kHash);
  EXPECT_EQ(c->layers[3].router, RouterKind::kSqrtSoftplusTopk);
}

TEST_F(DeepseekV4ConfigTest, BadConfigsAreRefusedNamingTheField) {
  EXPECT_TRUE(Parse(base_).ok()) << Parse(base_);
  json j = base_;
  j["layer_types"] = json::array();
  for (int i = 0; i < 43; ++i)
    j["layer_types"].push_back(i == 7 ? "full_attention" : "sliding_attention");
  ExpectField(j, "layer_types[7]", "full_attention");
  j["layer_types"].erase(0);
  ExpectField(j, "layer_types", "42 entries for 43 layers");
  j = base_;
  j["compress_ratios"][9] = 16;
  ExpectField(j, "compress_ratios[9]", "16");
  j = base_;
  j["compress_rate_csa"] = 3;  // 128-token window: not a whole number of blocks
  ExpectField(j, "compress_rates.compressed_sparse_attention", "does not divide");
  j = base_;
  j["compress_rates"] = {{"heavily_compressed_attention", 0}};
  ExpectField(j, "compress_rates.heavily_compressed_attention", "must be positive");
  j = base_;
  j["compress_rates"] = {{"sliding_attention", 4}};
  ExpectField(j, "compress_rates.sliding_attention");
  j = base_;
  j["mlp_layer_types"] = json::array();
  for (int i = 0; i < 43; ++i) j["mlp_layer_types"].push_back(i == 1 ? "dense" : "moe");
  ExpectField(j, "mlp_layer_types[1]", "dense");
  j = base_;
  j["num_key_value_heads"] = 2;
  j["num_attention_heads"] = 64;
  ExpectField(j, "num_key_value_heads", "one K=V head");
  j = base_;
  j["o_groups"] = 7;
  ExpectField(j, "o_groups", "does not divide");
  j = base_;
  j["qk_rope_head_dim"] = 63;
  ExpectField(j, "partial_rotary_factor", "63");
  j = base_;
  j["index_head_dim"] = 32;
  ExpectField(j, "index_head_dim");
  j = base_;
  j["hc_mult"] = 0;
  ExpectField(j, "hc_mult");
  j = base_;
  j["scoring_func"] = "softmax";
  EXPECT_EQ(Parse(j).code(), absl::StatusCode::kUnimplemented) << Parse(j);
  EXPECT_THAT(std::string(Parse(j).message()), HasSubstr("scoring_func"));
}

}  // namespace
}  // namespace hmoe
