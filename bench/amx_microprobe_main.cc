// hmoe-amx-microprobe's command line: AMX micro-kernel schedules measured
// alone (amx_microprobe.cc's header says how). Compiled without the AMX
// flags, so that --help and flag errors work on any CPU.
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/amx_microprobe.h"
#include "common/flags.h"

namespace hmoe {
namespace {

struct Args {
  bool pairs = false;
  bool rows = false;
  int threads = 16;
  double seconds = 0;  // 0: 0.3 per case, 0.2 with --pairs or --rows
};

void AddFlags(FlagSet& fs, Args* a) {
  fs.Bool("pairs", &a->pairs,
          "find which logical CPUs share one AMX unit (hyperthread siblings a VM may not "
          "report): the register-only loop on CPU 0 alone, then on CPU 0 and CPU c together for "
          "every c (and the same from CPU 1)");
  fs.Bool("rows", &a->rows,
          "whether a tile product over M < 16 rows takes less time: the register-only loop with "
          "M rows against M = 16, on one thread and --threads");
  fs.Int("threads", &a->threads, 1, 4096, "threads of the all-threads runs (also positional)");
  fs.Double(
      "seconds", &a->seconds,
      "seconds per case (also positional; 0: 0.3, 0.2 with --pairs or --rows)",
      [](double x) { return x >= 0 && x <= 3600; }, "seconds in [0, 3600]");
}

// The positional spellings: [THREADS] [SECONDS], with --pairs [SECONDS].
absl::Status TakePositional(const FlagSet& fs, const std::vector<std::string>& pos, Args* a) {
  const size_t max = a->pairs ? 1 : 2;
  if (pos.size() > max) return UnexpectedArgument(pos[max]);
  size_t i = 0;
  if (!a->pairs && i < pos.size()) {
    if (fs.seen("threads")) return UnexpectedArgument(pos[i]);
    int n = 0;
    if (!absl::SimpleAtoi(pos[i], &n) || n < 1 || n > 4096)
      return absl::InvalidArgumentError(
          absl::StrCat("THREADS must be an integer in [1, 4096], got ", pos[i]));
    a->threads = n;
    ++i;
  }
  if (i < pos.size()) {
    if (fs.seen("seconds")) return UnexpectedArgument(pos[i]);
    double x = 0;
    if (!absl::SimpleAtod(pos[i], &x) || !(x >= 0 && x <= 3600))
      return absl::InvalidArgumentError(
          absl::StrCat("SECONDS must be seconds in [0, 3600], got ", pos[i]));
    a->seconds = x;
  }
  if (a->pairs && a->rows)
    return absl::InvalidArgumentError("--pairs and --rows exclude each other");
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Args a;
  FlagSet fs("hmoe-amx-microprobe", "[flags] [THREADS] [SECONDS]  |  --pairs [SECONDS]",
             "AMX micro-kernel schedules measured alone, operands in L1 or L2, on one thread and\n"
             "THREADS threads: each schedule's rate as % of the register-only loop (the \"AMX\n"
             "peak\" hmoe-bench-moe reports). Runs only on AMX machines.");
  AddFlags(fs, &a);
  std::vector<std::string> positional;
  if (std::optional<int> exit =
          fs.ParseOrExit(std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + argc),
                         &positional, [&] { return TakePositional(fs, positional, &a); }))
    return *exit;
  const bool short_cases = a.pairs || a.rows;
  const double seconds = a.seconds > 0 ? a.seconds : short_cases ? 0.2 : 0.3;
  const amx_probe::Mode mode = a.pairs  ? amx_probe::Mode::kPairs
                               : a.rows ? amx_probe::Mode::kRows
                                        : amx_probe::Mode::kSchedules;
  return amx_probe::Run(mode, a.threads, seconds);
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
