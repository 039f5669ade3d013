// ModelOptions::kv_dtype on the reference backend: bf16 and fp8 KV caches
// against the f32 cache, for every fixture (MLA, MLA-DSA, GQA), over enough
// tokens to span several 16-token blocks.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/kv_quant.h"
#include "common/runtime/thread_pool.h"
#include "gpu_worker/cpu/attention.h"
#include "gpu_worker/driver/attention.h"
#include "gpu_worker/driver/weight_names.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

using testing::LoadReference;
using testing::MaxScaledDiff;
using testing::ModelFixtureNames;
using testing::ModelFixturesRoot;
using testing::PrefillThenDecode;

// Bounds on a pass's max |logit - f32 cache's logit| / max |f32 cache's
// logit|. A cache value's error is at most u = 2^-9 of it in bf16 and, in
// fp8, half an e4m3 step at the part's scale: up to 16/448 of the part's
// largest magnitude. Attention averages these errors over keys and the
// layers add them up; the bounds allow 4u (bf16) and 2u (fp8; e4m3's
// relative error is far below 16/448 for most values) on the median pass. A
// pass whose routing (MoE or DSA top-k) flips moves discontinuously, so the
// worst pass is only held below 1 (finite, not garbage).
constexpr double kBf16Bound = 4.0 / 512;
constexpr double kFp8Bound = 2.0 * 16 / 448;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::unique_ptr<Model> Load(const std::string& name, KvDtype kv) {
  ModelOptions opt;
  opt.num_threads = 2;
  opt.kv_dtype = kv;
  auto m = Model::Load(ModelFixturesRoot() + "/" + name, opt);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

class KvDtypeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(KvDtypeTest, RoundedCachesStayNearTheF32Cache) {
  const std::string name = GetParam();
  const auto ref = LoadReference(ModelFixturesRoot() + "/" + name);
  ASSERT_FALSE(ref.prompt.empty());
  // 40 prompt tokens and 12 decode steps: 52 positions, four blocks of 16.
  std::vector<int32_t> prompt;
  while (prompt.size() < 40) prompt.push_back(ref.prompt[prompt.size() % ref.prompt.size()]);
  std::vector<std::vector<std::vector<float>>> out;
  for (KvDtype kv : {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8}) {
    auto m = Load(name, kv);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->options().kv_dtype, kv);
    out.push_back(PrefillThenDecode(*m, prompt, 12));
    ASSERT_EQ(out.back().size(), 13u) << KvDtypeName(kv);
  }
  std::vector<double> bf16, fp8;
  for (size_t i = 0; i < out[0].size(); ++i) {
    bf16.push_back(MaxScaledDiff(out[1][i], out[0][i]));
    fp8.push_back(MaxScaledDiff(out[2][i], out[0][i]));
  }
  const double bf16_med = Median(bf16), fp8_med = Median(fp8);
  const double bf16_max = *std::max_element(bf16.begin(), bf16.end());
  const double fp8_max = *std::max_element(fp8.begin(), fp8.end());
  std::printf(
      "[ kv dtype ] %-22s max |logit diff| / max |logit| vs f32 KV, median (worst) pass: "
      "bf16 %.2e (%.2e), fp8 %.2e (%.2e)\n",
      name.c_str(), bf16_med, bf16_max, fp8_med, fp8_max);
  // The caches are really rounded: each dtype changes the logits, fp8 more.
  EXPECT_GT(bf16_med, 0.0) << name;
  EXPECT_GT(fp8_med, bf16_med) << name;
  EXPECT_LT(bf16_med, kBf16Bound) << name;
  EXPECT_LT(fp8_med, kFp8Bound) << name;
  EXPECT_LT(bf16_max, 1.0) << name;
  EXPECT_LT(fp8_max, 1.0) << name;
}

// A rounded cache is still exact between paths: a prefill in one pass and
// the same tokens one at a time store and read the same values.
TEST_P(KvDtypeTest, IncrementalEqualsOnePassWithAnFp8Cache) {
  const std::string name = GetParam();
  const auto ref = LoadReference(ModelFixturesRoot() + "/" + name);
  ASSERT_FALSE(ref.prompt.empty());
  std::vector<int32_t> prompt;
  while (prompt.size() < 20) prompt.push_back(ref.prompt[prompt.size() % ref.prompt.size()]);
  auto m = Load(name, KvDtype::kFp8);
  ASSERT_NE(m, nullptr);
  auto whole = m->NewSequence();
  auto a = m->Prefill(*whole, prompt, LogitsMode::kLast);
  ASSERT_TRUE(a.ok()) << a.status();
  auto steps = m->NewSequence();
  std::vector<float> b;
  for (int32_t t : prompt) {
    auto d = m->Forward(*steps, absl::MakeConstSpan(&t, 1), LogitsMode::kLast, &b);
    ASSERT_TRUE(d.ok()) << d;
  }
  EXPECT_LT(MaxScaledDiff(b, *a), 1e-5) << name;
}

// The attention op of layer 0 writes, per token, the f32 cache's row rounded
// part by part (MLA: the latent, the roped key; GQA: each kv head's key and
// value), each fp8 part with its own scale.
TEST(KvDtypeParts, OpsRoundEachPartOnItsOwn) {
  for (const std::string name : {"deepseek_v3_tiny", "qwen3_moe_tiny"}) {
    SCOPED_TRACE(name);
    const std::string dir = ModelFixturesRoot() + "/" + name;
    auto c = LoadModelConfig(dir);
    ASSERT_TRUE(c.ok()) << c.status();
    auto ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    auto spec = AttentionSpecFor(*c, 0);
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto op = cpu::MakeAttentionOp(*c, *spec);
    ASSERT_TRUE(op.ok()) << op.status();
    ASSERT_TRUE((*op)->Load(**ckpt, NamesForLayer(*c, 0), cpu::WeightLoad{128}).ok());
    ThreadPoolOptions po;
    po.max_threads = 2;
    po.per_core = false;
    auto pool = ThreadPool::Create(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    const int64_t T = 5, H = c->hidden_size, rd = spec->geometry.rope_dim;
    const int64_t kr = spec->cache.k_row, vr = spec->cache.v_row;
    std::vector<float> h(static_cast<size_t>(T * H));
    for (size_t i = 0; i < h.size(); ++i) h[i] = std::sin(0.7f * static_cast<float>(i)) * 3.0f;
    std::vector<int64_t> pos(T);
    std::vector<float> cs(static_cast<size_t>(T * rd));
    for (int64_t t = 0; t < T; ++t) {
      pos[t] = t;
      for (int64_t j = 0; j + 1 < rd; j += 2) {  // a rotation by 0.3 t per pair
        cs[t * rd + j] = std::cos(0.3f * t);
        cs[t * rd + j + 1] = std::sin(0.3f * t);
      }
    }
    std::vector<std::vector<float>> kc, vc;
    for (KvElem e : {KvElem::kF32, KvElem::kFp8}) {
      kc.emplace_back(static_cast<size_t>(T * kr), 0.0f);
      vc.emplace_back(static_cast<size_t>(T * std::max<int64_t>(vr, 1)), 0.0f);
      std::vector<float*> kp(T, kc.back().data()), vp(T, vr ? vc.back().data() : nullptr);
      std::vector<float> out(static_cast<size_t>(T * H));
      const cpu::AttentionPass p{.pool = pool->get(),
                                 .T = T,
                                 .pos = pos.data(),
                                 .max_pos = T - 1,
                                 .rope_cs = cs.data(),
                                 .k = kp.data(),
                                 .v = vp.data(),
                                 .kv = e};
      (*op)->Forward(p, h.data(), out.data());
    }
    // The f32 rows rounded by the parts the contract names.
    std::vector<float> kw = kc[0], vw = vc[0];
    for (int64_t t = 0; t < T; ++t) {
      if (spec->kind == AttentionKind::kMla) {
        KvRoundPart(KvElem::kFp8, kw.data() + t * kr, c->mla.kv_lora_rank);
        KvRoundPart(KvElem::kFp8, kw.data() + t * kr + c->mla.kv_lora_rank,
                    c->mla.qk_rope_head_dim);
      } else {
        for (int64_t g = 0; g < spec->num_kv_heads; ++g) {
          KvRoundPart(KvElem::kFp8, kw.data() + t * kr + g * spec->k_head_offset, spec->dk);
          KvRoundPart(KvElem::kFp8, vw.data() + t * vr + g * spec->v_head_offset, spec->dv);
        }
      }
    }
    EXPECT_EQ(kc[1], kw);
    EXPECT_EQ(vc[1], vw);
    EXPECT_NE(kc[1], kc[0]);
  }
}

std::string ParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, KvDtypeTest, ::testing::ValuesIn(ModelFixtureNames()),
                         ParamName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(KvDtypeTest);

TEST(KvDtypeOptions, DefaultIsBf16) { EXPECT_EQ(ModelOptions().kv_dtype, KvDtype::kBf16); }

}  // namespace
}  // namespace hmoe
