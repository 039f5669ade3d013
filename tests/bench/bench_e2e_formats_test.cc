// hmoe-bench-e2e takes every weight format the expert service serves, the
// native checkpoint formats included (its --format is ParseFormatFlag's): a
// brief CPU run of the tiny preset per format, the service started by the
// benchmark with synthetic experts quantized to that format.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/experts/format_codes.h"
#include "common/experts/weight_format.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Runs hmoe-bench-e2e with `args` (output to `log`); its exit status.
int RunBench(const std::string& args, const std::string& log) {
  const std::string cmd =
      absl::StrCat(HMOE_BINARY_DIR, "/bin/hmoe-bench-e2e ", args, " >", log, " 2>&1");
  const int st = std::system(cmd.c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class BenchE2eFormatTest : public ::testing::TestWithParam<const char*> {};

TEST_P(BenchE2eFormatTest, TinyPresetRunsOnTheCpu) {
  const std::string name = GetParam();
  auto fg = ParseFormatFlag(name);
  ASSERT_TRUE(fg.ok()) << fg.status();
  ::hmoe::testing::TempDir dir;
  const std::string json = dir.file("out.json"), log = dir.file("log.txt");
  const int rc = RunBench(
      absl::StrCat("--preset tiny --format ", name,
                   " --backend cpu --threads 1 --service-threads 1 --prompts 8 --batches 1,2 "
                   "--decode-prompt 4 --decode-steps 2 --warmup 0 --probe-bytes 8 --probe-reps 1 "
                   "--no-probe-after --service-timeout-s 60 --work-dir ",
                   dir.file("work"), " --json ", json),
      log);
  ASSERT_EQ(rc, 0) << ReadFile(log);
  const nlohmann::json j = nlohmann::json::parse(ReadFile(json));
  // The format the service was started with, and its packed size: the codes
  // and scales of the format's traits (gate and up [128][128], down [128][128]).
  EXPECT_EQ(j["format"], WeightFormatName(fg->first, fg->second));
  const int64_t H = 128, I = 128;
  const double want = static_cast<double>(2 * MatrixBytes(fg->first, fg->second, I, H) +
                                          MatrixBytes(fg->first, fg->second, H, I)) /
                      (3.0 * H * I);
  EXPECT_NEAR(j["bytes_per_weight"].get<double>(), want, 0.05 * want) << j["bytes_per_weight"];
  ASSERT_EQ(j["prefill"].size(), 1u);
  ASSERT_EQ(j["decode"].size(), 2u);
  for (const auto& d : j["decode"]) {
    EXPECT_GT(d["tok_s"].get<double>(), 0.0) << d;
    // Every step's MoE layers waited on the service: the experts ran there.
    EXPECT_GT(d["expert_wait_ms_per_step"].get<double>(), 0.0) << d;
  }
  EXPECT_NE(ReadFile(log).find(absl::StrCat("--format ", WeightFormatName(fg->first, fg->second))),
            std::string::npos);
  EXPECT_EQ(j["fit_check"], false);
  EXPECT_EQ(ReadFile(log).find("FIT CHECK"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Formats, BenchE2eFormatTest,
                         ::testing::Values("mxfp4", "int4bf16", "int4bf16g64", "fp8", "mxfp8",
                                           "int4g32"));

// --alias-experts N: the service holds N experts for every layer; the run
// says it is a fit check on stdout's header, above every table and in the
// JSON, and the service's ready line says so too.
TEST(BenchE2eFitCheck, AliasedExpertsAreLabelledInEveryOutput) {
  ::hmoe::testing::TempDir dir;
  const std::string json = dir.file("out.json"), log = dir.file("log.txt");
  const int rc = RunBench(
      absl::StrCat("--preset tiny --format int4 --alias-experts 3 --backend cpu --threads 1 "
                   "--service-threads 1 --prompts 8 --batches 1 --decode-prompt 4 "
                   "--decode-steps 2 --warmup 0 --probe-bytes 8 --probe-reps 1 --no-probe-after "
                   "--service-timeout-s 60 --work-dir ",
                   dir.file("work"), " --json ", json),
      log);
  const std::string out = ReadFile(log);
  ASSERT_EQ(rc, 0) << out;
  const std::string label = "FIT CHECK (aliased experts): not a speed figure";
  EXPECT_NE(out.find("# " + label + ": every routed expert is one of 3 distinct weight sets"),
            std::string::npos)
      << out;
  // Each table (prefill, decode) right under the label.
  for (const char* table : {"prompt ", "batch "}) {
    const size_t at = out.find(absl::StrCat("\n# ", label, "\n", table));
    EXPECT_NE(at, std::string::npos) << table << "\n" << out;
  }
  EXPECT_NE(out.find(",alias=3"), std::string::npos) << out;  // the service's spec
  const nlohmann::json j = nlohmann::json::parse(ReadFile(json));
  EXPECT_EQ(j["fit_check"], true);
  EXPECT_EQ(j["fit_check_note"], label);
  EXPECT_EQ(j["options"]["alias_experts"], 3);
  const std::string service = ReadFile(dir.file("work") + "/service.log");
  EXPECT_NE(service.find("ALIASED EXPERTS (3 distinct weight sets): FIT CHECK, not a speed figure"),
            std::string::npos)
      << service;
}

TEST(BenchE2eFormat, AnUnknownFormatIsAFlagError) {
  ::hmoe::testing::TempDir dir;
  const std::string log = dir.file("log.txt");
  EXPECT_EQ(RunBench("--preset tiny --format mxfp5 --backend cpu", log), 2);
  const std::string out = ReadFile(log);
  EXPECT_NE(out.find("mxfp5"), std::string::npos) << out;
  EXPECT_NE(out.find("mxfp4"), std::string::npos) << out;  // the names taken
}

}  // namespace
}  // namespace hmoe
