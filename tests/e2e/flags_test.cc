// Command-line flags of the binaries: out-of-range numbers and malformed
// booleans stop them with exit status 2 and the flag named, before anything
// loads or connects.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

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
           Case{"--cuda-graphs=maybe", "--cuda-graphs must be on or off, got maybe"},
           Case{"--cuda-expert-slots=1", "--cuda-expert-slots must be on or off, got 1"},
           Case{"--gemm-attention-tokens=-1",
                "--gemm-attention-tokens must be an integer in [0, 1048576], got -1"},
           Case{"--gemm-attention-tf32=yes", "--gemm-attention-tf32 must be on or off, got yes"},
           Case{"--debug-cuda-fault-after=0",
                "--debug-cuda-fault-after must be an integer in [1, "},
           Case{"--cuda-expert-calls=gpu", "--cuda-expert-calls must be device or host, got gpu"},
           Case{"--hot-experts-gb=0", "--hot-experts-gb must be a number of GiB > 0, got 0"},
           Case{"--hot-experts-gb=x", "--hot-experts-gb must be a number of GiB > 0, got x"},
           Case{"--hot-experts=stats.json", "--hot-experts and --hot-experts-gb go together"},
           Case{"--calibrate=prompts.txt", "--calibrate and --hot-experts-gb go together"},
           Case{"--prefill-chunk=0", "--prefill-chunk must be an integer in [1, 1048576], got 0"},
           Case{"--prefill-experts=gpu", "--prefill-experts must be cpu, stream or auto, got gpu"},
           Case{"--backend=cpu --prefill-experts=stream",
                "--prefill-experts stream needs the cuda backend (backend cpu)"},
           Case{"--prefill-rates=r.json", "--prefill-rates needs --prefill-experts auto"},
           Case{"--prefill-prefetch=yes", "--prefill-prefetch must be on or off, got yes"},
           Case{"--gpu-weights=int3",
                "--gpu-weights must be auto, bf16, fp8, int8 or int4, got int3"},
           Case{"--kv-dtype=fp16", "--kv-dtype must be f32, bf16 or fp8, got fp16"},
           Case{"--hot-experts-gb=1", "--hot-experts-gb needs --hot-experts STATS or --calibrate"},
           Case{"--hot-experts=s.json --calibrate=p.txt --hot-experts-gb=1",
                "--hot-experts and --calibrate are exclusive"},
           Case{"--backend=cpu --calibrate=p.txt --hot-experts-gb=1",
                "--calibrate needs the cuda backend (backend cpu)"},
           Case{"--hot-experts-fill",
                "--hot-experts-fill needs --hot-experts STATS or --calibrate"},
           Case{"--hot-experts-fill --hot-experts=s.json --hot-experts-gb=1",
                "--hot-experts-fill and --hot-experts-gb are exclusive"},
           Case{"--backend=cpu --hot-experts-fill --hot-experts=s.json",
                "--hot-experts-fill needs the cuda backend (backend cpu)"},
       }) {
    const Outcome r = Shell(dir, absl::StrCat(worker, " --model ", model, " ", c.flag));
    EXPECT_EQ(r.exit_code, 2) << c.flag << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.flag;
  }
}

// --hot-experts reads its routing statistics at start: a missing or foreign
// file stops the worker (exit 1) naming the file and what differs; good
// stats on the CPU backend are refused (exit 2: hot experts need a GPU).
TEST(Flags, WorkerHotExpertsStatsAreCheckedAtStart) {
  testing::TempDir dir;
  const std::string worker = std::string(HMOE_BINARY_DIR) + "/bin/hmoe-gpu-worker";
  const std::string model = testing::FixturesDir() + "/ds3_fortunes";
  const std::string missing = dir.file("none.json"), foreign = dir.file("foreign.json"),
                    good = dir.file("good.json");
  {
    std::ofstream f(foreign);
    f << R"({"format": "hmoe-routing-stats-1", "model_type": "qwen3_moe", "num_experts": 8,)"
      << R"( "experts_per_token": 2, "tokens": 0, "layers": []})";
  }
  auto cfg = LoadModelConfig(model);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  {
    std::ofstream f(good);
    f << R"({"format": "hmoe-routing-stats-1", "model_type": ")" << cfg->model_type
      << R"(", "num_experts": )" << cfg->moe.num_experts << R"(, "experts_per_token": )"
      << cfg->moe.experts_per_token << R"(, "tokens": 0, "layers": []})";
  }
  const std::string base = absl::StrCat(worker, " --model ", model, " --backend cpu");
  Outcome r = Shell(dir, base + " --hot-experts " + missing + " --hot-experts-gb 1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr(missing));
  r = Shell(dir, base + " --hot-experts " + foreign + " --hot-experts-gb 1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr(foreign));
  EXPECT_THAT(r.err, HasSubstr("do not describe this model"));
  r = Shell(dir, base + " --hot-experts " + good + " --hot-experts-gb 1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--hot-experts needs the cuda backend (backend cpu)"));
}

// --prefill-rates reads its file at start: a missing or malformed one stops
// the worker (exit 1) naming the file (and the field), before the backend
// is checked.
TEST(Flags, WorkerPrefillRatesAreCheckedAtStart) {
  testing::TempDir dir;
  const std::string worker = std::string(HMOE_BINARY_DIR) + "/bin/hmoe-gpu-worker";
  const std::string model = testing::FixturesDir() + "/ds3_fortunes";
  const std::string missing = dir.file("none.json"), bad = dir.file("bad.json");
  {
    std::ofstream f(bad);
    f << R"({"format": "hmoe-prefill-rates-1", "pcie_gbps": 50, "cpu": []})";
  }
  const std::string base =
      absl::StrCat(worker, " --model ", model, " --backend cpu --prefill-experts auto");
  Outcome r = Shell(dir, base + " --prefill-rates " + missing);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr(missing));
  r = Shell(dir, base + " --prefill-rates " + bad);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr(bad));
  EXPECT_THAT(r.err, HasSubstr("gpu_tflops"));
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
  // Every subcommand checks its flags before it connects (chat did after
  // connecting, asking the model and reading a line), refuses arguments it
  // would have dropped, and a negative --timeout.
  struct Case {
    std::string cmd, says;
  };
  for (const Case& c : {
           Case{" chat --ignore-eos=maybe", "is true or false, got"},
           Case{" chat --temperature=abc", "--temperature must be a number"},
           Case{" chat --timeout=-5", "--timeout must be >= 0 seconds"},
           Case{" chat extra", "unexpected argument \"extra\""},
           Case{" generate -p hi --ignore-eos false", "unexpected argument \"false\""},
           Case{" generate -p hi --timeout -5", "--timeout must be >= 0 seconds"},
           Case{" bench-serve 'my prompt'", "unexpected argument \"my prompt\""},
       }) {
    const Outcome r = Shell(dir, hmoe + c.cmd + " --server 127.0.0.1:1 </dev/null");
    EXPECT_EQ(r.exit_code, 2) << c.cmd << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.cmd;
  }
  // Well-formed values get past the flags (and fail on the closed port,
  // after the client's 10 s connect timeout).
  const Outcome r =
      Shell(dir, hmoe + " generate -p hi --ignore-eos=false --ids --server 127.0.0.1:1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("true or false")));
}

// hmoe inspect's GPU memory plan flags: bad values stop it with exit 2
// naming the flag and the value; a plan flag needs --gpu-mem-gb.
TEST(Flags, InspectPlanFlags) {
  testing::TempDir dir;
  const std::string inspect =
      absl::StrCat(HMOE_BINARY_DIR, "/bin/hmoe inspect ", testing::FixturesDir(),
                   "/configs/deepseek_v3_published");
  struct Case {
    std::string flags, says;
  };
  for (const Case& c : {
           Case{"--gpu-mem-gb 0", "--gpu-mem-gb must be a number of GiB > 0, got 0"},
           Case{"--gpu-mem-gb -3", "--gpu-mem-gb must be a number of GiB > 0, got -3"},
           Case{"--gpu-mem-gb 24 --context 0", "--context must be an integer in [1, "},
           Case{"--gpu-mem-gb 24 --context -5", "--context must be an integer in [1, "},
           Case{"--gpu-mem-gb 24 --batch 0", "--batch must be an integer in [1, 4096], got 0"},
           Case{"--gpu-mem-gb 24 --gpu-weights int3",
                "--gpu-weights must be auto, bf16, fp8, int8 or int4, got int3"},
           Case{"--gpu-mem-gb 24 --kv-dtype fp16", "--kv-dtype must be f32, bf16 or fp8, got fp16"},
           Case{"--gpu-mem-gb 24 --fill-hot int3", "--fill-hot: "},
           Case{"--context 4096", "--context is a GPU memory plan flag: it needs --gpu-mem-gb"},
       }) {
    const Outcome r = Shell(dir, absl::StrCat(inspect, " ", c.flags));
    EXPECT_EQ(r.exit_code, 2) << c.flags << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.flags;
  }
  const Outcome ok =
      Shell(dir, absl::StrCat(inspect, " --gpu-mem-gb 16 --context 32768 --kv-dtype fp8"));
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// --help prints the usage and exits 0 (the service answered "--help: needs
// a value"; hmoe's subcommands "unknown flag --help").
TEST(Flags, HelpPrintsUsage) {
  testing::TempDir dir;
  const std::string bin = std::string(HMOE_BINARY_DIR) + "/bin/";
  for (const std::string& cmd :
       {bin + "hmoe-expert-service --help", bin + "hmoe-gpu-worker --help", bin + "hmoe --help",
        bin + "hmoe generate --help", bin + "hmoe convert --help", bin + "hmoe chat -h"}) {
    const std::string out = dir.file("out");
    const int status = std::system((cmd + " >" + out + " 2>&1").c_str());
    std::ifstream in(out);
    const std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd << ": " << said;
    EXPECT_THAT(said, HasSubstr("usage:")) << cmd;
  }
}

// The service's on/off flags take a value too: --null-compute=false is off
// (it was on: every call answered zeros), a value that is neither is an error.
TEST(Flags, ServiceBooleanFlagsTakeTheirValue) {
  testing::TempDir dir;
  const std::string service = std::string(HMOE_BINARY_DIR) + "/bin/hmoe-expert-service";
  const std::string model = "--synthetic=hidden=64,intermediate=32,experts=4,top_k=2";
  for (const char* flag : {"--null-compute=maybe", "--no-shm=yes", "--no-memory-check=2"}) {
    const Outcome r = Shell(dir, absl::StrCat(service, " ", model, " ", flag));
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("is true or false, got")) << flag;
  }
  struct Case {
    std::vector<std::string> flags;
    std::string says, not_says;
  };
  for (const Case& c :
       {Case{{"--null-compute=false", "--no-shm=0", "--no-ucx=1"},
             " shm=1 ucx=0 ",
             "null_compute=1"},
        Case{{"--null-compute", "--no-shm=true", "--no-ucx"}, "null_compute=1", " shm=1 "}}) {
    testing::ServiceProcess proc;
    const std::string err = dir.file(absl::StrCat("err", c.says.size()));
    proc.set_stderr_file(err);
    std::vector<std::string> args = {model};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    ASSERT_TRUE(proc.Start(args, dir.file("port"))) << c.says;
    std::ifstream in(err);
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_THAT(log, HasSubstr(c.says));
    EXPECT_THAT(log, ::testing::Not(HasSubstr(c.not_says)));
  }
}

// A --port-file the service cannot write stops it before it loads (it served
// without ever writing the file its launcher waits for).
TEST(Flags, ServicePortFileThatCannotBeWrittenStopsItAtStart) {
  testing::TempDir dir;
  const std::string service = std::string(HMOE_BINARY_DIR) + "/bin/hmoe-expert-service";
  const Outcome r =
      Shell(dir, absl::StrCat(service, " --synthetic=hidden=64,intermediate=32,experts=4,top_k=2 ",
                              "--no-ucx --listen=127.0.0.1:0 --port-file=", dir.file("missing/p")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot write --port-file " + dir.file("missing/p")));
}

// A free TCP port on loopback (bound and released).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// The systemd unit's --port-offset (the NUMA node added to the port) is
// parsed (it was refused as an unknown flag: the unit restart-looped), and a
// second service on a port in use fails to start instead of sharing it
// (gRPC's default SO_REUSEPORT).
TEST(Flags, ServicePortOffsetAndATakenPort) {
  testing::TempDir dir;
  const std::string model = "--model-dir=" + testing::FixturesDir() + "/deepseek_v3_tiny";
  int port = 0;
  for (int i = 0; i < 20 && port < 2; ++i) port = FreePort();
  ASSERT_GE(port, 2);
  testing::ServiceProcess first;
  ASSERT_TRUE(first.Start({model, "--port-offset=1", "--no-ucx"}, dir.file("p1"), port - 1));
  EXPECT_EQ(first.target(), absl::StrCat("127.0.0.1:", port));
  testing::ServiceProcess second;
  EXPECT_FALSE(second.Start({model, "--no-ucx"}, dir.file("p2"), port));
  EXPECT_TRUE(WIFEXITED(second.exit_status()) && WEXITSTATUS(second.exit_status()) == 1)
      << second.exit_status();
}

}  // namespace
}  // namespace hmoe
