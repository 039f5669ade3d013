// Model::routing_stats on every backend: each token of each MoE layer counts
// its experts_per_token experts once, whichever path its pass took (cuda:
// the host-copy path for a long prefill, the slots / graph for decode) and
// with Expert Deferral (both parts counted).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

class RoutingStatsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND(GetParam()); }
};

TEST_P(RoutingStatsTest, EveryRoutedTokenIsCountedOnce) {
  for (const std::string name : {"qwen3_moe_tiny", "deepseek_v3_tiny"}) {
    for (int deferred : {0, 1}) {
      for (bool slots : {true, false}) {  // cuda: slots + graphs, or host copies only
        SCOPED_TRACE(name + ", deferred " + std::to_string(deferred) + ", slots " +
                     std::to_string(slots));
        ModelOptions o;
        o.backend = GetParam();
        o.num_threads = 2;
        o.deferred_experts = deferred;
        o.cuda.expert_slots = slots;
        auto m = Model::Load(testing::ModelFixturesRoot() + "/" + name, o);
        ASSERT_TRUE(m.ok()) << m.status();
        const ModelConfig& c = (*m)->config();
        auto s = (*m)->NewSequence();
        const std::vector<int32_t> prompt(40, 7);  // over 32 tokens: cuda's host-copy path
        ASSERT_TRUE((*m)->Prefill(*s, prompt, LogitsMode::kLast).ok());
        for (int i = 0; i < 5; ++i) ASSERT_TRUE((*m)->Decode(*s, 3 + i).ok());
        const RoutingTable t = (*m)->routing_stats();
        EXPECT_EQ(t.model_type, c.model_type);
        EXPECT_EQ(t.num_experts, c.moe.num_experts);
        EXPECT_EQ(t.experts_per_token, c.moe.experts_per_token);
        EXPECT_EQ(static_cast<int64_t>(t.layers.size()), c.num_moe_layers());
        for (const RoutingTable::Layer& l : t.layers) {
          EXPECT_TRUE(c.layers[static_cast<size_t>(l.layer)].moe) << l.layer;
          uint64_t sum = 0;
          for (uint64_t n : l.tokens) sum += n;
          EXPECT_EQ(sum, 45u * static_cast<uint64_t>(c.moe.experts_per_token)) << l.layer;
        }
        EXPECT_EQ(t.routed_tokens(), 45u);
        if (GetParam() == "cuda") {
          EXPECT_EQ((*m)->stats().graph_launches > 0, slots);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, RoutingStatsTest, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

}  // namespace
}  // namespace hmoe
