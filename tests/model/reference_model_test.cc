// The CPU reference model against transformers' logits, for every fixture
// directory (tests/fixtures/*, or $HMOE_FIXTURES_DIR/*) with reference.safetensors.
#include <cstdio>
#include <map>
#include <memory>

#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

using testing::ArgMax;
using testing::LoadReference;
using testing::ModelFixtureNames;
using testing::ModelFixturesRoot;
using testing::ReferenceOutputs;
using testing::RelErr;

constexpr double kTolerance = 1e-3;  // vs transformers (fp32 math, other summation orders)
constexpr double kSelfTolerance =
    1e-6;  // incremental vs full recompute (bit-identical in practice)

// `kv`: the KV cache's element type; transformers' logits are compared with
// the f32 cache's (a rounded cache moves them past kTolerance; its own bounds
// are kv_dtype_model_test.cc's), the paths' agreement with the default's.
const Model& GetModel(const std::string& name, KvDtype kv = ModelOptions().kv_dtype) {
  static auto* models = new std::map<std::pair<std::string, KvDtype>, std::unique_ptr<Model>>;
  auto& m = (*models)[{name, kv}];
  if (!m) {
    ModelOptions opt;
    opt.num_threads = 2;
    opt.kv_dtype = kv;
    auto loaded = Model::Load(ModelFixturesRoot() + "/" + name, opt);
    if (!loaded.ok()) ADD_FAILURE() << loaded.status();
    if (!loaded.ok()) std::abort();
    m = std::move(*loaded);
  }
  return *m;
}

class FixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureTest, MatchesTransformers) {
  const std::string name = GetParam();
  const Model& model = GetModel(name, KvDtype::kF32);
  const ReferenceOutputs ref = LoadReference(ModelFixturesRoot() + "/" + name);
  const int64_t V = ref.vocab, P = static_cast<int64_t>(ref.prompt.size());
  const int64_t N = static_cast<int64_t>(ref.greedy.size());
  ASSERT_EQ(V, model.config().vocab_size);
  ASSERT_EQ(static_cast<int64_t>(ref.steps.size()), N * V);

  auto seq = model.NewSequence();
  auto prefill = model.Prefill(*seq, ref.prompt, LogitsMode::kAll);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_EQ(static_cast<int64_t>(prefill->size()), P * V);
  double prefill_err = 0;
  for (int64_t p = 0; p < P; ++p)
    prefill_err =
        std::max(prefill_err, RelErr(prefill->data() + p * V, ref.prefill.data() + p * V, V));

  double decode_err = 0;
  std::vector<float> step(prefill->end() - V, prefill->end());
  for (int64_t i = 0; i < N; ++i) {
    if (i > 0) {
      auto d = model.Decode(*seq, ref.greedy[i - 1]);
      ASSERT_TRUE(d.ok()) << d.status();
      step = *d;
    }
    decode_err = std::max(decode_err, RelErr(step.data(), ref.steps.data() + i * V, V));
    EXPECT_EQ(ArgMax(step.data(), V), ref.greedy[i]) << name << ": greedy step " << i;
  }
  EXPECT_EQ(seq->length(), P + N - 1);
  EXPECT_LT(prefill_err, kTolerance) << name;
  EXPECT_LT(decode_err, kTolerance) << name;
  RecordProperty("prefill_rel_err", std::to_string(prefill_err));
  RecordProperty("decode_rel_err", std::to_string(decode_err));
  std::printf("[ fixture  ] %-20s %-12s max abs err / max |logit|: prefill %.2e, decode %.2e\n",
              name.c_str(), model.config().model_type.c_str(), prefill_err, decode_err);
}

TEST_P(FixtureTest, IncrementalEqualsFullRecompute) {
  const std::string name = GetParam();
  const Model& model = GetModel(name);
  const ReferenceOutputs ref = LoadReference(ModelFixturesRoot() + "/" + name);
  const int64_t V = ref.vocab;
  std::vector<int32_t> all = ref.prompt;
  all.insert(all.end(), ref.greedy.begin(), ref.greedy.end() - 1);
  const int64_t T = static_cast<int64_t>(all.size()), P = static_cast<int64_t>(ref.prompt.size());

  auto full_seq = model.NewSequence();
  auto full = model.Prefill(*full_seq, all, LogitsMode::kAll);
  ASSERT_TRUE(full.ok()) << full.status();

  // Prompt prefill, then one token at a time.
  auto seq = model.NewSequence();
  auto pre = model.Prefill(*seq, absl::MakeConstSpan(all).subspan(0, P), LogitsMode::kAll);
  ASSERT_TRUE(pre.ok()) << pre.status();
  double err = RelErr(pre->data(), full->data(), P * V);
  for (int64_t t = P; t < T; ++t) {
    auto d = model.Decode(*seq, all[t]);
    ASSERT_TRUE(d.ok()) << d.status();
    err = std::max(err, RelErr(d->data(), full->data() + t * V, V));
  }
  // Uneven chunks, last-row logits only.
  auto chunked = model.NewSequence();
  for (int64_t t0 = 0; t0 < T;) {
    const int64_t n = std::min<int64_t>(T - t0, 1 + t0 % 5);
    auto c = model.Prefill(*chunked, absl::MakeConstSpan(all).subspan(t0, n), LogitsMode::kLast);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_EQ(static_cast<int64_t>(c->size()), V);
    t0 += n;
    err = std::max(err, RelErr(c->data(), full->data() + (t0 - 1) * V, V));
  }
  // A reset sequence starts over.
  seq->Reset();
  auto again = model.Prefill(*seq, all, LogitsMode::kAll);
  ASSERT_TRUE(again.ok()) << again.status();
  err = std::max(err, RelErr(again->data(), full->data(), T * V));
  EXPECT_LT(err, kSelfTolerance) << name;
  RecordProperty("incremental_vs_full_rel_err", std::to_string(err));
}

// Sequences holding the first `lens[i]` tokens of `all`, made by Prefill.
std::vector<std::unique_ptr<Sequence>> WithHistories(const Model& model,
                                                     const std::vector<int32_t>& all,
                                                     const std::vector<int64_t>& lens) {
  std::vector<std::unique_ptr<Sequence>> out;
  for (int64_t n : lens) {
    out.push_back(model.NewSequence());
    if (n > 0) {
      auto p = model.Prefill(*out.back(), absl::MakeConstSpan(all).subspan(0, n));
      EXPECT_TRUE(p.ok()) << p.status();
    }
  }
  return out;
}

// Three sequences at different points (a whole prompt from nothing with every
// row's logits, a chunk in the middle, one decode token), in one batch, get
// exactly what each gets alone, and their caches continue alike.
TEST_P(FixtureTest, ForwardBatchEqualsEachStepAlone) {
  const std::string name = GetParam();
  const Model& model = GetModel(name);
  const ReferenceOutputs ref = LoadReference(ModelFixturesRoot() + "/" + name);
  std::vector<int32_t> all = ref.prompt;
  all.insert(all.end(), ref.greedy.begin(), ref.greedy.end());
  const int64_t P = static_cast<int64_t>(ref.prompt.size());
  ASSERT_GE(P, 4);
  // Histories and the tokens each step appends.
  const std::vector<int64_t> lens = {P, 0, 2};
  const std::vector<std::pair<int64_t, int64_t>> spans = {{P, 1}, {0, P}, {2, P - 2}};
  const std::vector<LogitsMode> modes = {LogitsMode::kLast, LogitsMode::kAll, LogitsMode::kLast};
  auto alone = WithHistories(model, all, lens);
  auto batched = WithHistories(model, all, lens);
  std::vector<std::vector<float>> want(3), got(3);
  std::vector<ForwardStep> steps;
  for (size_t i = 0; i < 3; ++i) {
    const auto tokens = absl::MakeConstSpan(all).subspan(static_cast<size_t>(spans[i].first),
                                                         static_cast<size_t>(spans[i].second));
    ASSERT_TRUE(model.Forward(*alone[i], tokens, modes[i], &want[i]).ok());
    steps.push_back({batched[i].get(), tokens, modes[i], &got[i]});
  }
  ASSERT_TRUE(model.ForwardBatch(steps).ok());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(batched[i]->length(), alone[i]->length()) << i;
    EXPECT_EQ(got[i], want[i]) << name << ": step " << i;
    auto a = model.Decode(*alone[i], all[static_cast<size_t>(alone[i]->length())]);
    auto b = model.Decode(*batched[i], all[static_cast<size_t>(batched[i]->length())]);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*b, *a) << name << ": the decode after step " << i;
  }
}

std::string ParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureTest, ::testing::ValuesIn(ModelFixtureNames()),
                         ParamName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FixtureTest);

TEST(ModelFixtures, AllFamiliesPresent) {
  if (std::getenv("HMOE_FIXTURES_DIR")) GTEST_SKIP() << "custom fixtures dir";
  std::map<std::string, int> families;
  for (const auto& n : ModelFixtureNames()) families[GetModel(n).config().model_type]++;
  for (const char* f : {"deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe"})
    EXPECT_GT(families[f], 0) << "no fixture of family " << f;
}

}  // namespace
}  // namespace hmoe
