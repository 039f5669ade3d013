// The GPU memory plan (gpu_worker/memory_plan.h) on published configs: its
// parameter counts against CountParameters, bytes per format, the KV cache,
// monotonicity, the auto format order, the smallest-change messages and bad
// requests. The plan's agreement with what the CUDA backend allocates is
// tests/cuda/memory_plan_cuda_test.cc's.
#include "gpu_worker/memory_plan.h"

#include <cmath>
#include <limits>

#include "common/weight_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

ModelConfig Config(const std::string& name) {
  auto c = LoadModelConfig(testing::FixturesDir() + "/configs/" + name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

int64_t PartParams(const MemoryPlan& p, const std::string& prefix) {
  int64_t n = 0;
  for (const PlanPart& part : p.parts)
    if (part.name.rfind(prefix, 0) == 0) n += part.params;
  return n;
}
int64_t PartBytes(const MemoryPlan& p, const std::string& prefix) {
  int64_t n = 0;
  for (const PlanPart& part : p.parts)
    if (part.name.rfind(prefix, 0) == 0) n += part.bytes;
  return n;
}

MemoryPlan Plan(const ModelConfig& c, const PlanRequest& r) {
  auto p = PlanGpuMemory(c, r);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : MemoryPlan{};
}

TEST(MemoryPlan, DeepseekV3PartsAreInspectsCounts) {
  const ModelConfig c = Config("deepseek_v3_published");
  const ParamCounts want = CountParameters(c);
  PlanRequest r;
  r.gpu_mem_gb = 80;
  r.context = 4096;
  r.weights = DenseWeights::kBf16;
  const MemoryPlan p = Plan(c, r);
  EXPECT_EQ(PartParams(p, "attention"), want.attention);
  EXPECT_EQ(PartParams(p, "dense MLPs"), want.dense_mlp);
  EXPECT_EQ(PartParams(p, "shared experts"), want.shared_experts);
  EXPECT_EQ(PartParams(p, "router"), want.router);
  EXPECT_EQ(PartParams(p, "embedding") + PartParams(p, "LM head"), want.embedding);
  EXPECT_EQ(PartParams(p, "norms"), want.norms);
  // The issue's figures: attention 11.41 B, dense MLP 1.19 B, shared experts
  // 2.55 B, router 0.11 B, embeddings + LM head 1.85 B.
  EXPECT_NEAR(static_cast<double>(want.attention) / 1e9, 11.41, 0.005);
  EXPECT_NEAR(static_cast<double>(want.dense_mlp) / 1e9, 1.19, 0.005);
  EXPECT_NEAR(static_cast<double>(want.shared_experts) / 1e9, 2.55, 0.005);
  EXPECT_NEAR(static_cast<double>(want.router) / 1e9, 0.11, 0.005);
  EXPECT_NEAR(static_cast<double>(want.embedding) / 1e9, 1.85, 0.005);
  // bf16: two bytes a weight (no biases); the router an f32 copy plus its
  // correction bias; norms f32.
  EXPECT_EQ(PartBytes(p, "attention"), 2 * want.attention);
  EXPECT_EQ(PartBytes(p, "dense MLPs"), 2 * want.dense_mlp);
  EXPECT_EQ(PartBytes(p, "embedding") + PartBytes(p, "LM head"), 2 * want.embedding);
  EXPECT_EQ(PartBytes(p, "router"), 4 * (want.router + 58 * 256));
  EXPECT_EQ(PartBytes(p, "norms"), 4 * want.norms);
  EXPECT_EQ(p.total_bytes, p.weight_bytes + p.kv_bytes + p.workspace_bytes);
  EXPECT_EQ(p.left_bytes, p.limit_bytes - p.total_bytes);
}

TEST(MemoryPlan, BytesPerFormat) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.gpu_mem_gb = 80;
  r.context = 4096;
  r.weights = DenseWeights::kBf16;
  const int64_t dense = Plan(c, r).parts.size() ? PartBytes(Plan(c, r), "dense MLPs") : 0;
  r.weights = DenseWeights::kFp8;
  const MemoryPlan fp8 = Plan(c, r);
  r.weights = DenseWeights::kInt8;
  const MemoryPlan int8 = Plan(c, r);
  r.weights = DenseWeights::kInt4;
  const MemoryPlan int4 = Plan(c, r);
  // Dense MLPs: 3 layers of gate, up [18432, 7168] and down [7168, 18432].
  const int64_t I = 18432, H = 7168;
  EXPECT_EQ(dense, 3 * 3 * I * H * 2);
  EXPECT_EQ(PartBytes(fp8, "dense MLPs"),
            3 * (2 * (I * H + (I / 128) * (H / 128) * 4) + (H * I + (H / 128) * (I / 128) * 4)));
  EXPECT_EQ(PartBytes(int8, "dense MLPs"), 3 * (2 * (I * H + I * 4) + (H * I + H * 4)));
  EXPECT_EQ(PartBytes(int4, "dense MLPs"),
            3 * (2 * (I * H / 2 + I * (H / 128) * 4) + (H * I / 2 + H * (I / 128) * 4)));
  // The router and norms stay f32, the embedding bf16, whatever the format.
  EXPECT_EQ(PartBytes(int4, "router"), PartBytes(fp8, "router"));
  EXPECT_EQ(PartBytes(int4, "embedding"), int64_t{129280} * H * 2);
  EXPECT_LT(int4.weight_bytes, fp8.weight_bytes);
  EXPECT_LT(fp8.weight_bytes, int8.weight_bytes);  // per-row scales vs 128x128 blocks
}

TEST(MemoryPlan, KvCacheInWholeBlocks) {
  const ModelConfig c = Config("deepseek_v3_published");
  // MLA: 512 latent + 64 rope values per token per layer, 61 layers.
  EXPECT_EQ(*KvBytesPerToken(c, KvDtype::kF32), 61 * 576 * 4);
  EXPECT_EQ(*KvBytesPerToken(c, KvDtype::kBf16), 61 * 576 * 2);
  EXPECT_EQ(*KvBytesPerToken(c, KvDtype::kFp8), 61 * (576 + 2 * 4));  // a scale per part
  PlanRequest r;
  r.gpu_mem_gb = 200;
  r.context = 1000;  // 63 blocks of 16
  r.batch = 3;
  r.kv_dtype = KvDtype::kBf16;
  const MemoryPlan p = Plan(c, r);
  EXPECT_EQ(p.kv_blocks, 3 * 63);
  EXPECT_EQ(p.kv_bytes, 3 * 63 * 16 * 61 * 576 * 2);
  // GQA: each kv head's key and value rows, fp8 with a scale per head and part.
  const ModelConfig q = Config("qwen3_30b_a3b");
  EXPECT_EQ(*KvBytesPerToken(q, KvDtype::kFp8),
            q.num_layers * 2 * q.num_kv_heads * (q.head_dim + 4));
  EXPECT_EQ(*KvBytesPerToken(q, KvDtype::kF32), q.num_layers * 2 * q.num_kv_heads * q.head_dim * 4);
}

TEST(MemoryPlan, MonotonicInContextAndBatch) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.gpu_mem_gb = 40;
  r.weights = DenseWeights::kFp8;
  int64_t last = 0;
  for (int64_t ctx : {1, 16, 17, 4096, 32768, 131072}) {
    r.context = ctx;
    const MemoryPlan p = Plan(c, r);
    EXPECT_GE(p.total_bytes, last) << ctx;
    last = p.total_bytes;
  }
  last = 0;
  r.context = 8192;
  for (int64_t b : {1, 2, 5, 16}) {
    r.batch = b;
    const MemoryPlan p = Plan(c, r);
    EXPECT_GT(p.total_bytes, last) << b;
    last = p.total_bytes;
  }
}

TEST(MemoryPlan, MaxContextIsTheLargestThatFits) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.gpu_mem_gb = 20;
  r.weights = DenseWeights::kFp8;
  r.kv_dtype = KvDtype::kBf16;
  r.context = 163840;
  const MemoryPlan p = Plan(c, r);
  ASSERT_FALSE(p.fits);
  ASSERT_GT(p.max_context, 0);
  EXPECT_EQ(p.max_context % kKvBlockTokens, 0);
  r.context = p.max_context;
  EXPECT_TRUE(Plan(c, r).fits);
  r.context = p.max_context + kKvBlockTokens;
  EXPECT_FALSE(Plan(c, r).fits);
  EXPECT_THAT(p.message,
              HasSubstr(absl::StrCat("a context of at most ", p.max_context, " tokens")));
}

TEST(MemoryPlan, AutoLowersOnlyAsFarAsNeeded) {
  // A bf16 checkpoint (the default config) goes bf16 -> fp8 -> int4.
  const ModelConfig c = Config("deepseek_v3_default");
  ASSERT_TRUE(c.quantization.method.empty());
  PlanRequest r;
  r.context = 4096;
  r.kv_dtype = KvDtype::kBf16;
  r.gpu_mem_gb = 80;
  EXPECT_EQ(Plan(c, r).weights, DenseWeights::kBf16);
  r.gpu_mem_gb = 24;
  EXPECT_EQ(Plan(c, r).weights, DenseWeights::kFp8);
  r.gpu_mem_gb = 14;
  EXPECT_EQ(Plan(c, r).weights, DenseWeights::kInt4);
  EXPECT_TRUE(Plan(c, r).fits);
  // Too small for any: the least memory is planned, and it says so.
  r.gpu_mem_gb = 4;
  const MemoryPlan none = Plan(c, r);
  EXPECT_FALSE(none.fits);
  EXPECT_EQ(none.weights, DenseWeights::kInt4);
  // An fp8 checkpoint never goes up to bf16.
  const ModelConfig f = Config("deepseek_v3_published");
  r.gpu_mem_gb = 200;
  EXPECT_EQ(Plan(f, r).weights, DenseWeights::kFp8);
  // The embedding in host memory comes before a lower format when allowed
  // (fp8 as stored: 18.92 GiB of weights with the embedding, 17.19 without).
  r.gpu_mem_gb = 18.5;
  r.host_embedding = false;
  EXPECT_EQ(Plan(f, r).weights, DenseWeights::kInt4);
  r.host_embedding = true;
  const MemoryPlan host = Plan(f, r);
  EXPECT_EQ(host.weights, DenseWeights::kFp8);
  EXPECT_TRUE(host.host_embedding);
  EXPECT_TRUE(host.fits);
  // An order limited to what a backend loads.
  r.auto_order = {DenseWeights::kBf16};
  EXPECT_EQ(Plan(f, r).weights, DenseWeights::kBf16);
}

TEST(MemoryPlan, SmallestChangeMessages) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.gpu_mem_gb = 24;
  r.context = 32768;
  r.weights = DenseWeights::kBf16;
  r.kv_dtype = KvDtype::kF32;
  MemoryPlan p = Plan(c, r);
  EXPECT_FALSE(p.fits);
  EXPECT_THAT(p.message, HasSubstr("does not fit: weights bf16"));
  EXPECT_THAT(p.message, HasSubstr("the smallest change: fp8 weights (--gpu-weights fp8)"));
  ASSERT_FALSE(p.changes.empty());
  // Each change it names does fit.
  r.weights = DenseWeights::kFp8;
  EXPECT_TRUE(Plan(c, r).fits);
  // A KV cache too large: the KV dtypes first.
  r.context = 65536;
  p = Plan(c, r);
  EXPECT_FALSE(p.fits);
  EXPECT_EQ(p.changes.front(), "a bf16 KV cache (--kv-dtype bf16)");
  EXPECT_THAT(p.message, HasSubstr("an fp8 KV cache (--kv-dtype fp8)"));
  // Nothing single fits: the combination and its context.
  r.gpu_mem_gb = 12;
  r.weights = DenseWeights::kBf16;
  p = Plan(c, r);
  EXPECT_FALSE(p.fits);
  EXPECT_THAT(p.message, HasSubstr("no single change fits: int4 weights, an fp8 KV cache"));
  // Nothing fits at all.
  r.gpu_mem_gb = 2;
  p = Plan(c, r);
  EXPECT_THAT(p.message, HasSubstr("nothing fits"));
  EXPECT_EQ(p.max_context, 0);
}

TEST(MemoryPlan, TheIssuesTargetsFit) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.kv_dtype = KvDtype::kFp8;
  r.gpu_mem_gb = 24;
  r.context = 131072;
  const MemoryPlan big = Plan(c, r);
  EXPECT_TRUE(big.fits) << big.message;
  r.gpu_mem_gb = 16;
  r.context = 32768;
  const MemoryPlan small = Plan(c, r);
  EXPECT_TRUE(small.fits) << small.message;
  EXPECT_THAT(FormatPlan(small), HasSubstr("fits: weights"));
}

TEST(MemoryPlan, HotExpertsFillWhatIsLeft) {
  const ModelConfig c = Config("deepseek_v3_published");
  PlanRequest r;
  r.gpu_mem_gb = 40;
  r.context = 4096;
  r.weights = DenseWeights::kFp8;
  r.fill_hot_experts = true;
  r.hot_format = WeightFormat::kInt4;
  r.hot_group = 64;
  const MemoryPlan p = Plan(c, r);
  ASSERT_TRUE(p.fits);
  // 7168 x 2048 x 3 weights at int4 g64 (0.5 + 4 / 64 bytes each).
  EXPECT_EQ(p.hot_expert_bytes, 3 * (2048 * 7168 / 2 + 2048 * 7168 / 64 * 4));
  EXPECT_GT(p.hot_experts_fit, 0);
  EXPECT_LE(p.hot_experts_fit * p.hot_expert_bytes, p.left_bytes);
  EXPECT_GT((p.hot_experts_fit + 2) * p.hot_expert_bytes, p.left_bytes);
  // A placement already made counts in the total.
  Placement placed;
  placed.num_hot = 10;
  placed.hot[3] = {0, 1, 2, 3, 4};
  placed.hot[4] = {0, 1, 2, 3, 4};
  r.hot_experts = &placed;
  const MemoryPlan q = Plan(c, r);
  EXPECT_GT(q.hot_bytes, 10 * p.hot_expert_bytes);
  EXPECT_EQ(q.total_bytes, p.total_bytes + q.hot_bytes);
}

// What the CUDA backend plans with (PlanCudaBackend): kv_sequences of
// max_seq_len, or as many whole sequences as fit; refused with the plan's
// message when not one does, or when explicit kv_blocks do not fit.
TEST(MemoryPlan, CudaBackendsPlan) {
  const ModelConfig c = Config("deepseek_v3_published");
  ModelOptions o;
  o.kv_dtype = KvDtype::kF32;  // the sizes below are the f32 cache's
  o.max_seq_len = 32768;
  o.cuda.kv_sequences = 16;
  const int64_t gib = int64_t{1} << 30;
  // 80 GiB: 16 sequences of 32K tokens of f32 KV (4.29 GiB each) do not fit
  // beside 32 GiB of bf16 weights; fewer whole sequences do.
  auto p = PlanCudaBackend(c, o, 80 * gib, {DenseWeights::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits);
  EXPECT_EQ(p->weights, DenseWeights::kBf16);  // auto among what the backend loads
  EXPECT_GT(p->batch, 1);
  EXPECT_LT(p->batch, 16);
  EXPECT_EQ(p->kv_blocks, p->batch * 2048);
  PlanRequest r = PlanRequestFor(c, o, 80 * gib, {DenseWeights::kBf16});
  r.batch = p->batch + 1;
  EXPECT_FALSE(PlanGpuMemory(c, r)->fits);
  // Room for all 16 at 8K tokens each.
  o.max_seq_len = 8192;
  p = PlanCudaBackend(c, o, 80 * gib, {DenseWeights::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->batch, 16);
  EXPECT_EQ(p->kv_blocks, 16 * 512);
  // Not one sequence: the plan's message, naming the smallest change.
  p = PlanCudaBackend(c, o, 24 * gib, {DenseWeights::kBf16});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(p.status().message(), HasSubstr("GPU memory plan: does not fit: weights bf16"));
  EXPECT_THAT(p.status().message(), HasSubstr("the smallest change: "));
  // Explicit blocks are not shrunk.
  o.cuda.kv_blocks = 1 << 24;
  p = PlanCudaBackend(c, o, 80 * gib, {DenseWeights::kBf16});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  // Streamed experts: passes of prefill_stream_tokens, the prefetch stage
  // only where it fits.
  o.cuda.kv_blocks = 0;
  o.cuda.prefill_experts = PrefillExperts::kStream;
  o.cuda.hot_format = WeightFormat::kInt4;
  o.cuda.hot_group = 64;
  o.cuda.prefill_stream_tokens = 4096;
  p = PlanCudaBackend(c, o, 80 * gib, {DenseWeights::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->pass_tokens, 4096);
  EXPECT_TRUE(p->prefetch_stage);
  EXPECT_GT(PartBytes(*p, "streamed experts (one layer)"),
            256 * PlanGpuMemory(c, PlanRequestFor(c, o, 80 * gib, {}))->hot_expert_bytes);
  o.deferred_experts = 1;  // no streamed experts with Expert Deferral
  p = PlanCudaBackend(c, o, 80 * gib, {DenseWeights::kBf16});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(PartBytes(*p, "streamed"), 0);
  EXPECT_EQ(p->pass_tokens, 256);
}

TEST(MemoryPlan, BadRequests) {
  const ModelConfig c = Config("deepseek_v3_published");
  auto code = [&](auto edit) {
    PlanRequest r;
    r.gpu_mem_gb = 24;
    r.context = 4096;
    edit(r);
    return PlanGpuMemory(c, r).status();
  };
  for (double gb : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    const absl::Status s = code([&](PlanRequest& r) { r.gpu_mem_gb = gb; });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << gb;
    EXPECT_THAT(s.message(), HasSubstr("--gpu-mem-gb"));
  }
  absl::Status s = code([](PlanRequest& r) { r.context = -5; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("-5"));
  s = code([](PlanRequest& r) { r.batch = 0; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("batch"));
  s = code([](PlanRequest& r) { r.pass_tokens = 0; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = code([](PlanRequest& r) {
    r.fill_hot_experts = true;
    r.hot_format = WeightFormat::kInt4;
    r.hot_group = 7;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
