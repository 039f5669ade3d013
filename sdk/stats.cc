#include "sdk/stats.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace hmoe {

double NearestRankPercentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p * static_cast<double>(v.size()));  // 1-based
  const size_t i = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return v[std::min(v.size() - 1, i)];
}

}  // namespace hmoe
