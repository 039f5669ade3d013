// DeepSeek sparse attention (AttentionKind::kMlaDsa) on the model: the
// indexer's selection is what makes the fixture match transformers
// (reference_model_test checks the match, and chunked prefill + decode
// against one prefill, for every fixture, deepseek_v32_tiny included).
#include <string>

#include "gmock/gmock.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::RelErr;

std::string FixtureDir(const std::string& name = "deepseek_v32_tiny") {
  return testing::FixturesDir() + "/" + name;
}

// Prefill logits of the prompt, every position.
std::vector<float> PrefillAll(const std::string& dir, const std::vector<int32_t>& prompt) {
  ModelOptions opt;
  opt.num_threads = 2;
  opt.backend = "cpu";
  opt.kv_dtype = KvDtype::kF32;  // compared with transformers at 1e-3
  auto m = Model::Load(dir, opt);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  auto seq = (*m)->NewSequence();
  auto logits = (*m)->Prefill(*seq, prompt, LogitsMode::kAll);
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *logits : std::vector<float>{};
}

// The prompt is longer than index_topk, so most queries attend over a
// selection; with index_topk as large as the context (every key: dense MLA)
// the same weights miss transformers' logits by far more than the tolerance.
class DsaSelection : public ::testing::TestWithParam<std::string> {};

TEST_P(DsaSelection, Matters) {
  const std::string dir = FixtureDir(GetParam());
  const testing::ReferenceOutputs ref = testing::LoadReference(dir);
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t P = static_cast<int64_t>(ref.prompt.size()), V = ref.vocab;
  ASSERT_GT(P, 3 * c->dsa.topk);

  const std::vector<float> sparse = PrefillAll(dir, ref.prompt);
  ASSERT_EQ(static_cast<int64_t>(sparse.size()), P * V);
  testing::TempDir dense_dir;
  testing::RewriteCheckpoint(dir, dense_dir.path(), testing::Keep, [&](nlohmann::json& j) {
    j["index_topk"] = j["max_position_embeddings"];
  });
  const std::vector<float> dense = PrefillAll(dense_dir.path(), ref.prompt);
  ASSERT_EQ(static_cast<int64_t>(dense.size()), P * V);

  double sparse_err = 0, dense_err = 0, early_dense_err = 0;
  for (int64_t p = 0; p < P; ++p) {
    const double s = RelErr(sparse.data() + p * V, ref.prefill.data() + p * V, V);
    const double d = RelErr(dense.data() + p * V, ref.prefill.data() + p * V, V);
    sparse_err = std::max(sparse_err, s);
    dense_err = std::max(dense_err, d);
    // Queries that see at most index_topk keys (in every layer) select them all.
    if (p < c->dsa.topk) early_dense_err = std::max(early_dense_err, d);
  }
  EXPECT_LT(sparse_err, 1e-3);
  EXPECT_LT(early_dense_err, 1e-3);
  EXPECT_GT(dense_err, 1e-2);
  std::printf("[ dsa      ] %s max rel err vs transformers: indexer top-%lld %.2e, dense %.2e\n",
              GetParam().c_str(), static_cast<long long>(c->dsa.topk), sparse_err, dense_err);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DsaSelection,
                         ::testing::Values("deepseek_v32_tiny", "glm_moe_dsa_tiny"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// The CUDA backend does not run DSA yet: it refuses the model rather than run
// it as dense MLA.
TEST(DsaModel, CudaBackendRefusesIt) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  ModelOptions opt;
  opt.backend = "cuda";
  opt.num_threads = 2;
  auto m = Model::Load(FixtureDir(), opt);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnimplemented) << m.status();
  EXPECT_THAT(std::string(m.status().message()),
              ::testing::AllOf(HasSubstr("index_topk"), HasSubstr("deepseek_v32")))
      << m.status();
}

}  // namespace
}  // namespace hmoe
