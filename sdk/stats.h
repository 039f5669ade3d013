// Statistics the `hmoe` commands report.
#pragma once

#include <vector>

namespace hmoe {

// The nearest-rank percentile (p in [0, 1]) of `v`: the smallest value with at
// least p of the values at or below it; 0 for none. bench-serve's p50/p90/p99.
double NearestRankPercentile(std::vector<double> v, double p);

}  // namespace hmoe
