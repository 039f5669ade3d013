// The worker's GPU memory on /metrics: on the cuda backend
// hmoe_gpu_memory_used_bytes and hmoe_gpu_memory_total_bytes, with
// 0 < used <= total (skips where the worker cannot run cuda); on the cpu
// backend neither series.
#include <httplib.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_pair.h"

namespace hmoe {
namespace {

// A series' value (without labels) in Prometheus text; NaN if absent.
double Value(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    double v = 0;
    if (absl::ConsumePrefix(&line, series + " ") && absl::SimpleAtod(line, &v)) return v;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Starts the pair with `backend` and the HTTP API; its /metrics text, or ""
// (with `log` the worker's log) when the worker did not start.
std::string MetricsOf(testing::Pair& pair, const std::string& backend, std::string* log) {
  pair.set_capture_logs();
  if (!pair.Start(testing::FixturesDir() + "/ds3_fortunes", 1, "tp", "shm",
                  {"--backend=" + backend, "--http-listen=127.0.0.1:0",
                   "--http-port-file=" + pair.file("http.port")})) {
    *log = Slurp(pair.log("worker"));
    return "";
  }
  int port = 0;
  std::ifstream(pair.file("http.port")) >> port;
  httplib::Client http("127.0.0.1", port);
  http.set_read_timeout(10, 0);
  auto res = http.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

TEST(GpuMetrics, CudaWorkerReportsItsDeviceMemory) {
  testing::Pair pair;
  std::string log;
  const std::string text = MetricsOf(pair, "cuda", &log);
  if (text.empty() && absl::StrContains(log, "backend cuda:"))
    GTEST_SKIP() << "the worker cannot run --backend=cuda here: " << log;
  ASSERT_FALSE(text.empty()) << "no /metrics from the worker; its log:\n" << log;
  const double used = Value(text, "hmoe_gpu_memory_used_bytes");
  const double total = Value(text, "hmoe_gpu_memory_total_bytes");
  EXPECT_GT(used, 0) << text;
  EXPECT_GE(total, used) << text;
  EXPECT_TRUE(absl::StrContains(text, "# TYPE hmoe_gpu_memory_used_bytes gauge")) << text;
}

TEST(GpuMetrics, CpuWorkerHasNoGpuSeries) {
  testing::Pair pair;
  std::string log;
  const std::string text = MetricsOf(pair, "cpu", &log);
  ASSERT_FALSE(text.empty()) << "no /metrics from the worker; its log:\n" << log;
  EXPECT_FALSE(absl::StrContains(text, "hmoe_gpu_memory")) << text;
  EXPECT_TRUE(absl::StrContains(text, "hmoe_kv_blocks_used")) << text;
}

}  // namespace
}  // namespace hmoe
