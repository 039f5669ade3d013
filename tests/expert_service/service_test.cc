// The expert-service shard core (in process) and the service process:
// sharding arithmetic, validation, formats, options, SIGTERM drain, the
// systemd unit.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "common/transport/expert_pool.h"
#include "expert_service/server/expert_shard.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::MakeRandomCall;
using ::hmoe::testing::MaxRelDiff;

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }

std::unique_ptr<ExpertShard> Load(int i, int n, SplitMode split,
                                  const std::string& format = "bf16") {
  ShardOptions o;
  o.model_dir = ModelDir();
  o.shard_index = i;
  o.num_shards = n;
  o.split = split;
  auto f = ParseServeFormat(format, &o.group);
  EXPECT_TRUE(f.ok());
  o.format = *f;
  auto s = ExpertShard::Load(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// An independent f32 computation straight from the checkpoint (bf16 weights).
TEST(ExpertShard, MatchesPlainComputationFromCheckpoint) {
  auto shard = Load(0, 1, SplitMode::kTp);
  ASSERT_TRUE(shard);
  const ShardInfo& info = shard->info();
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok());
  auto call = MakeRandomCall(info, info.moe_layers[1], 3, 11);
  std::vector<float> got(static_cast<size_t>(3 * info.hidden));
  ASSERT_TRUE(shard->Handle(call.call(), got.data(), nullptr).ok());
  const int64_t H = info.hidden, I = info.intermediate;
  std::vector<float> want(got.size(), 0.f);
  for (int t = 0; t < 3; ++t) {
    for (int j = 0; j < call.top_k; ++j) {
      const int e = call.ids[static_cast<size_t>(t * call.top_k + j)];
      auto name = [&](const char* p) {
        return absl::StrCat("model.layers.", call.layer, ".mlp.experts.", e, ".", p, ".weight");
      };
      auto g = ckpt.value()->Get(name("gate_proj"))->ToF32();
      auto u = ckpt.value()->Get(name("up_proj"))->ToF32();
      auto d = ckpt.value()->Get(name("down_proj"))->ToF32();
      std::vector<float> h(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) {
        double gs = 0, us = 0;
        for (int64_t c = 0; c < H; ++c) {
          const double x = Bf16ToF32(call.hidden[static_cast<size_t>(t * H + c)]);
          gs += g[static_cast<size_t>(i * H + c)] * x;
          us += u[static_cast<size_t>(i * H + c)] * x;
        }
        h[static_cast<size_t>(i)] = static_cast<float>(gs / (1 + std::exp(-gs)) * us);
      }
      for (int64_t c = 0; c < H; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < I; ++i)
          acc += d[static_cast<size_t>(c * I + i)] * h[static_cast<size_t>(i)];
        want[static_cast<size_t>(t * H + c)] +=
            call.weights[static_cast<size_t>(t * call.top_k + j)] * static_cast<float>(acc);
      }
    }
  }
  // The shard rounds h to bf16 (the kernels' definition): bf16-level agreement.
  EXPECT_LT(MaxRelDiff(got, want), 2e-2);
}

TEST(ExpertShard, TpPartialsAndEpPartsSumToWhole) {
  auto whole = Load(0, 1, SplitMode::kTp);
  ASSERT_TRUE(whole);
  const ShardInfo& info = whole->info();
  auto call = MakeRandomCall(info, info.moe_layers[0], 9, 3);
  std::vector<float> want(static_cast<size_t>(9 * info.hidden));
  ASSERT_TRUE(whole->Handle(call.call(), want.data(), nullptr).ok());
  for (SplitMode split : {SplitMode::kTp, SplitMode::kEp}) {
    for (int n : {2, 3}) {
      std::vector<float> sum(want.size(), 0.f), part(want.size());
      int64_t covered = 0;
      for (int i = 0; i < n; ++i) {
        auto s = Load(i, n, split);
        ASSERT_TRUE(s);
        covered += split == SplitMode::kTp ? s->info().i_end - s->info().i_begin
                                           : s->info().expert_end - s->info().expert_begin;
        ASSERT_TRUE(s->Handle(call.call(), part.data(), nullptr).ok());
        for (size_t k = 0; k < sum.size(); ++k) sum[k] += part[k];
      }
      EXPECT_EQ(covered, split == SplitMode::kTp ? info.intermediate : info.num_experts);
      EXPECT_LT(MaxRelDiff(sum, want), 1e-5) << SplitModeName(split) << " " << n;
    }
  }
}

TEST(ExpertShard, QuantizedFormatsStayClose) {
  auto ref = Load(0, 1, SplitMode::kTp, "bf16");
  ASSERT_TRUE(ref);
  const ShardInfo& info = ref->info();
  auto call = MakeRandomCall(info, info.moe_layers[0], 4, 8);
  std::vector<float> want(static_cast<size_t>(4 * info.hidden)), got(want.size());
  ASSERT_TRUE(ref->Handle(call.call(), want.data(), nullptr).ok());
  double norm = 0;
  for (float v : want) norm = std::max(norm, static_cast<double>(std::fabs(v)));
  for (const char* f : {"int8", "int4g32", "int4g64"}) {
    auto s = Load(0, 1, SplitMode::kTp, f);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->info().weight_format, f);
    ASSERT_TRUE(s->Handle(call.call(), got.data(), nullptr).ok());
    double err = 0;
    for (size_t i = 0; i < got.size(); ++i)
      err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
    EXPECT_LT(err, (f[3] == '8' ? 0.03 : 0.3) * norm) << f;
    EXPECT_GT(err, 0) << f;
  }
}

TEST(ExpertShard, OptionsValidatedWithClearErrors) {
  ShardOptions o;
  EXPECT_NE(o.Validate().message().find("--model-dir"), absl::string_view::npos);
  o.model_dir = ModelDir();
  o.shard_index = 2;
  o.num_shards = 2;
  EXPECT_NE(o.Validate().message().find("--shard"), absl::string_view::npos);
  o.shard_index = 0;
  o.num_shards = 17;
  o.split = SplitMode::kEp;
  auto s = ExpertShard::Load(o);  // 17 ep shards for 16 experts
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  int g = 0;
  EXPECT_FALSE(ParseServeFormat("int4g48", &g).ok());
  EXPECT_FALSE(ParseServeFormat("fp4", &g).ok());
  ShardOptions bad;
  bad.model_dir = "/nonexistent-model";
  EXPECT_FALSE(ExpertShard::Load(bad).ok());
}

TEST(ExpertShard, DrainingRefusesNewCalls) {
  auto s = Load(0, 1, SplitMode::kTp);
  ASSERT_TRUE(s);
  auto call = MakeRandomCall(s->info(), s->info().moe_layers[0], 1, 1);
  std::vector<float> out(static_cast<size_t>(s->info().hidden));
  s->SetDraining();
  EXPECT_EQ(s->Handle(call.call(), out.data(), nullptr).code(), absl::StatusCode::kUnavailable);
}

// ---- the process ---------------------------------------------------------------

TEST(ServiceProcess, SigtermFinishesInFlightThenExitsZero) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  // Big enough that one call takes a while in the scalar reference.
  ASSERT_TRUE(proc.Start({"--synthetic=hidden=512,intermediate=256,experts=8,top_k=8,layers=1",
                          "--no-ucx", "--no-shm"},
                         dir.file("port")));
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto call = MakeRandomCall((*pool)->model(), 0, 48, 2);
  std::vector<float> out(static_cast<size_t>(48 * 512));
  auto h = (*pool)->Submit(call.call(), out.data());
  ASSERT_TRUE(h.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  proc.Signal(SIGTERM);
  absl::Status st = (*pool)->Wait(*h, absl::Now() + absl::Seconds(60));
  EXPECT_TRUE(st.ok()) << st;  // the in-flight call finished
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  pid_t r = 0;
  while ((r = waitpid(proc.pid(), &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(r, proc.pid());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  // New calls after shutdown are refused, not hung.
  st = (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
}

TEST(ServiceProcess, BadFlagsAndUnloadableModelExitNonZero) {
  ::hmoe::testing::TempDir dir;
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--model-dir=" + ModelDir(), "--shard=3/2"},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--numa-node=4096"},
        std::vector<std::string>{"--model-dir=/nonexistent"},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--bogus=1"}}) {
    ::hmoe::testing::ServiceProcess proc;
    EXPECT_FALSE(proc.Start(args, dir.file("port"))) << args.back();
  }
}

TEST(ServiceProcess, NumaNodeBinding) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + ModelDir(), "--numa-node=0", "--no-ucx"}, dir.file("port")));
  std::ifstream f("/proc/" + std::to_string(proc.pid()) + "/status");
  std::string line, mems;
  while (std::getline(f, line)) {
    if (line.rfind("Mems_allowed_list:", 0) == 0) mems = line;
  }
  EXPECT_FALSE(mems.empty());
}

// ---- deploy ----------------------------------------------------------------------

TEST(Deploy, SystemdUnitVerifies) {
  if (std::system("command -v systemd-analyze >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "systemd-analyze not available";
  }
  ::hmoe::testing::TempDir dir;
  const std::string src = std::string(HMOE_SOURCE_DIR) + "/deploy/systemd";
  std::ifstream in(src + "/hmoe-expert-service@.service");
  std::string unit((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(unit.empty());
  auto replace = [&](const std::string& from, const std::string& to) {
    for (size_t p = unit.find(from); p != std::string::npos; p = unit.find(from, p + to.size())) {
      unit.replace(p, from.size(), to);
    }
  };
  replace("/usr/local/bin/hmoe-expert-service", ::hmoe::testing::ServiceBinary());
  replace("/etc/hmoe/expert-service.conf", src + "/expert-service.conf");
  std::ofstream(dir.file("hmoe-expert-service@.service")) << unit;
  const std::string cmd =
      absl::StrCat("cd ", dir.path(), " && systemd-analyze verify --man=no ",
                   dir.file("hmoe-expert-service@0.service"), " > ", dir.file("out"), " 2>&1");
  const int st = std::system(cmd.c_str());
  std::ifstream out(dir.file("out"));
  std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_EQ(st, 0) << text;
  EXPECT_EQ(text.find("hmoe-expert-service@"), std::string::npos)
      << text;  // no complaints about our unit
}

}  // namespace
}  // namespace hmoe
