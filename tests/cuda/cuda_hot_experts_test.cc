// Hot experts on the cuda backend (CudaOptions::hot_experts): every other
// routed expert of every MoE layer on the GPU, the rest through the
// in-process experts' slots; the logits of passes that run the slots (a
// short prefill, decode steps) against the same model without hot experts,
// on every fixture, with and without Expert Deferral; every routed slot
// still counted once; one graph launch per pass (the short prefill is a
// slot pass too). Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_placement.h"
#include "common/experts/weight_format.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

using testing::ModelFixturesRoot;

struct Out {
  std::vector<std::vector<float>> logits;
  uint64_t routed = 0;
  int64_t graph_launches = 0;
};

Out Generate(const std::string& dir, std::shared_ptr<const Placement> hot, const std::string& fmt,
             int deferred) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.deferred_experts = deferred;
  o.cuda.hot_experts = std::move(hot);
  o.cuda.hot_format = *ParseWeightFormat(fmt);
  o.cuda.hot_group = 32;
  auto m = Model::Load(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
  Out r;
  if (!m.ok()) return r;
  r.logits = testing::PrefillThenDecode(**m, {1, 5, 17, 42, 7}, 6);
  const RoutingTable t = (*m)->routing_stats();
  for (const auto& layer : t.layers)
    for (uint64_t c : layer.tokens) r.routed += c;
  r.graph_launches = (*m)->stats().graph_launches;
  return r;
}

class CudaHotExperts : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

TEST_P(CudaHotExperts, EqualTheColdPathWithinTolerance) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto p = std::make_shared<Placement>();
  p->model_type = config->model_type;
  p->num_experts = config->moe.num_experts;
  for (int l = 0; l < config->num_layers; ++l) {
    if (!config->layers[static_cast<size_t>(l)].moe) continue;
    for (int32_t e = 0; e < config->moe.num_experts; e += 2) p->hot[l].push_back(e);
  }
  for (int deferred : {0, 1}) {
    const Out cold = Generate(dir, nullptr, "bf16", deferred);
    ASSERT_EQ(cold.logits.size(), 7u);
    // Each of the 11 tokens (5 prompt, 6 steps) counted once per routed slot.
    EXPECT_EQ(cold.routed, 11u * static_cast<uint64_t>(config->moe.experts_per_token) *
                               static_cast<uint64_t>(config->num_moe_layers()));
    // bf16: the hot side rounds its intermediate to bf16 (the service's
    // bf16 numerics), the in-process experts do not; int4: quantized
    // weights against the checkpoint's.
    for (const auto& [fmt, tol] :
         {std::pair<std::string, double>{"bf16", 2e-2}, {"int4", 2.5e-1}}) {
      SCOPED_TRACE(::testing::Message() << GetParam() << ", deferred " << deferred << ", " << fmt);
      const Out hot = Generate(dir, p, fmt, deferred);
      ASSERT_EQ(hot.logits.size(), cold.logits.size());
      const double worst = testing::MaxScaledDiff(hot.logits, cold.logits);
      EXPECT_LE(worst, tol);
      std::printf("[ hot      ] %s deferred %d %s: max rel diff %.3g\n", GetParam().c_str(),
                  deferred, fmt.c_str(), worst);
      EXPECT_EQ(hot.routed, cold.routed) << "hot slots are counted too";
      EXPECT_EQ(hot.graph_launches, cold.graph_launches);
      EXPECT_EQ(hot.graph_launches, 7) << "the 5-token prefill and 6 steps, a graph each";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaHotExperts,
                         ::testing::ValuesIn(testing::CudaModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace hmoe
