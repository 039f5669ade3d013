// RoutingCounters and the routing-stats JSON (common/routing_stats.h).
#include "common/routing_stats.h"

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

TEST(RoutingStats, CountersCountIdsOfCountedLayersOnly) {
  RoutingCounters c({5, 1, 3}, 4);
  const std::vector<int32_t> ids = {0, 3, 3, 2, -1, 4, 1, 1};
  c.Add(3, ids.data(), static_cast<int64_t>(ids.size()));  // -1 and 4: out of range, ignored
  c.Add(1, ids.data(), 2);
  c.Add(2, ids.data(), 2);   // not a counted layer
  c.Add(99, ids.data(), 2);  // nor this
  const RoutingTable t = c.Snapshot("qwen3_moe", 2);
  ASSERT_EQ(t.layers.size(), 3u);
  EXPECT_EQ(t.layers[0].layer, 1);
  EXPECT_EQ(t.layers[1].layer, 3);
  EXPECT_EQ(t.layers[2].layer, 5);
  EXPECT_EQ(t.layers[0].tokens, (std::vector<uint64_t>{1, 0, 0, 1}));
  EXPECT_EQ(t.layers[1].tokens, (std::vector<uint64_t>{1, 2, 1, 2}));
  EXPECT_EQ(t.layers[2].tokens, (std::vector<uint64_t>{0, 0, 0, 0}));
  EXPECT_EQ(t.routed_tokens(), 3u);  // layer 3: 6 ids / top-2
}

TEST(RoutingStats, ConcurrentAddsAreAllCounted) {
  RoutingCounters c({0}, 8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      const int32_t id = i;
      for (int n = 0; n < 10000; ++n) c.Add(0, &id, 1);
    });
  for (auto& t : threads) t.join();
  const RoutingTable t = c.Snapshot("x", 1);
  EXPECT_EQ(t.layers[0].tokens, (std::vector<uint64_t>{10000, 10000, 10000, 10000, 0, 0, 0, 0}));
}

// A pass's tally: moved into the totals (and zeroed) when it completed,
// cleared when it failed.
TEST(RoutingStats, ATallyMovesIntoTheTotalsOrIsCleared) {
  RoutingCounters total({1, 3}, 4), pass({1, 3}, 4);
  const std::vector<int32_t> ids = {0, 3, 3, 2};
  total.Add(1, ids.data(), 1);
  pass.Add(1, ids.data(), 4);
  pass.Add(3, ids.data(), 2);
  pass.MoveTo(&total);
  RoutingTable t = total.Snapshot("x", 2);
  EXPECT_EQ(t.layers[0].tokens, (std::vector<uint64_t>{2, 0, 1, 2}));
  EXPECT_EQ(t.layers[1].tokens, (std::vector<uint64_t>{1, 0, 0, 1}));
  t = pass.Snapshot("x", 2);
  EXPECT_EQ(t.layers[0].tokens, (std::vector<uint64_t>{0, 0, 0, 0}));
  EXPECT_EQ(t.layers[1].tokens, (std::vector<uint64_t>{0, 0, 0, 0}));
  pass.Add(3, ids.data(), 4);
  pass.Clear();
  pass.MoveTo(&total);
  EXPECT_EQ(total.Snapshot("x", 2).layers[1].tokens, (std::vector<uint64_t>{1, 0, 0, 1}));
}

TEST(RoutingStats, JsonRoundTripsAndRefusesWhatIsNotTheForm) {
  RoutingTable t;
  t.model_type = "deepseek_v3";
  t.num_experts = 3;
  t.experts_per_token = 2;
  t.layers = {{7, {4, 0, 2}}, {3, {1, 2, 3}}};
  const std::string j = RoutingTableJson(t);
  EXPECT_THAT(j, HasSubstr("\"format\":\"hmoe-routing-stats-1\""));
  EXPECT_THAT(j, HasSubstr("\"tokens\":3"));
  auto back = ParseRoutingTable(j);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model_type, "deepseek_v3");
  EXPECT_EQ(back->num_experts, 3);
  EXPECT_EQ(back->experts_per_token, 2);
  ASSERT_EQ(back->layers.size(), 2u);
  EXPECT_EQ(back->layers[0].layer, 7);  // as written; order kept
  EXPECT_EQ(back->layers[1].tokens, (std::vector<uint64_t>{1, 2, 3}));
  struct Case {
    std::string json, says;
  };
  for (
      const Case& c : {
          Case{"[]", "not a JSON object"},
          Case{"{\"format\":\"other\"}", "format"},
          Case{
              R"({"format":"hmoe-routing-stats-1","num_experts":0,"experts_per_token":1,"layers":[]})",
              "num_experts"},
          Case{
              R"({"format":"hmoe-routing-stats-1","num_experts":2,"experts_per_token":1,"layers":[{"layer":1,"tokens":[1]}]})",
              "tokens must hold num_experts (2)"},
          Case{
              R"({"format":"hmoe-routing-stats-1","num_experts":1,"experts_per_token":1,"layers":[{"layer":1,"tokens":[1]},{"layer":1,"tokens":[2]}]})",
              "layer 1 twice"},
          Case{
              R"({"format":"hmoe-routing-stats-1","num_experts":1,"experts_per_token":1,"layers":[{"layer":1,"tokens":[-1]}]})",
              "integers >= 0"},
      }) {
    auto r = ParseRoutingTable(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.says)) << c.json;
  }
}

}  // namespace
}  // namespace hmoe
