// ModelOptions::kv_dtype on the reference backend: bf16 and fp8 KV caches
// against the f32 cache, for every fixture (MLA, MLA-DSA, GQA), over enough
// tokens to span several 16-token blocks.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

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
