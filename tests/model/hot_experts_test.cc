// Hot experts split from the cold ones (gpu_worker/hot_experts.h) on the CPU
// backend, with in-process experts on both sides: the split (SplitHot), a
// placement planned from the model's own routing statistics, and the model's
// logits against the unsplit model's on every fixture, with and without
// Expert Deferral, within fp32 summation tolerance.
#include "gpu_worker/hot_experts.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_placement.h"
#include "common/safetensors.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

using testing::ModelFixtureNames;
using testing::ModelFixturesRoot;

TEST(SplitHot, HotSlotsLeaveTheColdCallAndEmptySlotsStayEmpty) {
  const std::vector<int32_t> ids = {0, 3, 5, kNoExpert, 3, 7, 1, 9};
  std::vector<uint8_t> hot(8, 0);
  hot[3] = hot[7] = 1;
  std::vector<int32_t> cold_ids(ids.size()), hot_ids(ids.size());
  // 9 is out of range for 8 experts: never hot, passed to the cold side (which refuses it).
  EXPECT_EQ(SplitHot(ids.data(), 8, hot.data(), 8, cold_ids.data(), hot_ids.data()), 3);
  EXPECT_EQ(cold_ids,
            (std::vector<int32_t>{0, kNoExpert, 5, kNoExpert, kNoExpert, kNoExpert, 1, 9}));
  EXPECT_EQ(hot_ids,
            (std::vector<int32_t>{kNoExpert, 3, kNoExpert, kNoExpert, 3, 7, kNoExpert, kNoExpert}));
}

struct Generated {
  std::vector<std::vector<float>> logits;  // prefill's last row, then each decode step's
  RoutingTable stats;
};

Generated Generate(const ModelConfig& config, const Checkpoint& ckpt, RoutedExperts* experts,
                   int deferred) {
  ModelOptions o;
  o.backend = "cpu";
  o.num_threads = 2;
  o.deferred_experts = deferred;
  auto m = Model::Create(config, ckpt, o, experts);
  EXPECT_TRUE(m.ok()) << m.status();
  Generated r;
  if (!m.ok()) return r;
  auto s = (*m)->NewSequence();
  auto l = (*m)->Prefill(*s, std::vector<int32_t>{1, 5, 17, 42, 7, 3, 11, 2}, LogitsMode::kLast);
  EXPECT_TRUE(l.ok()) << l.status();
  if (!l.ok()) return r;
  r.logits.push_back(*l);
  for (int step = 0; step < 6; ++step) {
    // The unsplit run's greedy tokens are replayed by the split run (same inputs).
    const int32_t next = 3 + 5 * step;
    auto d = (*m)->Decode(*s, next);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return r;
    r.logits.push_back(*d);
  }
  r.stats = (*m)->routing_stats();
  return r;
}

class HotColdTest : public ::testing::TestWithParam<std::string> {};

// Placement from the unsplit run's own stats, half of the experts it used
// hot; the split model's logits equal the unsplit ones within fp32
// summation tolerance, and both sides served slots.
TEST_P(HotColdTest, SplitModelEqualsUnsplitWithinSummationTolerance) {
  const std::string dir = ModelFixturesRoot() + "/" + GetParam();
  testing::ReferenceRig rig;
  ASSERT_NO_FATAL_FAILURE(testing::LoadReferenceRig(dir, 2, &rig));
  const ModelConfig* config = &rig.config;
  for (int deferred : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << GetParam() << ", deferred " << deferred);
    const Generated plain = Generate(*config, *rig.ckpt, rig.experts.get(), deferred);
    ASSERT_FALSE(plain.logits.empty());
    PlacementOptions po;
    po.expert_bytes = 1;
    int64_t routed = 0;  // (layer, expert) pairs the run used
    for (const RoutingTable::Layer& l : plain.stats.layers)
      for (uint64_t c : l.tokens) routed += c > 0 ? 1 : 0;
    po.budget_bytes = routed / 2;
    auto placement = PlanPlacement(plain.stats, *config, po);
    ASSERT_TRUE(placement.ok()) << placement.status();
    ASSERT_GT(placement->num_hot, 0);
    EXPECT_GE(placement->hot_fraction, 0.5) << "the most used half serves at least half";
    EXPECT_LT(placement->hot_fraction, 1.0);
    auto split = HotColdExperts::Create(*config, *placement, rig.experts.get(), rig.experts.get());
    ASSERT_TRUE(split.ok()) << split.status();
    const Generated hc = Generate(*config, *rig.ckpt, split->get(), deferred);
    ASSERT_EQ(hc.logits.size(), plain.logits.size());
    for (size_t i = 0; i < hc.logits.size(); ++i)
      EXPECT_LE(testing::MaxScaledDiff(hc.logits[i], plain.logits[i]), 1e-4) << "pass " << i;
    EXPECT_GT((*split)->hot_slots(), 0u);
    EXPECT_GT((*split)->cold_slots(), 0u);
    // The split counts every routed slot once: the stats' total.
    EXPECT_EQ((*split)->hot_slots() + (*split)->cold_slots(),
              hc.stats.routed_tokens() * static_cast<uint64_t>(config->moe.experts_per_token) *
                  static_cast<uint64_t>(config->num_moe_layers()));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HotColdTest, ::testing::ValuesIn(ModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(HotColdExperts, RefusesAPlacementOfAnotherModelAndBadBatches) {
  const std::string dir = ModelFixturesRoot() + "/qwen3_moe_tiny";
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto ref = MakeReferenceRoutedExperts(*config, **ckpt, 1);
  ASSERT_TRUE(ref.ok()) << ref.status();
  int moe_layer = 0;
  while (!config->layers[static_cast<size_t>(moe_layer)].moe) ++moe_layer;
  Placement p;
  p.model_type = config->model_type;
  p.num_experts = config->moe.num_experts;
  auto expect_refused = [&](const Placement& bad, const std::string& says) {
    auto h = HotColdExperts::Create(*config, bad, ref->get(), ref->get());
    ASSERT_FALSE(h.ok()) << says;
    EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition) << h.status();
    EXPECT_NE(h.status().message().find(says), absl::string_view::npos) << h.status();
  };
  Placement other = p;
  other.model_type = "deepseek_v3";
  expect_refused(other, "model_type");
  other = p;
  other.num_experts = p.num_experts + 1;
  expect_refused(other, "num_experts");
  other = p;
  other.hot[config->num_layers] = {0};
  expect_refused(other, "not an MoE layer");
  other = p;
  other.hot[moe_layer] = {static_cast<int32_t>(p.num_experts)};
  expect_refused(other, "out of range");
  EXPECT_EQ(HotColdExperts::Create(*config, p, nullptr, ref->get()).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A bad batch is the validator's INVALID_ARGUMENT; an unknown ticket too.
  p.hot[moe_layer] = {0, 1};
  auto h = HotColdExperts::Create(*config, p, ref->get(), ref->get());
  ASSERT_TRUE(h.ok()) << h.status();
  const int64_t H = config->hidden_size;
  const int k = static_cast<int>(config->moe.experts_per_token);
  std::vector<float> x(static_cast<size_t>(2 * H), 0.5f), out(static_cast<size_t>(2 * H));
  std::vector<int32_t> ids(static_cast<size_t>(2 * k), 0);
  for (int j = 0; j < k; ++j) ids[static_cast<size_t>(j)] = j;  // token 0: hot 0, 1 and cold
  for (int j = 0; j < k; ++j) ids[static_cast<size_t>(k + j)] = kNoExpert;  // token 1: nothing
  std::vector<float> w(static_cast<size_t>(2 * k), 0.25f);
  ExpertBatch b{moe_layer, 2, H, x.data(), k, ids.data(), w.data()};
  ASSERT_TRUE((*h)->Forward(b, out.data()).ok());
  // Against the unsplit reference on the same batch.
  std::vector<float> want(out.size());
  ASSERT_TRUE((*ref)->Forward(b, want.data()).ok());
  EXPECT_LE(testing::MaxScaledDiff(out, want), 1e-6);
  for (int64_t c = 0; c < H; ++c) EXPECT_EQ(out[static_cast<size_t>(H + c)], 0.0f);
  ids[0] = -2;
  EXPECT_EQ((*h)->Forward(b, out.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*h)->Wait(12345).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
