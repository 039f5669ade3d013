#include "common/flags.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

enum class Mode { kTp, kEp };

struct Options {
  bool shm = true;
  bool verbose = false;
  int64_t tokens = 256;
  int threads = 0;
  uint64_t seed = 0;
  double gb = 0;
  std::string listen = "127.0.0.1:1";
  std::vector<std::string> stops;
  Mode mode = Mode::kTp;
  std::string backend = "auto";
  int shard = 0, shards = 1;
};

// Every kind of flag, bound to `o`.
struct Fixture {
  Options o;
  FlagSet fs{"prog", "[flags] ARG", "Does a thing."};
  Fixture() {
    fs.Group("Serving");
    fs.Bool("shm", &o.shm, "shared memory");
    fs.Bool("verbose", &o.verbose, "say more");
    fs.Int("tokens", &o.tokens, 1, 1 << 20, "tokens per call");
    fs.Int("threads", &o.threads, 0, 4096, "threads");
    fs.Uint64("seed", &o.seed, "seed");
    fs.Double(
        "gb", &o.gb, "GiB", [](double x) { return x > 0; }, "a number of GiB > 0");
    fs.String("listen", &o.listen, "HOST:PORT", "where");
    fs.Strings("stop", &o.stops, "STR", "stop string");
    fs.Group("Model");
    fs.Enum<Mode>("split", &o.mode, {{"tp", Mode::kTp}, {"ep", Mode::kEp}}, "split");
    fs.Choice("backend", &o.backend, {"cpu", "cuda", "auto"}, "backend");
    fs.Custom("shard", "i/n", "the shard", [this](std::string_view v) -> absl::Status {
      const size_t slash = v.find('/');
      if (slash == std::string_view::npos) return absl::InvalidArgumentError("not i/n");
      o.shard = std::stoi(std::string(v.substr(0, slash)));
      o.shards = std::stoi(std::string(v.substr(slash + 1)));
      return absl::OkStatus();
    });
    fs.String("prompt", &o.listen, "TEXT", "prompt").Alias("-p");
  }
  absl::Status Parse(std::vector<std::string> args, std::vector<std::string>* pos = nullptr) {
    return fs.Parse(args, pos);
  }
};

TEST(FlagSet, DefaultsStayWhenNothingIsGiven) {
  Fixture f;
  ASSERT_TRUE(f.Parse({}).ok());
  EXPECT_TRUE(f.o.shm);
  EXPECT_EQ(f.o.tokens, 256);
  EXPECT_EQ(f.o.listen, "127.0.0.1:1");
  EXPECT_FALSE(f.fs.seen("tokens"));
}

TEST(FlagSet, EqualsAndNextArgumentSpellings) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--tokens=5", "--threads", "7", "--listen", "-x", "--gb=1.5", "--seed",
                       "18446744073709551615", "--split=ep", "--backend", "cpu", "--shard=1/4"})
                  .ok());
  EXPECT_EQ(f.o.tokens, 5);
  EXPECT_EQ(f.o.threads, 7);
  EXPECT_EQ(f.o.listen, "-x");  // a value flag takes the next argument, whatever it is
  EXPECT_EQ(f.o.gb, 1.5);
  EXPECT_EQ(f.o.seed, UINT64_MAX);
  EXPECT_EQ(f.o.mode, Mode::kEp);
  EXPECT_EQ(f.o.backend, "cpu");
  EXPECT_EQ(f.o.shard, 1);
  EXPECT_EQ(f.o.shards, 4);
  EXPECT_TRUE(f.fs.seen("tokens"));
  EXPECT_FALSE(f.fs.seen("stop"));
}

TEST(FlagSet, EmptyValueAfterEqualsIsAValue) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--listen="}).ok());
  EXPECT_EQ(f.o.listen, "");
  const absl::Status st = f.Parse({"--tokens="});
  EXPECT_EQ(st.message(), "--tokens must be an integer in [1, 1048576], got \"\"");
}

TEST(FlagSet, ValueWithEqualsSignsKeepsThem) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--listen=a=b=c"}).ok());
  EXPECT_EQ(f.o.listen, "a=b=c");
}

TEST(FlagSet, BooleansAloneValuedAndNegated) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--verbose", "--no-shm"}).ok());
  EXPECT_TRUE(f.o.verbose);
  EXPECT_FALSE(f.o.shm);
  ASSERT_TRUE(f.Parse({"--verbose=false", "--shm=1"}).ok());
  EXPECT_FALSE(f.o.verbose);
  EXPECT_TRUE(f.o.shm);
  ASSERT_TRUE(f.Parse({"--no-shm=true"}).ok());
  EXPECT_FALSE(f.o.shm);
  ASSERT_TRUE(f.Parse({"--no-shm=0"}).ok());
  EXPECT_TRUE(f.o.shm);
  ASSERT_TRUE(f.Parse({"--verbose=0"}).ok());
  EXPECT_FALSE(f.o.verbose);
}

TEST(FlagSet, BooleanTakesOnlyItsOwnValue) {
  Fixture f;
  std::vector<std::string> pos;
  // "false" after a bare boolean is positional, not the boolean's value.
  ASSERT_TRUE(f.Parse({"--verbose", "false"}, &pos).ok());
  EXPECT_TRUE(f.o.verbose);
  EXPECT_THAT(pos, ElementsAre("false"));
  for (const char* bad : {"--verbose=yes", "--verbose=2", "--verbose=", "--no-shm=maybe"}) {
    const absl::Status st = f.Parse({bad});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("is true or false, got \"")) << bad;
  }
  EXPECT_EQ(f.Parse({"--verbose=on"}).message(), "--verbose is true or false, got \"on\"");
}

TEST(FlagSet, ErrorsNameTheFlagAndTheValue) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  for (const Case& c : {
           Case{{"--tokens=0"}, "--tokens must be an integer in [1, 1048576], got 0"},
           Case{{"--tokens=x"}, "--tokens must be an integer in [1, 1048576], got x"},
           Case{{"--tokens=5x"}, "--tokens must be an integer in [1, 1048576], got 5x"},
           Case{{"--tokens=99999999999999999999"},
                "--tokens must be an integer in [1, 1048576], got 99999999999999999999"},
           Case{{"--threads", "-1"}, "--threads must be an integer in [0, 4096], got -1"},
           Case{{"--seed=-1"}, "--seed must be an integer in [0, 2^64), got -1"},
           Case{{"--seed=18446744073709551616"},
                "--seed must be an integer in [0, 2^64), got 18446744073709551616"},
           Case{{"--gb=0"}, "--gb must be a number of GiB > 0, got 0"},
           Case{{"--gb=1e"}, "--gb must be a number of GiB > 0, got 1e"},
           Case{{"--split=dp"}, "--split must be tp or ep, got dp"},
           Case{{"--backend=gpu"}, "--backend must be cpu, cuda or auto, got gpu"},
           Case{{"--backend=CPU"}, "--backend must be cpu, cuda or auto, got CPU"},
           Case{{"--shard=3"}, "--shard: not i/n"},
           Case{{"--bogus=1"}, "unknown flag --bogus"},
           Case{{"-x"}, "unknown flag -x"},
           Case{{"--no-listen"}, "unknown flag --no-listen"},  // not a boolean
           Case{{"--tokens"}, "--tokens needs a value"},
           Case{{"--listen"}, "--listen needs a value"},
           Case{{"stray"}, "unexpected argument \"stray\""},
       }) {
    Fixture f;
    const absl::Status st = f.Parse(c.args);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.args[0];
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.says)) << c.args[0];
  }
}

TEST(FlagSet, AnIntFieldIsNeverNarrowedPastItsRange) {
  int n = 0;
  FlagSet fs("prog", "");
  fs.Int("n", &n, INT64_MIN, INT64_MAX, "n");
  EXPECT_FALSE(fs.Parse({"--n=4294967296"}).ok());
  EXPECT_EQ(n, 0);
  ASSERT_TRUE(fs.Parse({"--n=-2147483648"}).ok());
  EXPECT_EQ(n, INT32_MIN);
}

TEST(FlagSet, RepeatedFlagsLastWinsOrAppend) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--tokens=1", "--tokens=2", "--stop", "a", "--stop=b", "--stop="}).ok());
  EXPECT_EQ(f.o.tokens, 2);
  EXPECT_THAT(f.o.stops, ElementsAre("a", "b", ""));
}

TEST(FlagSet, PositionalArgumentsKeepTheirOrder) {
  Fixture f;
  std::vector<std::string> pos;
  ASSERT_TRUE(f.Parse({"a", "--tokens=3", "-", "b", "-p", "hi"}, &pos).ok());
  EXPECT_THAT(pos, ElementsAre("a", "-", "b"));  // "-" alone is positional
  EXPECT_EQ(f.o.listen, "hi");                   // by its alias
  EXPECT_TRUE(f.fs.seen("prompt"));
}

TEST(FlagSet, HelpAnywhereWinsOverErrors) {
  Fixture f;
  ASSERT_TRUE(f.Parse({"--bogus", "--tokens=0", "-h"}).ok());
  EXPECT_TRUE(f.fs.help_requested());
  EXPECT_EQ(f.o.tokens, 256);  // nothing parsed
  Fixture g;
  // As a value it is still a request for help.
  ASSERT_TRUE(g.Parse({"--listen", "--help"}).ok());
  EXPECT_TRUE(g.fs.help_requested());
}

TEST(FlagSet, ParseOrExitGivesTheExitCode) {
  Fixture f;
  EXPECT_EQ(f.fs.ParseOrExit({"--tokens=3"}), std::nullopt);
  EXPECT_EQ(f.fs.ParseOrExit({"--tokens=0"}), 2);
  EXPECT_EQ(f.fs.ParseOrExit({"--tokens=3"}, nullptr,
                             [] { return absl::InvalidArgumentError("--a needs --b"); }),
            2);
  testing::internal::CaptureStdout();
  EXPECT_EQ(f.fs.ParseOrExit({"--help"}), 0);
  EXPECT_THAT(testing::internal::GetCapturedStdout(), HasSubstr("usage: prog [flags] ARG"));
}

TEST(FlagSet, UsageListsGroupsFlagsAndDefaults) {
  Fixture f;
  const std::string u = f.fs.Usage();
  EXPECT_THAT(u, HasSubstr("usage: prog [flags] ARG\nDoes a thing.\n"));
  EXPECT_THAT(u, HasSubstr("\nServing:\n  --[no-]shm\n      shared memory (default on)\n"));
  EXPECT_THAT(u, HasSubstr("  --tokens N\n      tokens per call (default 256)\n"));
  EXPECT_THAT(u, HasSubstr("  --listen HOST:PORT\n      where (default 127.0.0.1:1)\n"));
  EXPECT_THAT(u, HasSubstr("  --stop STR\n      stop string (repeatable)\n"));
  EXPECT_THAT(u, HasSubstr("\nModel:\n  --split tp|ep\n      split (default tp)\n"));
  EXPECT_THAT(u, HasSubstr("  --backend cpu|cuda|auto\n      backend (default auto)\n"));
  EXPECT_THAT(u, HasSubstr("  --prompt TEXT, -p\n"));
  EXPECT_LT(u.find("Serving:"), u.find("Model:"));
}

}  // namespace
}  // namespace hmoe
