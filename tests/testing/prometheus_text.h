// Reading metrics back from Prometheus text (MetricsRegistry::RenderPrometheus,
// a worker's /metrics), for tests.
#pragma once

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace hmoe::testing {

// The value of the sample `series` (its name and labels exactly as rendered,
// e.g. `hmoe_expert_calls_total{transport="shm",shard="...",outcome="ok"}`)
// in `text`; `absent` when there is no such sample (or its value is not a
// number).
inline double PrometheusSample(const std::string& text, const std::string& series,
                               double absent = -1) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v = 0;
      return absl::SimpleAtod(line.substr(series.size() + 1), &v) ? v : absent;
    }
  }
  return absent;
}

}  // namespace hmoe::testing
