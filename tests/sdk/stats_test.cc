// hmoe's bench-serve statistics.
#include "sdk/stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace hmoe {
namespace {

// Nearest rank: p99 of 1..100 is 99 (it was 100, the maximum: one rank high),
// p50 of two values the smaller.
TEST(BenchServeStats, PercentilesAreNearestRank) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);
  EXPECT_EQ(NearestRankPercentile(v, 0.99), 99);
  EXPECT_EQ(NearestRankPercentile(v, 0.9), 90);
  EXPECT_EQ(NearestRankPercentile(v, 0.5), 50);
  EXPECT_EQ(NearestRankPercentile(v, 1.0), 100);
  EXPECT_EQ(NearestRankPercentile(v, 0.0), 1);
  EXPECT_EQ(NearestRankPercentile({7, 3}, 0.5), 3);
  EXPECT_EQ(NearestRankPercentile({7, 3}, 0.51), 7);
  EXPECT_EQ(NearestRankPercentile({5}, 0.99), 5);
  EXPECT_EQ(NearestRankPercentile({}, 0.5), 0);
}

}  // namespace
}  // namespace hmoe
