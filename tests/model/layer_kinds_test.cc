// The per-layer kind tables: config -> attention / router / residual kind
// per layer, each kind's row (cache layout, gate), and unknown kinds
// rejected with the field or kind named.
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "gmock/gmock.h"
#include "gpu_worker/cpu/attention.h"
#include "gpu_worker/cpu/residual.h"
#include "gpu_worker/driver/attention.h"
#include "gpu_worker/driver/residual.h"
#include "gpu_worker/driver/routing.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

ModelConfig Load(const std::string& name) {
  auto c = LoadModelConfig(testing::FixturesDir() + "/configs/" + name);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

TEST(LayerKinds, EachArchitectureResolvesItsKindsPerLayer) {
  struct Case {
    const char* config;
    AttentionKind attention;
    RouterKind router;
  };
  const Case cases[] = {
      {"deepseek_v3_published", AttentionKind::kMla, RouterKind::kSigmoidGroupedTopk},
      {"deepseek_v2_lite", AttentionKind::kMla, RouterKind::kSoftmaxTopk},
      {"qwen3_30b_a3b", AttentionKind::kGqa, RouterKind::kSoftmaxTopk},
      {"mixtral_8x7b", AttentionKind::kGqa, RouterKind::kSoftmaxTopk},
      {"glm4_5_published", AttentionKind::kGqa, RouterKind::kSigmoidGroupedTopk},
      {"kimi_k2_published", AttentionKind::kMla, RouterKind::kSigmoidGroupedTopk},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.config);
    const ModelConfig c = Load(k.config);
    ASSERT_EQ(static_cast<int64_t>(c.layers.size()), c.num_layers);
    EXPECT_EQ(c.residual, ResidualKind::kPlain);
    EXPECT_EQ(KindsOf(c.arch).attention, k.attention);
    EXPECT_EQ(KindsOf(c.arch).router, k.router);
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerSpec& layer = c.layers[static_cast<size_t>(l)];
      EXPECT_EQ(layer.attention, k.attention) << "layer " << l;
      EXPECT_EQ(layer.router, k.router) << "layer " << l;
      auto spec = AttentionSpecFor(c, l);
      ASSERT_TRUE(spec.ok()) << spec.status();
      EXPECT_EQ(spec->kind, k.attention);
      if (!layer.moe) continue;
      auto gate = GateSpecFor(c, l);
      ASSERT_TRUE(gate.ok()) << gate.status();
      EXPECT_EQ(gate->kind, k.router);
    }
  }
}

TEST(LayerKinds, MlaDsaCacheRowHoldsTheIndexerKey) {
  auto c = LoadModelConfig(testing::FixturesDir() + "/deepseek_v32_tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  auto spec = AttentionSpecFor(*c, 1);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, AttentionKind::kMlaDsa);
  // MLA's latent and roped key (what attention reads), then the indexer key:
  // counted in the bytes per token the cache is sized by.
  EXPECT_EQ(spec->dk, 32 + 16);
  EXPECT_EQ(spec->dv, 32);
  EXPECT_EQ(spec->cache.k_row, 32 + 16 + 24);
  EXPECT_EQ(spec->cache.v_row, 0);
  EXPECT_EQ(spec->cache.bytes_per_token(), 4 * (32 + 16 + 24));
  // Geometry as MLA's (interleaved, YaRN-corrected scale).
  ModelConfig mla = *c;
  for (LayerSpec& l : mla.layers) l.attention = AttentionKind::kMla;
  auto plain = AttentionSpecFor(mla, 1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(spec->geometry.softmax_scale, plain->geometry.softmax_scale);
  EXPECT_EQ(spec->geometry.rope_layout, RopeLayout::kInterleaved);
  EXPECT_EQ(spec->cache.k_row, plain->cache.k_row + c->dsa.head_dim);
}

TEST(LayerKinds, AttentionSpecsLayOutTheCache) {
  const ModelConfig v3 = Load("deepseek_v3_published");
  auto mla = AttentionSpecFor(v3, 0);
  ASSERT_TRUE(mla.ok()) << mla.status();
  // The normed latent, then the roped shared key; no value rows.
  EXPECT_EQ(mla->cache.k_row, v3.mla.kv_lora_rank + v3.mla.qk_rope_head_dim);
  EXPECT_EQ(mla->cache.v_row, 0);
  EXPECT_EQ(mla->cache.bytes_per_token(), 4 * (512 + 64));
  EXPECT_EQ(mla->num_kv_heads, 1);
  EXPECT_EQ(mla->dk, mla->cache.k_row);
  EXPECT_EQ(mla->dv, v3.mla.kv_lora_rank);
  EXPECT_EQ(mla->geometry.rope_dim, v3.mla.qk_rope_head_dim);
  const AttentionGeometry g = AttentionGeometryFor(v3);
  EXPECT_EQ(g.rope_dim, mla->geometry.rope_dim);
  EXPECT_EQ(g.softmax_scale, mla->geometry.softmax_scale);

  json j;
  {
    std::ifstream in(testing::FixturesDir() + "/configs/qwen3_30b_a3b/config.json");
    j = json::parse(in);
  }
  j["num_hidden_layers"] = 3;
  j["sliding_window"] = 64;
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  auto q = ParseModelConfig(j.dump(), "q");
  ASSERT_TRUE(q.ok()) << q.status();
  for (int l = 0; l < 3; ++l) {
    auto gqa = AttentionSpecFor(*q, l);
    ASSERT_TRUE(gqa.ok()) << gqa.status();
    // num_kv_heads keys of head_dim, as many values.
    EXPECT_EQ(gqa->cache.k_row, q->num_kv_heads * q->head_dim);
    EXPECT_EQ(gqa->cache.v_row, gqa->cache.k_row);
    EXPECT_EQ(gqa->num_kv_heads, q->num_kv_heads);
    EXPECT_EQ(gqa->dk, q->head_dim);
    EXPECT_EQ(gqa->k_head_offset, q->head_dim);
    EXPECT_EQ(gqa->window, l == 1 ? 64 : 0);
    EXPECT_EQ(gqa->geometry.rope_dim, q->head_dim);  // every dim rotated
    EXPECT_TRUE(gqa->qk_norm);
  }
  // GLM-4.5: RoPE on the first half of each head, q/k norm; the cache as any GQA's.
  const ModelConfig glm = Load("glm4_5_published");
  auto g45 = AttentionSpecFor(glm, 3);
  ASSERT_TRUE(g45.ok()) << g45.status();
  EXPECT_EQ(g45->dk, 128);
  EXPECT_EQ(g45->geometry.rope_dim, 64);
  EXPECT_EQ(g45->geometry.rope_layout, RopeLayout::kHalves);
  EXPECT_FLOAT_EQ(g45->geometry.softmax_scale, 1.0f / std::sqrt(128.0f));  // the whole head's
  EXPECT_TRUE(g45->qk_norm);
  EXPECT_EQ(g45->cache.k_row, 8 * 128);
  EXPECT_EQ(AttentionGeometryFor(glm).rope_dim, 64);
  const ModelConfig mix = Load("mixtral_8x7b");
  EXPECT_FALSE(AttentionSpecFor(mix, 0)->qk_norm);
}

TEST(LayerKinds, GatePerLayerIsTheArchitecturesGate) {
  for (const char* name :
       {"deepseek_v3_published", "deepseek_v2_lite", "qwen3_30b_a3b", "glm4_5_published"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = Load(name);
    const GateSpec whole = GateSpecFor(c);
    for (int32_t l : c.moe_layer_indices()) {
      auto g = GateSpecFor(c, l);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->kind, whole.kind);
      EXPECT_EQ(g->num_experts, whole.num_experts);
      EXPECT_EQ(g->top_k, whole.top_k);
      EXPECT_EQ(g->method, whole.method);
      EXPECT_EQ(g->n_group, whole.n_group);
      EXPECT_EQ(g->topk_group, whole.topk_group);
      EXPECT_EQ(g->norm_topk_prob, whole.norm_topk_prob);
      EXPECT_EQ(g->norm_eps, whole.norm_eps);
      EXPECT_EQ(g->routed_scaling_factor, whole.routed_scaling_factor);
    }
  }
}

TEST(LayerKinds, UnknownLayerTypeIsUnimplementedNamingTheEntry) {
  std::ifstream in(testing::FixturesDir() + "/configs/qwen3_30b_a3b/config.json");
  json j = json::parse(in);
  j["num_hidden_layers"] = 2;
  j["layer_types"] = {"full_attention", "linear_attention"};
  auto c = ParseModelConfig(j.dump(), "x/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("\"layer_types[1]\""));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("linear_attention"));
}

TEST(LayerKinds, KindsWithoutAnImplementationAreUnimplemented) {
  const auto bad_attention = static_cast<AttentionKind>(99);
  const auto bad_router = static_cast<RouterKind>(99);
  const auto bad_residual = static_cast<ResidualKind>(99);
  EXPECT_EQ(AttentionKindOpsFor(bad_attention).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(RouterOpsFor(bad_router).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(AttentionKindOpsFor(AttentionKind::kMla).ok());
  EXPECT_TRUE(AttentionKindOpsFor(AttentionKind::kGqa).ok());
  EXPECT_TRUE(RouterOpsFor(RouterKind::kSoftmaxTopk).ok());
  EXPECT_TRUE(RouterOpsFor(RouterKind::kSigmoidGroupedTopk).ok());

  // A layer of an unknown kind: the layer is named.
  ModelConfig c = Load("qwen3_30b_a3b");
  ASSERT_GT(c.layers.size(), 5u);
  c.layers[3].attention = bad_attention;
  c.layers[5].router = bad_router;
  auto a = AttentionSpecFor(c, 3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("layer 3"));
  auto g = GateSpecFor(c, 5);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("layer 5"));
  EXPECT_EQ(AttentionSpecFor(c, c.num_layers).status().code(), absl::StatusCode::kInvalidArgument);

  c.residual = bad_residual;
  EXPECT_EQ(ResidualSpecFor(c).status().code(), absl::StatusCode::kUnimplemented);
  ResidualSpec rs;
  rs.kind = bad_residual;
  EXPECT_EQ(cpu::MakeResidual(rs, 8).status().code(), absl::StatusCode::kUnimplemented);
  AttentionSpec as;
  as.kind = bad_attention;
  EXPECT_EQ(cpu::MakeAttentionOp(c, as).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace hmoe
