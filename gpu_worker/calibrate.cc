#include "gpu_worker/calibrate.h"

#include <chrono>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/small_file.h"
#include "common/status.h"

namespace hmoe {

absl::StatusOr<CalibrationResult> CalibrateRouting(const Model& model, const Tokenizer& tok,
                                                   const std::string& path) {
  ASSIGN_OR_RETURN(
      const std::string prompts,
      ReadSmallFile(path, kMaxIndexJsonBytes, absl::StrCat(path, " (calibration prompts)")));
  std::istringstream in(prompts);
  const auto t0 = std::chrono::steady_clock::now();
  CalibrationResult r;
  const int64_t cap = model.options().max_seq_len;
  std::vector<float> logits;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    absl::StatusOr<std::vector<int32_t>> ids = tok.Encode(line, /*add_special_tokens=*/true);
    if (!ids.ok())
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", n, ": cannot encode the prompt: ", ids.status().message()));
    if (ids->empty()) continue;
    if (cap > 0 && static_cast<int64_t>(ids->size()) > cap) {
      ids->resize(static_cast<size_t>(cap));
      ++r.truncated;
    }
    std::unique_ptr<Sequence> seq = model.NewSequence();
    if (absl::Status st = model.Forward(*seq, *ids, LogitsMode::kLast, &logits); !st.ok())
      return absl::Status(st.code(), absl::StrCat(path, ":", n, ": ", st.message()));
    ++r.prompts;
    r.tokens += static_cast<int64_t>(ids->size());
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  if (r.prompts == 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": no prompt (one per line)"));
  r.routing = model.routing_stats();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace hmoe
