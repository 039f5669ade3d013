// Command-line flags of the binaries: out-of-range numbers and malformed
// booleans stop them with exit status 2 and the flag named, before anything
// loads or connects.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

struct Outcome {
  int exit_code = -1;
  std::string err;
};

// Runs `command` (a shell line), stderr captured.
Outcome Shell(const testing::TempDir& dir, const std::string& command) {
  const std::string err = dir.file("stderr");
  const int status = std::system((command + " >/dev/null 2>" + err).c_str());
  std::ifstream in(err);
  Outcome r;
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Numbers past what the worker's int fields hold were narrowed (4294967296
// ms of expert timeout became 0: every expert call timed out).
TEST(Flags, WorkerRefusesNumbersOutsideTheirRange) {
  testing::TempDir dir;
  const std::string worker = std::string(HMOE_BINARY_DIR) + "/bin/hmoe-gpu-worker";
  const std::string model = testing::FixturesDir() + "/ds3_fortunes";
  struct Case {
    std::string flag, says;
  };
  for (const Case& c : {
           Case{"--expert-timeout-ms=4294967296", "--expert-timeout-ms must be an integer in [1, "},
           Case{"--max-batch=4294967296", "--max-batch must be an integer in [1, 4096]"},
           Case{"--drain-seconds=2147483648", "--drain-seconds must be an integer in [0, "},
           Case{"--max-context=1000000000000000000", "--max-context must be an integer in [0, "},
           Case{"--threads=99999999999999999999", "--threads must be an integer in [0, 4096]"},
           Case{"--max-queue=0", "--max-queue must be an integer in [1, "},
       }) {
    const Outcome r = Shell(dir, absl::StrCat(worker, " --model ", model, " ", c.flag));
    EXPECT_EQ(r.exit_code, 2) << c.flag << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.flag;
  }
}

// A boolean flag's value counts: --ignore-eos=false is false (it was true,
// as any value was), and a value that is neither is an error.
TEST(Flags, HmoeBooleanFlagsTakeTheirValue) {
  testing::TempDir dir;
  const std::string hmoe =
      absl::StrCat("env -u HMOE_TOKEN_FILE -u HMOE_TLS_CA_FILE ", HMOE_BINARY_DIR, "/bin/hmoe");
  for (const std::string& cmd :
       {std::string(" generate -p hi --ignore-eos=maybe"), std::string(" generate -p hi --ids=2"),
        std::string(" bench-serve --add-special-tokens=yess")}) {
    const Outcome r = Shell(dir, hmoe + cmd + " --server 127.0.0.1:1");
    EXPECT_EQ(r.exit_code, 2) << cmd << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("is true or false, got")) << cmd;
  }
  // Well-formed values get past the flags (and fail on the closed port,
  // after the client's 10 s connect timeout).
  const Outcome r =
      Shell(dir, hmoe + " generate -p hi --ignore-eos=false --ids --server 127.0.0.1:1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("true or false")));
}

}  // namespace
}  // namespace hmoe
