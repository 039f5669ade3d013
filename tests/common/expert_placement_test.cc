// The hot-expert placement plan (common/expert_placement.h).
#include "common/expert_placement.h"

#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Hot = std::map<int32_t, std::vector<int32_t>>;

// qwen3_moe_tiny: 3 layers (layer 1 dense), 8 experts, top-2; `edit` changes its config.json.
ModelConfig Qwen(const std::function<void(nlohmann::json&)>& edit = nullptr) {
  const std::string path = testing::FixturesDir() + "/qwen3_moe_tiny/config.json";
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  if (edit) edit(j);
  auto c = ParseModelConfig(j.dump(), path);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// Four MoE layers (0..3) of the same model.
ModelConfig Qwen4() {
  return Qwen([](nlohmann::json& j) {
    j["num_hidden_layers"] = 4;
    j["mlp_only_layers"] = nlohmann::json::array();
  });
}

RoutingTable Table(std::vector<RoutingTable::Layer> layers) {
  RoutingTable t;
  t.model_type = "qwen3_moe";
  t.num_experts = 8;
  t.experts_per_token = 2;
  t.layers = std::move(layers);
  return t;
}

Placement Plan(const RoutingTable& t, const ModelConfig& c, int64_t budget, int64_t expert) {
  auto p = PlanPlacement(t, c, {budget, expert});
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : Placement{};
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(ExpertPlacement, BudgetIsRespected) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{0, {9, 8, 7, 6, 5, 4, 3, 2}}, {2, {1, 2, 3, 4, 5, 6, 7, 8}}});
  for (int64_t budget : {0, 99, 100, 350, 799, 1000, 1599, 1600}) {
    const Placement p = Plan(t, c, budget, 100);
    EXPECT_EQ(p.num_hot, budget / 100) << budget;
    EXPECT_EQ(p.bytes, p.num_hot * 100) << budget;
    EXPECT_LE(p.bytes, budget);
    int64_t listed = 0;
    for (const auto& [layer, ids] : p.hot) listed += static_cast<int64_t>(ids.size());
    EXPECT_EQ(listed, p.num_hot) << budget;
  }
  // More room than routed experts: all 16, no more.
  const Placement all = Plan(t, c, 1 << 20, 100);
  EXPECT_EQ(all.num_hot, 16);
  EXPECT_EQ(all.bytes, 1600);
  EXPECT_DOUBLE_EQ(all.hot_fraction, 1.0);
  // Fewer routed experts than fit: only the routed ones.
  const RoutingTable sparse = Table({{0, {9, 0, 7, 0, 5, 0, 3, 0}}, {2, {0, 0, 0, 4, 0, 0, 0, 8}}});
  const Placement few = Plan(sparse, c, 1000, 100);
  EXPECT_EQ(few.num_hot, 6);
  EXPECT_EQ(few.bytes, 600);
  EXPECT_EQ(few.hot, (Hot{{0, {0, 2, 4, 6}}, {2, {3, 7}}}));
}

TEST(ExpertPlacement, GreedyRanksByShareOfEachLayersTokens) {
  const ModelConfig c = Qwen();
  // Layer 0: 1000 selections (500 tokens); layer 2: 200 (100 tokens). Layer 2's expert 0 (90 of
  // 200, 0.45) beats layer 0's expert 0 (400 of 1000, 0.40) despite the smaller raw count.
  const RoutingTable t = Table({{0, {400, 300, 100, 100, 50, 50, 0, 0}},  //
                                {2, {90, 60, 20, 10, 10, 10, 0, 0}}});
  EXPECT_EQ(Plan(t, c, 10, 10).hot, (Hot{{2, {0}}}));
  EXPECT_EQ(Plan(t, c, 20, 10).hot, (Hot{{0, {0}}, {2, {0}}}));
  // 0.30 in both layers: layer 0 first.
  EXPECT_EQ(Plan(t, c, 30, 10).hot, (Hot{{0, {0, 1}}, {2, {0}}}));
  EXPECT_EQ(Plan(t, c, 40, 10).hot, (Hot{{0, {0, 1}}, {2, {0, 1}}}));
  // Then the 0.10s: layer 0's experts 2 and 3, then layer 2's expert 2.
  EXPECT_EQ(Plan(t, c, 60, 10).hot, (Hot{{0, {0, 1, 2, 3}}, {2, {0, 1}}}));
  EXPECT_EQ(Plan(t, c, 70, 10).hot, (Hot{{0, {0, 1, 2, 3}}, {2, {0, 1, 2}}}));
}

TEST(ExpertPlacement, TiesGoToTheLowerLayerThenTheLowerExpert) {
  const ModelConfig c = Qwen4();
  // Every expert of every layer has the same share (1/8); the file order is scrambled.
  const RoutingTable t = Table({{3, {10, 10, 10, 10, 10, 10, 10, 10}},
                                {1, {3, 3, 3, 3, 3, 3, 3, 3}},
                                {0, {7, 7, 7, 7, 7, 7, 7, 7}},
                                {2, {1, 1, 1, 1, 1, 1, 1, 1}}});
  EXPECT_EQ(Plan(t, c, 3, 1).hot, (Hot{{0, {0, 1, 2}}}));
  EXPECT_EQ(Plan(t, c, 10, 1).hot, (Hot{{0, {0, 1, 2, 3, 4, 5, 6, 7}}, {1, {0, 1}}}));
  EXPECT_EQ(Plan(t, c, 19, 1).hot,
            (Hot{{0, {0, 1, 2, 3, 4, 5, 6, 7}}, {1, {0, 1, 2, 3, 4, 5, 6, 7}}, {2, {0, 1, 2}}}));
  // A tie inside one layer, behind a larger share: the lower ids of the tie.
  const RoutingTable u = Table({{2, {0, 4, 4, 4, 0, 8, 0, 4}}});
  EXPECT_EQ(Plan(u, c, 3, 1).hot, (Hot{{2, {1, 2, 5}}}));
}

TEST(ExpertPlacement, ZeroBudgetAndEmptyTableGiveAnEmptyPlacement) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{0, {9, 8, 7, 6, 5, 4, 3, 2}}});
  for (int64_t budget : {0, 99}) {  // nothing, and less than one expert
    const Placement p = Plan(t, c, budget, 100);
    EXPECT_TRUE(p.hot.empty());
    EXPECT_EQ(p.num_hot, 0);
    EXPECT_EQ(p.bytes, 0);
    EXPECT_EQ(p.hot_fraction, 0);
    EXPECT_EQ(p.saved_bytes_per_token, 0);
    EXPECT_EQ(p.model_type, "qwen3_moe");
  }
  const Placement empty = Plan(Table({}), c, 1 << 30, 100);
  EXPECT_TRUE(empty.hot.empty());
  EXPECT_EQ(empty.num_hot, 0);
  EXPECT_EQ(empty.hot_fraction, 0);
  EXPECT_THAT(empty.Describe(), HasSubstr("0 hot experts"));
  // A layer that never routed anything contributes nothing.
  const Placement silent = Plan(Table({{0, {0, 0, 0, 0, 0, 0, 0, 0}}}), c, 1 << 30, 100);
  EXPECT_TRUE(silent.hot.empty());
  EXPECT_EQ(silent.hot_fraction, 0);
}

TEST(ExpertPlacement, NeverRoutedExpertsAreNeverPlaced) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{0, {0, 5, 0, 0, 1, 0, 0, 0}},  //
                                {2, {0, 0, 0, 0, 0, 0, 0, 0}}});
  const Placement p = Plan(t, c, int64_t{1} << 40, 1);
  EXPECT_EQ(p.num_hot, 2);
  EXPECT_EQ(p.hot, (Hot{{0, {1, 4}}}));
  for (const RoutingTable::Layer& l : t.layers)
    for (int32_t e = 0; e < 8; ++e)
      EXPECT_EQ(p.is_hot(l.layer, e), l.tokens[static_cast<size_t>(e)] > 0) << l.layer << "/" << e;
}

TEST(ExpertPlacement, HotFractionAndSavedBytesPerToken) {
  const ModelConfig c = Qwen();
  // Layer 0: 8 selections, 4 tokens; layer 2: 4 selections, 2 tokens; 12 in all.
  const RoutingTable t = Table({{0, {6, 2, 0, 0, 0, 0, 0, 0}}, {2, {1, 1, 1, 1, 0, 0, 0, 0}}});
  const Placement two = Plan(t, c, 2000, 1000);
  EXPECT_EQ(two.hot, (Hot{{0, {0, 1}}}));  // 6/8, then 2/8 ties layer 2's 1/4s: lower layer
  EXPECT_DOUBLE_EQ(two.hot_fraction, 8.0 / 12.0);
  EXPECT_DOUBLE_EQ(two.saved_bytes_per_token, 6.0 / 4 * 1000 + 2.0 / 4 * 1000);  // 2000
  const Placement three = Plan(t, c, 3999, 1000);
  EXPECT_EQ(three.hot, (Hot{{0, {0, 1}}, {2, {0}}}));
  EXPECT_EQ(three.bytes, 3000);
  EXPECT_DOUBLE_EQ(three.hot_fraction, 0.75);
  EXPECT_DOUBLE_EQ(three.saved_bytes_per_token, 2500);  // + 1 of 2 tokens * 1000
  const Placement all = Plan(t, c, 1 << 20, 1000);
  EXPECT_EQ(all.num_hot, 6);
  EXPECT_DOUBLE_EQ(all.hot_fraction, 1.0);
  // Every token reads top-2 experts per layer in 2 layers: all of it saved.
  EXPECT_DOUBLE_EQ(all.saved_bytes_per_token, 2 * 2 * 1000);
}

TEST(ExpertPlacement, IsHotAndDescribe) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{0, {6, 2, 0, 0, 0, 0, 0, 0}}, {2, {1, 1, 1, 1, 0, 0, 0, 0}}});
  const int64_t gib = int64_t{1} << 30;
  const Placement p = Plan(t, c, 3 * gib, gib);
  EXPECT_TRUE(p.is_hot(0, 0));
  EXPECT_TRUE(p.is_hot(0, 1));
  EXPECT_TRUE(p.is_hot(2, 0));
  EXPECT_FALSE(p.is_hot(0, 2));
  EXPECT_FALSE(p.is_hot(2, 1));
  EXPECT_FALSE(p.is_hot(1, 0));  // dense layer
  EXPECT_FALSE(p.is_hot(5, 0));
  EXPECT_FALSE(p.is_hot(0, -1));
  EXPECT_EQ(p.Describe(), "3 hot experts in 2 layers, 3.00 GiB, 75.0% of routed traffic");
}

TEST(ExpertPlacement, RefusesBadOptions) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{0, {1, 0, 0, 0, 0, 0, 0, 0}}});
  for (const PlacementOptions& o :
       {PlacementOptions{-1, 100}, PlacementOptions{100, 0}, PlacementOptions{100, -5}}) {
    auto p = PlanPlacement(t, c, o);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
        << o.budget_bytes << " " << o.expert_bytes;
  }
  RoutingTable short_row = t;
  short_row.layers[0].tokens.resize(3);
  auto p = PlanPlacement(short_row, c, {100, 1});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("num_experts (8)"));
}

struct ForeignCase {
  std::string name;
  std::function<void(RoutingTable&)> edit;
  std::vector<std::string> says;
};

std::vector<ForeignCase> ForeignCases() {
  return {
      {"model_type",
       [](RoutingTable& t) { t.model_type = "deepseek_v3"; },
       {"routing stats for model_type deepseek_v3 (8 experts, top-2) do not describe this model",
        "model_type is qwen3_moe, not deepseek_v3"}},
      {"num_experts",
       [](RoutingTable& t) {
         t.num_experts = 16;
         for (auto& l : t.layers) l.tokens.resize(16, 1);
       },
       {"num_experts is 8, not 16"}},
      {"experts_per_token",
       [](RoutingTable& t) { t.experts_per_token = 4; },
       {"experts_per_token is 2, not 4"}},
      {"dense",
       [](RoutingTable& t) {
         t.layers.push_back({1, std::vector<uint64_t>(8, 1)});
       },
       {"layer 1 is a dense layer"}},
      {"out_of_range",
       [](RoutingTable& t) {
         t.layers.push_back({3, std::vector<uint64_t>(8, 1)});
       },
       {"layer 3 is out of range (num_layers 3)"}},
  };
}

TEST(ExpertPlacement, RefusesStatsOfAnotherModel) {
  const ModelConfig c = Qwen();
  for (const ForeignCase& fc : ForeignCases()) {
    RoutingTable t = Table({{0, {1, 2, 3, 4, 5, 6, 7, 8}}});
    fc.edit(t);
    auto p = PlanPlacement(t, c, {1000, 1});
    EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << fc.name;
    for (const std::string& s : fc.says)
      EXPECT_THAT(std::string(p.status().message()), HasSubstr(s)) << fc.name;
  }
  // A layer twice (only a hand-built table can say so: the parser refuses it).
  RoutingTable twice = Table({{0, {1, 2, 3, 4, 5, 6, 7, 8}}, {0, {1, 2, 3, 4, 5, 6, 7, 8}}});
  auto p = PlanPlacement(twice, c, {1000, 1});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("layer 0 appears twice"));
  // Qwen stats against a real DeepSeek-V3 config.
  auto ds3 = LoadModelConfig(testing::FixturesDir() + "/deepseek_v3_tiny");
  ASSERT_TRUE(ds3.ok()) << ds3.status();
  p = PlanPlacement(Table({{1, {1, 2, 3, 4, 5, 6, 7, 8}}}), *ds3, {1000, 1});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(p.status().message()),
              AllOf(HasSubstr("qwen3_moe (8 experts, top-2)"),
                    HasSubstr("model_type is deepseek_v3, not qwen3_moe")));
}

TEST(ExpertPlacement, FileRoundTripPlacesAsTheTable) {
  const ModelConfig c = Qwen();
  const RoutingTable t = Table({{2, {90, 60, 20, 10, 10, 10, 0, 0}},  //
                                {0, {400, 300, 100, 100, 50, 50, 0, 0}}});
  testing::TempDir dir;
  const std::string path = dir.file("stats.json");
  WriteFile(path, RoutingTableJson(t));
  for (int64_t budget : {0, 30, 70, 1000}) {
    const Placement want = Plan(t, c, budget, 10);
    auto got = PlanPlacementFromFile(path, c, {budget, 10});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->model_type, want.model_type);
    EXPECT_EQ(got->num_experts, 8);
    EXPECT_EQ(got->experts_per_token, 2);
    EXPECT_EQ(got->hot, want.hot) << budget;
    EXPECT_EQ(got->num_hot, want.num_hot);
    EXPECT_EQ(got->bytes, want.bytes);
    EXPECT_EQ(got->hot_fraction, want.hot_fraction);
    EXPECT_EQ(got->saved_bytes_per_token, want.saved_bytes_per_token);
    EXPECT_EQ(got->Describe(), want.Describe());
  }
}

TEST(ExpertPlacement, RefusesAMalformedFileNamingThePath) {
  const ModelConfig c = Qwen();
  testing::TempDir dir;
  struct Case {
    std::string text, says;
  };
  int i = 0;
  for (const Case& k : {
           Case{"{\"format\": ", "not a JSON object"},
           Case{R"({"format":"hmoe-routing-stats-0","model_type":"qwen3_moe","num_experts":8,)"
                R"("experts_per_token":2,"layers":[]})",
                "format"},
           Case{R"({"format":"hmoe-routing-stats-1","model_type":"qwen3_moe","num_experts":8,)"
                R"("experts_per_token":2,"layers":[{"layer":0,"tokens":[1,2,3]}]})",
                "tokens must hold num_experts (8)"},
       }) {
    const std::string path = dir.file("bad" + std::to_string(i++) + ".json");
    WriteFile(path, k.text);
    auto p = PlanPlacementFromFile(path, c, {1000, 1});
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << k.text;
    EXPECT_THAT(std::string(p.status().message()), AllOf(HasSubstr(path), HasSubstr(k.says)))
        << k.text;
  }
}

TEST(ExpertPlacement, RefusesAForeignFileNamingTheField) {
  const ModelConfig c = Qwen();
  testing::TempDir dir;
  for (const ForeignCase& fc : ForeignCases()) {
    RoutingTable t = Table({{0, {1, 2, 3, 4, 5, 6, 7, 8}}});
    fc.edit(t);
    const std::string path = dir.file(fc.name + ".json");
    WriteFile(path, RoutingTableJson(t));
    auto p = PlanPlacementFromFile(path, c, {1000, 1});
    EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << fc.name;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(path)) << fc.name;
    for (const std::string& s : fc.says)
      EXPECT_THAT(std::string(p.status().message()), HasSubstr(s)) << fc.name;
  }
}

TEST(ExpertPlacement, RefusesAMissingFileNamingThePath) {
  testing::TempDir dir;
  const std::string path = dir.file("no-such-stats.json");
  auto p = PlanPlacementFromFile(path, Qwen(), {1000, 1});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr(path));
}

}  // namespace
}  // namespace hmoe
