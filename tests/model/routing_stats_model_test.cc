// Model::routing_stats on every backend: each token of each MoE layer counts
// its experts_per_token experts once, whichever path its pass took (cuda:
// the host-copy path for a long prefill, the slots / graph for decode) and
// with Expert Deferral (both parts counted, the deferred slots counted in
// ModelStats and hmoe_expert_deferred_slots_total); a failed pass counts
// nothing.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using testing::PrometheusSample;

// MoE layers but the last layer: where Expert Deferral splits.
int64_t DeferringLayers(const ModelConfig& c) {
  int64_t n = 0;
  for (int l = 0; l + 1 < c.num_layers; ++l) n += c.layers[static_cast<size_t>(l)].moe ? 1 : 0;
  return n;
}

// The table has a row per MoE layer, each summing to tokens x experts_per_token.
void ExpectRouted(const Model& m, uint64_t tokens) {
  const ModelConfig& c = m.config();
  const RoutingTable t = m.routing_stats();
  ASSERT_EQ(static_cast<int64_t>(t.layers.size()), c.num_moe_layers());
  for (const RoutingTable::Layer& l : t.layers) {
    EXPECT_TRUE(c.layers[static_cast<size_t>(l.layer)].moe) << l.layer;
    uint64_t sum = 0;
    for (uint64_t n : l.tokens) sum += n;
    EXPECT_EQ(sum, tokens * static_cast<uint64_t>(c.moe.experts_per_token)) << "layer " << l.layer;
  }
}

class RoutingStatsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND(GetParam()); }
  // This backend's options (cuda: slots + graphs, or host copies only).
  ModelOptions Options(int deferred, bool slots, MetricsRegistry* metrics) const {
    ModelOptions o;
    o.backend = GetParam();
    o.num_threads = 2;
    o.deferred_experts = deferred;
    o.cuda.expert_slots = slots;
    o.metrics = metrics;
    return o;
  }
};

TEST_P(RoutingStatsTest, EveryRoutedTokenIsCountedOnce) {
  for (const std::string name : {"qwen3_moe_tiny", "deepseek_v3_tiny"}) {
    for (int deferred : {0, 1}) {
      for (bool slots : {true, false}) {  // cuda: slots + graphs, or host copies only
        SCOPED_TRACE(name + ", deferred " + std::to_string(deferred) + ", slots " +
                     std::to_string(slots));
        MetricsRegistry metrics;
        auto m = Model::Load(testing::ModelFixturesRoot() + "/" + name,
                             Options(deferred, slots, &metrics));
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
        ASSERT_NO_FATAL_FAILURE(ExpectRouted(**m, 45));
        EXPECT_EQ(t.routed_tokens(), 45u);
        // Deferral's slots: each token's `deferred` per MoE layer but the last.
        const int64_t want = 45 * deferred * DeferringLayers(c);
        EXPECT_EQ((*m)->stats().deferred_expert_slots, want);
        const std::string text = metrics.RenderPrometheus();
        EXPECT_EQ(PrometheusSample(text, "hmoe_expert_deferred_slots_total"),
                  static_cast<double>(want))
            << text;
        if (deferred == 1 && ::access("/usr/bin/promtool", X_OK) == 0) {
          testing::TempDir dir;
          std::ofstream(dir.file("m.txt")) << text;
          const int rc = std::system(
              absl::StrCat("/usr/bin/promtool check metrics < '", dir.file("m.txt"), "'").c_str());
          EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << text;
        }
        if (GetParam() == "cuda") {
          EXPECT_EQ((*m)->stats().graph_launches > 0, slots);
        }
      }
    }
  }
}

// Forwards to the reference experts, or fails UNAVAILABLE from the call
// after `fail_after` more calls (< 0: never).
class FailingExperts final : public RoutedExperts {
 public:
  explicit FailingExperts(RoutedExperts* inner) : inner_(inner) {}
  absl::Status Forward(const ExpertBatch& b, float* out) override {
    if (fail_after.load() == 0) return absl::UnavailableError("expert service down");
    if (fail_after.load() > 0) --fail_after;
    return inner_->Forward(b, out);
  }
  std::atomic<int> fail_after{-1};

 private:
  RoutedExperts* inner_;
};

// A pass whose expert call fails after earlier layers' calls were made
// counts neither its routing nor its deferred slots, on every path (cuda:
// the slots' host nodes or device sends, or host copies); the pass that runs
// its token again counts it once.
TEST_P(RoutingStatsTest, AFailedPassCountsNothing) {
  const std::string dir = testing::ModelFixturesRoot() + "/deepseek_v3_tiny";
  testing::ReferenceRig rig;
  ASSERT_NO_FATAL_FAILURE(testing::LoadReferenceRig(dir, 1, &rig));
  for (int deferred : {0, 1}) {
    for (bool slots : {true, false}) {
      SCOPED_TRACE("deferred " + std::to_string(deferred) + ", slots " + std::to_string(slots));
      FailingExperts experts(rig.experts.get());
      MetricsRegistry metrics;
      auto m = Model::Load(dir, Options(deferred, slots, &metrics), &experts);
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_GE((*m)->config().num_moe_layers(), 2);
      const int64_t per_token = deferred * DeferringLayers((*m)->config());
      auto s = (*m)->NewSequence();
      ASSERT_TRUE((*m)->Prefill(*s, std::vector<int32_t>(5, 7), LogitsMode::kLast).ok());
      ASSERT_TRUE((*m)->Decode(*s, 3).ok());
      ASSERT_NO_FATAL_FAILURE(ExpectRouted(**m, 6));
      // The first MoE layer's call (and, deferring, its deferred part) goes
      // through; a later one fails.
      experts.fail_after = 1 + deferred;
      auto failed = (*m)->Decode(*s, 4);
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
      EXPECT_EQ(s->length(), 6);
      ASSERT_NO_FATAL_FAILURE(ExpectRouted(**m, 6));
      EXPECT_EQ((*m)->stats().deferred_expert_slots, 6 * per_token);
      EXPECT_EQ(PrometheusSample(metrics.RenderPrometheus(), "hmoe_expert_deferred_slots_total"),
                static_cast<double>(6 * per_token));
      experts.fail_after = -1;
      ASSERT_TRUE((*m)->Decode(*s, 4).ok());
      ASSERT_NO_FATAL_FAILURE(ExpectRouted(**m, 7));
      EXPECT_EQ((*m)->stats().deferred_expert_slots, 7 * per_token);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, RoutingStatsTest, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

}  // namespace
}  // namespace hmoe
