#include "sdk/inspect.h"

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

TEST(Inspect, DeepseekV3DefaultsMatchTransformersCounts) {
  const std::string configs = testing::FixturesDir() + "/configs";
  json want = json::parse(std::ifstream(configs + "/param_counts.json"))["deepseek_v3_default"];
  InspectOptions opt;
  opt.dram_gbps = 92;
  opt.json = true;
  auto r = InspectModel(configs + "/deepseek_v3_default", opt);
  ASSERT_TRUE(r.ok()) << r.status();
  json got = json::parse(FormatReport(*r, opt));
  EXPECT_EQ(got["params"]["total"].get<int64_t>(), want["total"].get<int64_t>());
  EXPECT_EQ(got["params"]["active"].get<int64_t>(), want["active"].get<int64_t>());
  EXPECT_EQ(got["params"]["routed_experts"].get<int64_t>(), want["routed_experts"].get<int64_t>());
  EXPECT_EQ(got["layers"]["moe"].get<int>(), 58);
  EXPECT_EQ(got["layers"]["dense"].get<int>(), 3);
  // The brief's bound: 58 MoE layers x 8 experts x 3 x 7168 x 2048 weights per token.
  const double weights_per_token = 58.0 * 8 * 3 * 7168 * 2048;
  EXPECT_DOUBLE_EQ(got["formats"]["bf16"]["bytes_per_token"].get<double>(), weights_per_token * 2);
  // int4 group 64 with f32 scales: 0.5625 B/weight -> 11.5 GB per token.
  EXPECT_NEAR(got["formats"]["int4g64"]["bytes_per_token"].get<double>(),
              weights_per_token * 0.5625, 1.0);
  EXPECT_NEAR(got["formats"]["int4g64"]["decode_ceiling_tok_s"].get<double>(),
              92e9 / (weights_per_token * 0.5625), 1e-9);
  // Human-readable form carries the same facts.
  opt.json = false;
  const std::string text = FormatReport(*r, opt);
  EXPECT_THAT(text, HasSubstr("671,026,404,352"));
  EXPECT_THAT(text, HasSubstr("3 dense MLP + 58 MoE"));
  EXPECT_THAT(text, HasSubstr("none (config.json only)"));
}

// Kimi-K2 and GLM-4.5's published configs: the counts are transformers',
// the layers and attention as published.
TEST(Inspect, KimiK2AndGlm45) {
  const std::string configs = testing::FixturesDir() + "/configs";
  const json counts = json::parse(std::ifstream(configs + "/param_counts.json"));
  struct Case {
    const char* name;
    int dense, moe;
    const char* attention;  // in the text report
  };
  for (const Case& c :
       {Case{"kimi_k2_published", 1, 60, "MLA, 64 heads"},
        Case{"glm4_5_published", 3, 89,
             "GQA, 96 heads / 8 kv heads, head_dim 128, q/k norm, rope on 64 dims"}}) {
    SCOPED_TRACE(c.name);
    InspectOptions opt;
    opt.json = true;
    auto r = InspectModel(configs + "/" + c.name, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    const json got = json::parse(FormatReport(*r, opt));
    for (const char* k : {"total", "active", "routed_experts"})
      EXPECT_EQ(got["params"][k].get<int64_t>(), counts[c.name][k].get<int64_t>()) << k;
    EXPECT_EQ(got["layers"]["dense"].get<int>(), c.dense);
    EXPECT_EQ(got["layers"]["moe"].get<int>(), c.moe);
    opt.json = false;
    EXPECT_THAT(FormatReport(*r, opt), HasSubstr(c.attention));
  }
}

// DeepSeek-V4's published configs: transformers' counts, every layer MoE,
// the attention kinds, mHC, hash layers and the MTP layer (loaded, not run).
TEST(Inspect, DeepseekV4FlashAndPro) {
  const std::string configs = testing::FixturesDir() + "/configs";
  const json counts = json::parse(std::ifstream(configs + "/param_counts.json"));
  struct Case {
    const char* name;
    int layers;
    const char* kinds;  // in the text report
  };
  for (const Case& c : {Case{"deepseek_v4_flash_published", 43,
                             "0 sliding only, 20 csa (4:1 compressed, indexer 64 "
                             "heads x 128, top 512), 23 hca (128:1 compressed)"},
                        Case{"deepseek_v4_pro_published", 61,
                             "29 csa (4:1 compressed, indexer 64 heads x 128, "
                             "top 1024), 32 hca"}}) {
    SCOPED_TRACE(c.name);
    InspectOptions opt;
    opt.json = true;
    auto r = InspectModel(configs + "/" + c.name, opt);
    ASSERT_TRUE(r.ok()) << r.status();
    const json got = json::parse(FormatReport(*r, opt));
    for (const char* k : {"total", "active", "routed_experts"})
      EXPECT_EQ(got["params"][k].get<int64_t>(), counts[c.name][k].get<int64_t>()) << k;
    EXPECT_EQ(got["layers"]["dense"].get<int>(), 0);
    EXPECT_EQ(got["layers"]["moe"].get<int>(), c.layers);
    opt.json = false;
    const std::string text = FormatReport(*r, opt);
    EXPECT_THAT(text, HasSubstr(c.kinds));
    EXPECT_THAT(text, HasSubstr("(+1 MTP, not counted; its tensors load and are not run)"));
    EXPECT_THAT(text, HasSubstr("mHC, 4 streams, Sinkhorn 20 iterations"));
    EXPECT_THAT(text, HasSubstr("3 hash layers (tid2eid)"));
    EXPECT_THAT(text, HasSubstr("compress rope  yarn, theta 160000, factor 16, original 65536"));
  }
}

// A DSA model's attention line names its lightning indexer.
TEST(Inspect, NamesTheDsaIndexer) {
  InspectOptions opt;
  auto r = InspectModel(testing::FixturesDir() + "/deepseek_v32_tiny", opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(FormatReport(*r, opt), HasSubstr("; DSA indexer 16 heads x 24, top 16 keys"));
  r = InspectModel(testing::FixturesDir() + "/deepseek_v3_tiny", opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(FormatReport(*r, opt), ::testing::Not(HasSubstr("DSA")));
}

// A checkpoint whose routed experts ship quantized: its format is named,
// with its bytes per token (what `hmoe convert` keeps by default).
TEST(Inspect, NamesTheFormatARoutedExpertCheckpointShips) {
  const std::string configs = testing::FixturesDir() + "/configs";
  json base = json::parse(std::ifstream(configs + "/deepseek_v3_default/config.json"));
  const double weights_per_token = 58.0 * 8 * 3 * 7168 * 2048;
  struct Case {
    const char* quant;
    std::string format;
    double bytes_per_weight;
  };
  const Case cases[] = {
      {R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int",
             "symmetric": true, "strategy": "group", "group_size": 32}}}})",
       "int4bf16g32", 0.5625},
      {R"({"quant_method": "mxfp4"})", "mxfp4", 0.53125},
      {R"({"quant_method": "fp8", "weight_block_size": [128, 128]})", "fp8", 1.0 + 4.0 / 16384},
      {R"({"quant_method": "mxfp8"})", "mxfp8", 1.03125},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.format);
    testing::TempDir dir;
    json j = base;
    j["quantization_config"] = json::parse(c.quant);
    std::ofstream(dir.file("config.json")) << j.dump();
    InspectOptions opt;
    opt.json = true;
    auto r = InspectModel(dir.path(), opt);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->expert_format, c.format);
    json got = json::parse(FormatReport(*r, opt));
    EXPECT_EQ(got["expert_format"], c.format);
    EXPECT_NEAR(got["formats"][c.format]["bytes_per_token"].get<double>(),
                weights_per_token * c.bytes_per_weight, 1.0);
    opt.json = false;
    const std::string text = FormatReport(*r, opt);
    EXPECT_THAT(text, HasSubstr("; routed experts " + c.format));
    EXPECT_THAT(text, HasSubstr("(the checkpoint's)"));
  }
}

TEST(Inspect, ChecksTheCheckpointWhenPresent) {
  InspectOptions opt;
  auto r = InspectModel(testing::FixturesDir() + "/mixtral_tiny", opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->has_checkpoint);
  EXPECT_EQ(r->weight_check, "ok");
  EXPECT_GT(r->checkpoint_tensors, 0);
  EXPECT_THAT(FormatReport(*r, opt), HasSubstr("weight map     ok"));
}

TEST(Inspect, ReportsABrokenCheckpoint) {
  testing::TempDir dir;
  std::ofstream(dir.file("config.json"))
      << std::ifstream(testing::FixturesDir() + "/qwen3_moe_tiny/config.json").rdbuf();
  SafetensorsWriter w;
  float x = 0;
  ASSERT_TRUE(w.Add("model.norm.weight", DType::kF32, {1}, &x, 4).ok());
  ASSERT_TRUE(w.Write(dir.file("model.safetensors")).ok());
  auto r = InspectModel(dir.path(), InspectOptions{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->weight_check, HasSubstr("missing tensor(s): model.embed_tokens.weight"));
  EXPECT_THAT(r->weight_check, HasSubstr("model.norm.weight has shape [1]"));
}

// --gpu-mem-gb: the worker's memory plan, in the text and the JSON, on a
// published config without a checkpoint (the issue's 24 GiB / 128K target).
TEST(Inspect, GpuMemoryPlan) {
  const std::string dir = testing::FixturesDir() + "/configs/deepseek_v3_published";
  InspectOptions opt;
  opt.plan.gpu_mem_gb = 24;
  opt.plan.context = 131072;
  opt.plan.kv_dtype = KvDtype::kFp8;
  auto r = InspectModel(dir, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->plan.has_value());
  EXPECT_TRUE(r->plan->fits) << r->plan->message;
  const std::string text = FormatReport(*r, opt);
  EXPECT_THAT(text, HasSubstr("GPU memory plan"));
  EXPECT_THAT(text, HasSubstr("attention (mla)"));
  EXPECT_THAT(text, HasSubstr("KV cache (8192 blocks of 16 tokens)"));
  EXPECT_THAT(text, HasSubstr("verdict        fits: weights fp8"));
  opt.json = true;
  const json j = json::parse(FormatReport(*r, opt));
  EXPECT_TRUE(j["gpu_plan"]["fits"].get<bool>());
  EXPECT_EQ(j["gpu_plan"]["weights"], "fp8");
  EXPECT_EQ(j["gpu_plan"]["kv_dtype"], "fp8");
  EXPECT_EQ(j["gpu_plan"]["kv_bytes"].get<int64_t>(), int64_t{131072} * 61 * (576 + 8));
  int64_t sum = 0;
  for (const json& part : j["gpu_plan"]["parts"])
    if (part["on_gpu"].get<bool>()) sum += part["bytes"].get<int64_t>();
  EXPECT_EQ(sum, j["gpu_plan"]["total_bytes"].get<int64_t>());
  // Without --gpu-mem-gb: no plan.
  InspectOptions none;
  none.json = true;
  r = InspectModel(dir, none);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(json::parse(FormatReport(*r, none)).contains("gpu_plan"));
  // A bad plan request is the inspect's error.
  opt.plan.context = -1;
  EXPECT_EQ(InspectModel(dir, opt).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Inspect, Errors) {
  InspectOptions bad;
  bad.dram_gbps = 0;
  EXPECT_EQ(InspectModel(testing::FixturesDir() + "/mixtral_tiny", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(InspectModel("/nonexistent/model", InspectOptions{}).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace hmoe
