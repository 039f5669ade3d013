// The expert-service shard core (in process) and the service process:
// the kernel path against the kernels' scalar reference and against plain f32
// math, sharding arithmetic, validation, formats, options, SIGTERM drain.
// (The systemd units are verified in tests/e2e/deploy_test.cc.)
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "expert_service/convert/packed_file.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/transport/ucx_server.h"
#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gtest/gtest.h"
#include "proto/expert.grpc.pb.h"
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
  auto f = ParseWeightFormat(format, &o.group);
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

// max |a - b| / max |b|
double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den == 0 ? num : num / den;
}

// The shard's packed weights are exactly QuantizeExpert's (common/experts) of the
// checkpoint slice, and Handle (RunMoe) agrees with the kernels' scalar
// reference (RunMoeReference) on them, for every format, whole and sharded,
// in both regimes (3 tokens: "few"; 40 tokens over 16 experts x top-4: some
// experts get more than the "many" thresholds).
// Bounds are tests/kernels/moe_test.cc's, for the same reasons: the reference
// accumulates in double where the kernels use fp32, which can move bf16(h)
// by one ulp (bf16 / int4 "many": 3e-3) or an int8-quantized h by one level
// (int8 / int4 "few": 1.5e-2) on rare elements. Everything else is exact.
TEST(ExpertShard, MatchesKernelReferenceFromCheckpoint) {
  auto cfg = LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  struct Case {
    int i, n;
    SplitMode split;
  };
  for (const char* format : {"bf16", "int8", "int4g32", "int4g64", "int4g128"}) {
    for (const Case& c :
         {Case{0, 1, SplitMode::kTp}, Case{1, 3, SplitMode::kTp}, Case{1, 3, SplitMode::kEp}}) {
      SCOPED_TRACE(absl::StrCat(format, " ", c.i, "/", c.n, " ", SplitModeName(c.split)));
      auto shard = Load(c.i, c.n, c.split, format);
      ASSERT_TRUE(shard);
      const ShardInfo& info = shard->info();
      const int slot = 1;
      const int layer = info.moe_layers[slot];
      const PackedMoeLayer& L = shard->layer(slot);
      const MoeWeightsSource src = CheckpointSource(**ckpt, *cfg, layer);
      const PackOptions po = ShardPackOptions(info.intermediate, info.num_experts, c.split, c.i,
                                              c.n, L.format(), L.group() ? L.group() : 128);
      std::vector<QuantExpert> experts;
      for (int64_t e = info.expert_begin; e < info.expert_end; ++e) {
        auto w = src.expert(e);
        ASSERT_TRUE(w.ok()) << w.status();
        auto q = QuantizeExpert(*w, src, po);
        ASSERT_TRUE(q.ok()) << q.status();
        auto packed = UnpackExpert(L, e - info.expert_begin);
        ASSERT_TRUE(packed.ok()) << packed.status();
        EXPECT_EQ(packed->gate.bf16, q->gate.bf16);
        EXPECT_EQ(packed->gate.q, q->gate.q);
        EXPECT_EQ(packed->up.q, q->up.q);
        EXPECT_EQ(packed->down.q, q->down.q);
        EXPECT_EQ(packed->down.bf16, q->down.bf16);
        EXPECT_EQ(packed->down.scale, q->down.scale);
        experts.push_back(std::move(*q));
      }
      for (int tokens : {3, 40}) {
        auto call = MakeRandomCall(info, layer, tokens, 17 + static_cast<uint64_t>(tokens));
        std::vector<float> got(static_cast<size_t>(tokens * info.hidden), -1.f);
        std::vector<float> want(got.size());
        ASSERT_TRUE(shard->Handle(call.call(), got.data(), nullptr).ok());
        MoeInput in;
        in.tokens = tokens;
        in.top_k = call.top_k;
        in.x = call.hidden.data();
        in.ids = call.ids.data();
        in.weights = call.weights.data();
        ASSERT_TRUE(RunMoeReference(experts, info.hidden, info.expert_begin, in, want.data()).ok());
        EXPECT_LE(RelErr(got, want), L.format() == WeightFormat::kBf16 ? 3e-3 : 1.5e-2)
            << tokens << " tokens";
      }
    }
  }
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

// Synthetic weights are a function of the model, not of the sharding.
TEST(ExpertShard, SyntheticShardsSumToWhole) {
  const std::string spec = "hidden=96,intermediate=80,experts=6,top_k=3,layers=2,seed=5";
  auto load = [&](int i, int n, SplitMode split) {
    ShardOptions o;
    o.synthetic = spec;
    o.shard_index = i;
    o.num_shards = n;
    o.split = split;
    auto s = ExpertShard::Load(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  };
  auto whole = load(0, 1, SplitMode::kTp);
  ASSERT_TRUE(whole);
  auto call = MakeRandomCall(whole->info(), 1, 7, 21);
  std::vector<float> want(static_cast<size_t>(7 * 96));
  ASSERT_TRUE(whole->Handle(call.call(), want.data(), nullptr).ok());
  double norm = 0;
  for (float v : want) norm = std::max(norm, static_cast<double>(std::fabs(v)));
  EXPECT_GT(norm, 1e-3);
  for (SplitMode split : {SplitMode::kTp, SplitMode::kEp}) {
    std::vector<float> sum(want.size(), 0.f), part(want.size());
    for (int i = 0; i < 2; ++i) {
      auto s = load(i, 2, split);
      ASSERT_TRUE(s);
      ASSERT_TRUE(s->Handle(call.call(), part.data(), nullptr).ok());
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += part[k];
    }
    EXPECT_LT(MaxRelDiff(sum, want), 1e-5) << SplitModeName(split);
  }
}

// alias=N: every layer's experts are views of N packed experts held once
// (the memory of N, not L x E), computing what the unaliased model's
// expert of that set computes, bit for bit; shards of it sum to the whole.
TEST(ExpertShard, AliasedSyntheticExpertsHoldNExperts) {
  const std::string shape = "hidden=64,intermediate=48,experts=8,top_k=1,seed=3";
  auto load = [](const std::string& spec, int i = 0, int n = 1,
                 SplitMode split = SplitMode::kTp) -> std::unique_ptr<ExpertShard> {
    ShardOptions o;
    o.synthetic = spec;
    o.threads = 1;
    o.shard_index = i;
    o.num_shards = n;
    o.split = split;
    auto s = ExpertShard::Load(o);
    EXPECT_TRUE(s.ok()) << spec << ": " << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  };
  auto plain = load(shape + ",layers=4");
  auto aliased = load(shape + ",layers=4,alias=5");
  auto deeper = load(shape + ",layers=16,alias=5");
  ASSERT_TRUE(plain && aliased && deeper);
  const int64_t expert_bytes = plain->weight_bytes() / (4 * 8);
  EXPECT_EQ(plain->aliased_experts(), 0);
  EXPECT_EQ(aliased->aliased_experts(), 5);
  EXPECT_EQ(aliased->weight_bytes(), 5 * expert_bytes);
  EXPECT_EQ(deeper->weight_bytes(), 5 * expert_bytes);  // not 16 x 8
  for (int slot = 0; slot < 4; ++slot) {
    EXPECT_TRUE(aliased->layer(slot).aliased());
    for (const auto& part : aliased->layer(slot).parts()) EXPECT_EQ(part.mem.size(), 0u);
  }
  // Expert e of layer l, one call of 3 tokens, against plain layer 0's
  // expert (l * 8 + e) % 5.
  auto run = [](ExpertShard& s, int layer, int32_t e) {
    testing::RandomCall c = MakeRandomCall(s.info(), layer, 3, 17);
    for (int32_t& id : c.ids) id = e;
    std::vector<float> out(static_cast<size_t>(3 * 64));
    EXPECT_TRUE(s.Handle(c.call(), out.data(), nullptr).ok());
    return out;
  };
  for (int layer = 0; layer < 4; ++layer)
    for (int32_t e = 0; e < 8; ++e)
      EXPECT_EQ(run(*aliased, layer, e), run(*plain, 0, (layer * 8 + e) % 5)) << layer << " " << e;
  EXPECT_EQ(run(*deeper, 15, 3), run(*plain, 0, (15 * 8 + 3) % 5));
  EXPECT_NE(run(*aliased, 0, 0), run(*aliased, 0, 1));
  // Split over shards (each holding its slice of the N sets), the sum is the whole.
  auto call = MakeRandomCall(aliased->info(), 2, 7, 21);
  std::vector<float> want(static_cast<size_t>(7 * 64));
  ASSERT_TRUE(aliased->Handle(call.call(), want.data(), nullptr).ok());
  for (SplitMode split : {SplitMode::kTp, SplitMode::kEp}) {
    std::vector<float> sum(want.size(), 0.f), part(want.size());
    for (int i = 0; i < 2; ++i) {
      auto s = load(shape + ",layers=4,alias=5", i, 2, split);
      ASSERT_TRUE(s);
      ASSERT_TRUE(s->Handle(call.call(), part.data(), nullptr).ok());
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += part[k];
    }
    EXPECT_LT(MaxRelDiff(sum, want), 1e-5) << SplitModeName(split);
  }
}

// PackedMoeLayer::Aliased refuses aliases outside its base and a base of
// another layout; an aliased layer takes no PackExpert (no memory of its own)
// and unpacks to its base's experts.
TEST(PackedMoeLayer, AliasedLayersCheckTheirBase) {
  absl::StatusOr<ThreadPool*> pool = SharedThreadPool(1, 0);
  ASSERT_TRUE(pool.ok()) << pool.status();
  PackOptions po;
  po.format = WeightFormat::kInt8;
  absl::StatusOr<PackedMoeLayer> base = PackRandom(64, 32, 3, po, **pool, 5);
  ASSERT_TRUE(base.ok()) << base.status();
  auto shared = std::make_shared<const PackedMoeLayer>(std::move(*base));
  auto bad = PackedMoeLayer::Aliased(shared, 32, 4, po, **pool, {0, 1, 3, 2});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("alias 3 outside the base layer's 3 experts"),
            absl::string_view::npos)
      << bad.status();
  EXPECT_EQ(PackedMoeLayer::Aliased(shared, 32, 4, po, **pool, {0, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);  // 2 aliases for 4 experts
  PackOptions other = po;
  other.format = WeightFormat::kBf16;
  EXPECT_EQ(PackedMoeLayer::Aliased(shared, 32, 4, other, **pool, {0, 1, 2, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto layer = PackedMoeLayer::Aliased(shared, 32, 4, po, **pool, {2, 0, 1, 2});
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_TRUE(layer->aliased());
  auto q = UnpackExpert(*shared, 2);
  ASSERT_TRUE(q.ok()) << q.status();
  for (int64_t e : {0, 3}) {
    auto a = UnpackExpert(*layer, e);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->gate.q, q->gate.q);
    EXPECT_EQ(a->down.scale, q->down.scale);
  }
  EXPECT_EQ(PackExpert(*q, 1, *layer).code(), absl::StatusCode::kFailedPrecondition);
}

// The memory check counts an aliased shard's N experts, not L x E: where
// the unaliased shard is refused, the aliased one loads; refused, it says so.
TEST(ExpertShard, AliasedMemoryCheckCountsNExperts) {
  ShardOptions o;
  o.synthetic = "hidden=256,intermediate=128,experts=8,top_k=2,layers=3,seed=1";
  o.threads = 1;
  MemoryLimits m;
  m.machine_bytes = 1 << 20;
  o.memory_limits = m;
  auto refused = ExpertShard::Load(o);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  const std::string msg(refused.status().message());
  double need_mib = 0;
  const size_t at = msg.find(" need ");
  ASSERT_NE(at, std::string::npos) << msg;
  ASSERT_EQ(std::sscanf(msg.c_str() + at, " need %lf MiB", &need_mib), 1) << msg;
  m.machine_bytes = static_cast<int64_t>((need_mib - 0.5) * 1024 * 1024);
  o.memory_limits = m;
  EXPECT_EQ(ExpertShard::Load(o).status().code(), absl::StatusCode::kResourceExhausted);
  o.synthetic += ",alias=2";
  auto aliased = ExpertShard::Load(o);
  EXPECT_TRUE(aliased.ok()) << aliased.status();
  m.machine_bytes = 256 << 10;
  o.memory_limits = m;
  auto small = ExpertShard::Load(o);
  ASSERT_EQ(small.status().code(), absl::StatusCode::kResourceExhausted) << small.status();
  EXPECT_NE(small.status().message().find(
                "this shard's packed weights (0.4 MiB: 2 aliased experts for 3 MoE layers x 8 "
                "experts, bf16)"),
            absl::string_view::npos)
      << small.status();
}

// The load reports its packed bytes: the total first, every expert once.
TEST(ExpertShard, LoadReportsPackedBytes) {
  for (const char* spec : {"hidden=64,intermediate=32,experts=4,top_k=2,layers=3,seed=2",
                           "hidden=64,intermediate=32,experts=4,top_k=2,layers=3,seed=2,alias=3"}) {
    std::vector<std::string> lines;
    LoadProgressOptions po;
    po.log = [&lines](const std::string& line) { lines.push_back(line); };
    LoadProgressReporter reporter(po);
    ExpertShard::LoadProgress progress;
    progress.bytes = &reporter;
    ShardOptions o;
    o.synthetic = spec;
    o.threads = 2;
    auto s = ExpertShard::Load(o, &progress);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(reporter.total(), (*s)->weight_bytes()) << spec;
    EXPECT_EQ(reporter.done(), reporter.total()) << spec;
    reporter.Finish();
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back().rfind("loading weights: ", 0), 0u) << lines.back();
    EXPECT_NE(lines.back().find(" GB/s mean"), std::string::npos) << lines.back();
  }
}

// first_dense=D makes layers D..L-1 the MoE layers; D must leave one, and
// only first_dense may be 0.
TEST(ExpertShard, SyntheticFirstDenseSetsTheMoeLayers) {
  ShardOptions o;
  o.synthetic = "hidden=64,intermediate=32,experts=4,top_k=2,layers=5,first_dense=3,seed=2";
  o.threads = 1;
  auto s = ExpertShard::Load(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->info().moe_layers, (std::vector<int32_t>{3, 4}));
  auto call = MakeRandomCall((*s)->info(), 4, 3, 9);
  std::vector<float> out(static_cast<size_t>(3 * 64));
  EXPECT_TRUE((*s)->Handle(call.call(), out.data(), nullptr).ok());
  for (const char* bad : {"hidden=64,intermediate=32,experts=4,top_k=2,layers=3,first_dense=3",
                          "hidden=64,intermediate=32,experts=4,top_k=2,layers=3,first_dense=-1",
                          "hidden=64,intermediate=32,experts=4,top_k=0,layers=3",
                          "hidden=64,intermediate=32,experts=4,top_k=2,layers=3,alias=0",
                          "hidden=64,intermediate=32,experts=4,top_k=2,layers=3,first_dense=1,"
                          "alias=9"}) {
    o.synthetic = bad;
    auto r = ExpertShard::Load(o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << r.status();
    EXPECT_NE(std::string(r.status().message()).find("--synthetic"), std::string::npos)
        << r.status();
  }
}

// A shard that cannot fit is refused before packing, naming the limit, what
// it needs (weights, workspace, packing buffers) and the way out.
TEST(ExpertShard, WeightsThatCannotFitAreRefusedBeforeLoading) {
  ShardOptions o;
  o.synthetic = "hidden=256,intermediate=128,experts=8,top_k=2,layers=3,seed=1";
  o.format = ServeFormat::kBf16;
  o.threads = 1;
  MemoryLimits m;
  m.machine_bytes = 1 << 20;
  o.memory_limits = m;
  auto s = ExpertShard::Load(o);
  ASSERT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  const std::string msg(s.status().message());
  // 3 layers x 8 experts x (256 + 128 rows of 256 / 128 bf16) = 4.5 MiB.
  EXPECT_NE(msg.find("this shard's packed weights (4.5 MiB: 3 MoE layers x 8 experts, bf16), "
                     "workspace ("),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("for --max-tokens 256) and packing buffers (0.4 MiB for 1 thread) need "),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("; the machine has 1.0 MiB of memory: use more shards (--shard i/n)"),
            std::string::npos)
      << msg;
  // The need it names is the line: just above loads, just below does not.
  double need_mib = 0;
  const size_t at = msg.find(" need ");
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(std::sscanf(msg.c_str() + at, " need %lf MiB", &need_mib), 1) << msg;
  m.machine_bytes = static_cast<int64_t>((need_mib + 0.1) * 1024 * 1024);
  o.memory_limits = m;
  std::vector<std::string> logged;
  o.log = [&logged](const std::string& line) { logged.push_back(line); };
  EXPECT_TRUE(ExpertShard::Load(o).ok());
  EXPECT_TRUE(logged.empty()) << logged[0];
  // Fits the machine but not what is available now: loads, with a warning.
  m.available_bytes = 1 << 20;
  o.memory_limits = m;
  EXPECT_TRUE(ExpertShard::Load(o).ok());
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("warning: this shard's packed weights (4.5 MiB"), std::string::npos)
      << logged[0];
  EXPECT_NE(logged[0].find("; only 1.0 MiB of memory is available now"), std::string::npos)
      << logged[0];
  m.available_bytes = 0;
  m.machine_bytes = static_cast<int64_t>((need_mib - 0.1) * 1024 * 1024);
  o.memory_limits = m;
  EXPECT_EQ(ExpertShard::Load(o).status().code(), absl::StatusCode::kResourceExhausted);
  {
    // The same line on the node: the packing buffers count there too (each
    // worker allocates its own on its node).
    MemoryLimits node = m;
    node.machine_bytes = 0;
    node.node_bytes.assign(1, static_cast<int64_t>((need_mib - 0.1) * 1024 * 1024));
    o.memory_limits = node;
    auto refused = ExpertShard::Load(o);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_NE(refused.status().message().find("on NUMA node 0, which has"), absl::string_view::npos)
        << refused.status();
    node.node_bytes.assign(1, static_cast<int64_t>((need_mib + 0.1) * 1024 * 1024));
    o.memory_limits = node;
    EXPECT_TRUE(ExpertShard::Load(o).ok());
    o.memory_limits = m;
  }
  o.check_memory = false;  // --no-memory-check
  EXPECT_TRUE(ExpertShard::Load(o).ok());
  o.check_memory = true;
  // Half the experts on each of two shards fit where the whole did not.
  o.num_shards = 2;
  o.split = SplitMode::kEp;
  EXPECT_TRUE(ExpertShard::Load(o).ok());
  // A larger --max-tokens needs a larger workspace.
  o.num_shards = 1;
  m.machine_bytes = static_cast<int64_t>((need_mib + 0.1) * 1024 * 1024);
  o.memory_limits = m;
  o.max_tokens = 4096;
  s = ExpertShard::Load(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(s.status().message()).find("for --max-tokens 4096"), std::string::npos);
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

// Calls are computed one at a time; each reports its own compute, not the
// wait for the other's (the two used to add up to ~1.5x the wall time).
TEST(ExpertShard, ComputeTimeExcludesTheWaitForAnotherCall) {
  ShardOptions o;
  o.synthetic = "hidden=512,intermediate=512,experts=8,top_k=8,layers=1,seed=3";
  o.threads = 1;
  auto s = ExpertShard::Load(o);
  ASSERT_TRUE(s.ok()) << s.status();
  const ShardInfo& info = (*s)->info();
  auto a = MakeRandomCall(info, info.moe_layers[0], 256, 1);
  auto b = MakeRandomCall(info, info.moe_layers[0], 256, 2);
  std::vector<float> out_a(static_cast<size_t>(256 * info.hidden)), out_b(out_a.size());
  uint64_t ns_a = 0, ns_b = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread other([&] { EXPECT_TRUE((*s)->Handle(b.call(), out_b.data(), &ns_b).ok()); });
  EXPECT_TRUE((*s)->Handle(a.call(), out_a.data(), &ns_a).ok());
  other.join();
  const auto wall =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_GT(ns_a, 0u);
  EXPECT_GT(ns_b, 0u);
  EXPECT_LE(ns_a + ns_b, static_cast<uint64_t>(wall));
}

// ---- the process ---------------------------------------------------------------

// Under systemd (NOTIFY_SOCKET set), the service says how far its load is as
// STATUS=, then READY=1 with the port, each a datagram on that socket.
TEST(ServiceProcess, TellsTheServiceManagerItsLoadThenReady) {
  ::hmoe::testing::TempDir dir;
  const std::string path = dir.file("notify.sock");
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(a.sun_path));
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  ::hmoe::testing::ServiceProcess proc;
  const bool started = proc.Start({"--model-dir=" + ModelDir(), "--no-ucx"}, dir.file("port"));
  ::unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(started);
  std::vector<std::string> got;
  while (got.empty() || got.back().rfind("READY=1", 0) != 0) {
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << "no READY=1 after " << got.size() << " datagrams";
    got.emplace_back(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  ASSERT_GE(got.size(), 2u);
  EXPECT_EQ(got[0].rfind("STATUS=loading experts: ", 0), 0u) << got[0];
  EXPECT_THAT(
      got[got.size() - 2],
      ::testing::ContainsRegex(R"(^STATUS=loading experts: [0-9.]+ [KMG]?i?B in [0-9.]+ s, )"
                               R"([0-9.]+ GB/s mean$)"));
  EXPECT_EQ(got.back(), "READY=1\nSTATUS=serving on port " + std::to_string(proc.port()));
}

// hmoe-expert-bench --zero-copy writes a slot's hidden states once per call
// shape: a slot reused by a call with another token count gets them again
// (before: the T=9 call kept T=1's bytes, overlaid by T=1's ids and weights,
// and --verify-model-dir failed).
TEST(ServiceProcess, ExpertBenchZeroCopyVerifiesEveryTokenCount) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--no-ucx"}, dir.file("port")));
  const std::string cmd = absl::StrCat(::hmoe::testing::BenchBinary(), " --targets=", proc.target(),
                                       " --transport=shm --zero-copy --tokens=1,9,1 --iters=3",
                                       " --warmup=1 --verify-model-dir=", ModelDir(), " 2>&1");
  const auto [st, output] = ::hmoe::testing::RunCommand(cmd);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << output;
  EXPECT_NE(output.find("\"tokens\": 9"), std::string::npos) << output;
}

// --verify-model-dir computes the reference in the served format and split
// (it compared an int8 or int4 service, or TP shards, with one bf16 shard,
// and always failed).
TEST(ServiceProcess, ExpertBenchVerifiesQuantizedAndSplitShards) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess s0, s1;
  ASSERT_TRUE(s0.Start({"--model-dir=" + ModelDir(), "--no-ucx", "--format=int8", "--shard=0/2"},
                       dir.file("p0")));
  ASSERT_TRUE(s1.Start({"--model-dir=" + ModelDir(), "--no-ucx", "--format=int8", "--shard=1/2"},
                       dir.file("p1")));
  const std::string cmd = absl::StrCat(::hmoe::testing::BenchBinary(), " --targets=", s0.target(),
                                       ",", s1.target(), " --transport=shm --tokens=1,5 --iters=2",
                                       " --warmup=1 --verify-model-dir=", ModelDir(), " 2>&1");
  const auto [st, output] = ::hmoe::testing::RunCommand(cmd);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << output;
  EXPECT_NE(output.find("\"shards\": 2"), std::string::npos) << output;
}

TEST(ServiceProcess, SigtermFinishesInFlightThenExitsZero) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  // Big enough that one call takes a while (~1e10 flops on one thread).
  ASSERT_TRUE(proc.Start({"--synthetic=hidden=1024,intermediate=1024,experts=8,top_k=8,layers=1",
                          "--threads=1", "--no-ucx", "--no-shm"},
                         dir.file("port")));
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ControlClient control(MakeExpertChannel(proc.target()));
  auto call = MakeRandomCall((*pool)->model(), 0, 256, 2);
  std::vector<float> out(static_cast<size_t>(256 * 1024));
  auto h = (*pool)->Submit(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(h.ok());
  // SIGTERM only once the call is surely computing.
  bool in_flight = false;
  for (int i = 0; i < 2000 && !in_flight; ++i) {
    auto stats = control.Stats();
    in_flight = stats.ok() && stats->in_flight > 0;
    if (!in_flight) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(in_flight);
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

// SIGTERM while a worker is mid-generation (a stream of calls, one per
// layer and step, over shared memory as the README's pair runs): the calls
// go on being served until they stop coming, then the service exits 0. (It
// refused every call after SIGTERM, failing each generation in flight
// within ~20 ms.)
TEST(ServiceProcess, SigtermServesAGenerationInFlightToItsEnd) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--synthetic=hidden=256,intermediate=256,experts=8,top_k=2,layers=2",
                          "--threads=1", "--no-ucx", "--drain-quiet-s=0.5"},
                         dir.file("port")));
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  po.transport = TransportKind::kShm;
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto call = MakeRandomCall((*pool)->model(), 0, 1, 2);
  std::vector<float> out(static_cast<size_t>(256));
  // The "generation": 1 s of back-to-back calls; SIGTERM a quarter in.
  int served = 0;
  absl::Status failed;
  const auto t0 = std::chrono::steady_clock::now();
  bool signalled = false;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1)) {
    if (!signalled && std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(250)) {
      proc.Signal(SIGTERM);
      signalled = true;
    }
    absl::Status st = (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(5));
    if (!st.ok()) {
      failed = st;
      break;
    }
    ++served;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_TRUE(failed.ok()) << "call " << served << " failed: " << failed;
  // The calls stopped: it drains and exits 0 (after --drain-quiet-s).
  int status = 0;
  pid_t r = 0;
  const auto t1 = std::chrono::steady_clock::now();
  while ((r = waitpid(proc.pid(), &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - t1 < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(r, proc.pid());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(ServiceProcess, BadFlagsAndUnloadableModelExitNonZero) {
  ::hmoe::testing::TempDir dir;
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--model-dir=" + ModelDir(), "--shard=3/2"},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--numa-node=4096"},
        std::vector<std::string>{"--model-dir=/nonexistent"},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--bogus=1"},
        std::vector<std::string>{"--model-dir=" + ModelDir(), "--drain-timeout-s=inf"}}) {
    ::hmoe::testing::ServiceProcess proc;
    EXPECT_FALSE(proc.Start(args, dir.file("port"))) << args.back();
  }
}

sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

// A free TCP port on 127.0.0.1 (closed again; the service binds it next).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

bool Listening(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in a = Loopback(port);
  const bool ok = connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A synthetic shard that takes a while to load (seconds to minutes on any
// host: the control plane is up meanwhile), with the flags to serve it.
std::vector<std::string> SlowLoadArgs(int layers) {
  return {
      absl::StrCat("--synthetic=hidden=1024,intermediate=512,experts=64,top_k=4,layers=", layers),
      "--format=int4g64", "--threads=1", "--no-memory-check"};
}

// A FIFO as config.json fails the load at once, naming the file (it used
// to block the load forever, past SIGTERM).
TEST(ServiceProcess, AFifoConfigJsonFailsTheLoad) {
  ::hmoe::testing::TempDir dir;
  const std::string model = dir.file("model");
  ASSERT_TRUE(std::filesystem::create_directory(model));
  for (const auto& e : std::filesystem::directory_iterator(ModelDir())) {
    const std::string to = model + "/" + e.path().filename().string();
    if (e.path().filename() == "config.json") {
      ASSERT_EQ(mkfifo(to.c_str(), 0600), 0);
    } else {
      std::filesystem::create_symlink(e.path(), to);
    }
  }
  ::hmoe::testing::ServiceProcess proc;
  const std::string log = dir.file("service.log");
  proc.set_stderr_file(log);
  EXPECT_FALSE(proc.Start({"--model-dir=" + model, "--no-ucx"}, dir.file("port")));
  const int status = proc.exit_status();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << "wait status " << status;
  EXPECT_TRUE(::hmoe::testing::FileSays(log, model + "/config.json: not a regular file"));
}

// ServiceProcess::Start on a thread (it returns once the service is ready or
// gone), on a free port; the constructor waits until the port listens.
class BackgroundStart {
 public:
  BackgroundStart(::hmoe::testing::ServiceProcess& proc, std::vector<std::string> args,
                  std::string port_file)
      : port_(FreePort()) {
    thread_ = std::thread([this, &proc, args = std::move(args), port_file = std::move(port_file)] {
      started_ = proc.Start(args, port_file, port_);
    });
    for (int i = 0; i < 1000 && port_ > 0 && !Listening(port_); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ~BackgroundStart() {
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }
  bool listening() const { return port_ > 0 && Listening(port_); }
  // Start's result: true once the service announced READY (its port file).
  bool Join() {
    thread_.join();
    return started_;
  }

 private:
  int port_;
  bool started_ = false;
  std::thread thread_;
};

TEST(ServiceProcess, DataPlanesAnswerUnavailableWhileLoading) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  // The channel only once the port listens (a refused first connection
  // would put gRPC into its reconnect backoff).
  BackgroundStart start(proc, SlowLoadArgs(400), dir.file("port"));
  ASSERT_TRUE(start.listening());
  const int port = start.port();
  ControlClient control(MakeExpertChannel(absl::StrCat("127.0.0.1:", port)));
  // Up but loading: Describe says so.
  absl::Status describe = control.Describe(absl::Seconds(5)).status();
  EXPECT_EQ(describe.code(), absl::StatusCode::kUnavailable) << describe;
  EXPECT_NE(std::string(describe.message()).find("still loading"), std::string::npos) << describe;
  // The data planes are on but not up yet: retry later (UNAVAILABLE), not
  // FAILED_PRECONDITION "off".
  auto shm = control.AttachShm("/dev/shm/not-a-memfd", getpid(), 1);
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kUnavailable) << shm.status();
  EXPECT_NE(std::string(shm.status().message()).find("still loading"), std::string::npos);
  auto ucx = control.UcxConnect("not-an-address", 7);
  EXPECT_EQ(ucx.status().code(), absl::StatusCode::kUnavailable) << ucx.status();
  EXPECT_NE(std::string(ucx.status().message()).find("still loading"), std::string::npos);
  EXPECT_EQ(control.Check(), Health::kNotServing);
  proc.Signal(SIGTERM);
  EXPECT_FALSE(start.Join());
}

// Up and serving, the same bad shm path and UCX address are judged on their
// merits (the UCX one by the service's checker child: UCX itself would
// abort the service on it).
TEST(ServiceProcess, DataPlanesJudgeBadAttachesOnTheirMerits) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir()}, dir.file("port")));
  ControlClient control(MakeExpertChannel(proc.target()));
  EXPECT_EQ(control.Check(), Health::kServing);
  auto shm = control.AttachShm("/dev/shm/not-a-memfd", getpid(), 1);
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kInvalidArgument) << shm.status();
  auto ucx = control.UcxConnect("not-an-address", 7);
  EXPECT_EQ(ucx.status().code(), absl::StatusCode::kInvalidArgument) << ucx.status();
  EXPECT_NE(std::string(ucx.status().message()).find("client_worker_address"), std::string::npos)
      << ucx.status();
  EXPECT_EQ(control.Check(), Health::kServing);
  EXPECT_TRUE(control.Describe(absl::Seconds(5)).ok());
}

// SIGTERM while loading: once the load ends, the service exits without
// announcing READY or serving (no port file, no SERVING on the way out).
TEST(ServiceProcess, SigtermWhileLoadingExitsWithoutServing) {
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  BackgroundStart start(proc, SlowLoadArgs(2), dir.file("port"));
  ASSERT_TRUE(start.listening());
  proc.Signal(SIGTERM);  // spawned: its pid is set before it listens
  EXPECT_FALSE(start.Join()) << "it wrote its port file (announced READY) after SIGTERM";
  EXPECT_FALSE(std::filesystem::exists(dir.file("port")));
}

// A port file that cannot be written once the load is done fails the start
// before the service turns SERVING: exit 1, no port file, health never
// SERVING (a launcher or a health checker never sees it up).
TEST(ServiceProcess, UnwritablePortFileFailsTheStartWithoutServing) {
  ::hmoe::testing::TempDir dir;
  const std::string port_dir = dir.file("run");
  ASSERT_TRUE(std::filesystem::create_directory(port_dir));
  ::hmoe::testing::ServiceProcess proc;
  const std::string log = dir.file("service.log");
  proc.set_stderr_file(log);
  // A load of seconds: the place goes away before it ends.
  BackgroundStart start(proc, SlowLoadArgs(2), port_dir + "/port");
  ASSERT_TRUE(start.listening());
  // Past the start-up check of the place: now it goes away.
  std::filesystem::remove_all(port_dir);
  ControlClient control(MakeExpertChannel(absl::StrCat("127.0.0.1:", start.port())));
  std::atomic<bool> done{false}, saw_serving{false};
  std::thread watch([&] {
    while (!done.load()) {
      if (control.Check("", absl::Milliseconds(200)) == Health::kServing) saw_serving = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  EXPECT_FALSE(start.Join()) << "it announced READY without its port file";
  done = true;
  watch.join();
  const int status = proc.exit_status();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << "wait status " << status;
  EXPECT_FALSE(saw_serving.load()) << "health turned SERVING before the port file was written";
  EXPECT_TRUE(::hmoe::testing::FileSays(log, "start failed: cannot write --port-file " + port_dir +
                                                 "/port: No such file or directory"));
}

// SIGTERM during a long load stops it at the next expert (a 671B shard
// loads for minutes; systemd's stop should not wait for that): the service
// exits 0 without announcing READY, long before the load could end.
TEST(ServiceProcess, SigtermCancelsALongLoad) {
  namespace pb = ::hmoe::expert::v1;
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  // 400 layers of 64 experts (about 100 M weights a layer) on 2 threads:
  // minutes to load on any host.
  BackgroundStart start(proc,
                        {"--synthetic=hidden=1024,intermediate=512,experts=64,top_k=4,layers=400",
                         "--format=int4g64", "--no-ucx", "--threads=2",
                         // 21 GiB in all, more than many hosts have: it never
                         // gets past a few layers, but would be refused.
                         "--no-memory-check"},
                        dir.file("port"));
  ASSERT_TRUE(start.listening());
  auto stub =
      pb::ExpertControl::NewStub(MakeExpertChannel(absl::StrCat("127.0.0.1:", start.port())));
  pb::LoadStatus load;
  for (int i = 0; i < 600; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(stub->GetLoadStatus(&ctx, pb::LoadStatusRequest(), &load).ok());
    if (load.layers_loaded() >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(load.layers_loaded(), 1) << "the load did not get going within 60 s";
  EXPECT_EQ(load.layers_total(), 400);
  const auto t0 = std::chrono::steady_clock::now();
  proc.Signal(SIGTERM);
  EXPECT_FALSE(start.Join()) << "it announced READY after SIGTERM";
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int status = proc.exit_status();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
  // Liveness, not speed: the whole load would take minutes.
  EXPECT_LT(seconds, 30.0) << "SIGTERM waited for the load";
}

// The gRPC data plane refuses a request larger than --max-tokens could ever
// need before parsing it (it took any size up to gRPC's 2 GB), and goes on
// serving well-formed calls.
TEST(ServiceProcess, OversizedGrpcRequestIsRefusedUnread) {
  namespace pb = ::hmoe::expert::v1;
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  // --max-tokens 4: the cap is 4 x (2 x 32768 + 8 x 64) + 64 KiB, about 330 KB.
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + ModelDir(), "--max-tokens=4", "--no-ucx"}, dir.file("port")));
  auto channel = MakeExpertChannel(proc.target());
  auto stub = pb::ExpertData::NewStub(channel);
  {
    grpc::ClientContext ctx;
    auto stream = stub->Moe(&ctx);
    pb::MoeRequest req;
    req.set_request_id(1);
    req.set_tokens(1);
    req.set_top_k(4);
    req.set_hidden(std::string(1 << 20, '\0'));  // 1 MiB
    stream->Write(req);
    stream->WritesDone();
    pb::MoeResponse resp;
    EXPECT_FALSE(stream->Read(&resp));
    grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  }
  // Still serving: a well-formed call on a new stream is answered.
  auto control = std::make_shared<ControlClient>(channel);
  auto info = control->Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  GrpcStreamClient client(channel, info->hidden);
  auto call = ::hmoe::testing::MakeRandomCall(*info, info->moe_layers[0], 4, 3);
  std::vector<float> out(static_cast<size_t>(4 * info->hidden));
  auto h = client.Submit(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(client.Wait(*h, absl::Now() + absl::Seconds(10)).ok());
}

// An enum value the proto does not define (MoeRequest.output = 99) is
// refused naming the field, and the stream goes on answering.
TEST(ServiceProcess, UnknownEnumValuesAreRefusedNamingTheField) {
  namespace pb = ::hmoe::expert::v1;
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--no-ucx"}, dir.file("port")));
  auto channel = MakeExpertChannel(proc.target());
  auto info = ControlClient(channel).Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  auto call = ::hmoe::testing::MakeRandomCall(*info, info->moe_layers[0], 2, 3);
  const MoeCall& c = call.call();
  auto stub = pb::ExpertData::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Moe(&ctx);
  pb::MoeRequest req;
  ToMoeRequest(c, &req);
  pb::MoeResponse resp;
  for (int output : {99, -1, 1}) {
    req.set_request_id(static_cast<uint64_t>(output + 2));
    req.set_output(static_cast<pb::OutputType>(output));
    ASSERT_TRUE(stream->Write(req));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.request_id(), req.request_id());
    if (output == 1) {
      EXPECT_EQ(resp.code(), 0) << resp.message();
      EXPECT_EQ(resp.output(), pb::OUTPUT_BF16);
      EXPECT_EQ(static_cast<int64_t>(resp.out().size()), 2 * 2 * info->hidden);
    } else {
      EXPECT_EQ(resp.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << output;
      EXPECT_THAT(resp.message(),
                  ::testing::HasSubstr("MoeRequest.output = " + std::to_string(output)));
    }
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Issue 33 item 2: a message on the MoE stream that is not a MoeRequest
// ended the stream OK (the generated handler's Read returned false as for a
// half-close) and the requests after it were never answered. Now the
// requests before it are answered and the stream ends INVALID_ARGUMENT
// naming the message; a new stream is served as before.
TEST(ServiceProcess, AMalformedMoeMessageEndsTheStreamInvalidArgument) {
  namespace pb = ::hmoe::expert::v1;
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--no-ucx"}, dir.file("port")));
  auto channel = MakeExpertChannel(proc.target());
  auto info = ControlClient(channel).Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  auto call = ::hmoe::testing::MakeRandomCall(*info, info->moe_layers[0], 2, 3);
  const MoeCall& c = call.call();
  pb::MoeRequest req;
  ToMoeRequest(c, &req);
  auto bytes = [](const std::string& b) {
    grpc::Slice slice(b);
    return grpc::ByteBuffer(&slice, 1);
  };
  // A raw stream, as the generated stub opens it, carrying any bytes.
  const std::string method = absl::StrCat("/", pb::ExpertData::service_full_name(), "/Moe");
  const grpc::internal::RpcMethod moe(method.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  for (const std::string& garbage :
       {std::string("\xff\xff\xff\xff\xff"),
        std::string("\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"), std::string("\x22\x10\x01")}) {
    SCOPED_TRACE(garbage.size());
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> rw(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel.get(), moe, &ctx));
    req.set_request_id(1);
    ASSERT_TRUE(rw->Write(bytes(req.SerializeAsString())));
    grpc::ByteBuffer got;
    ASSERT_TRUE(rw->Read(&got));
    pb::MoeResponse resp;
    ASSERT_TRUE(grpc::SerializationTraits<pb::MoeResponse>::Deserialize(&got, &resp).ok());
    EXPECT_EQ(resp.request_id(), 1u);
    EXPECT_EQ(resp.code(), 0) << resp.message();
    rw->Write(bytes(garbage));
    req.set_request_id(3);
    rw->Write(bytes(req.SerializeAsString()));  // may be refused: the stream is ending
    EXPECT_FALSE(rw->Read(&got)) << "nothing is answered after the malformed message";
    rw->WritesDone();
    const grpc::Status end = rw->Finish();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
    EXPECT_THAT(end.error_message(), ::testing::HasSubstr("message 2 of the MoE stream"));
    EXPECT_THAT(end.error_message(), ::testing::HasSubstr("is not a hmoe.expert.v1.MoeRequest"));
  }
  // The service goes on: a generated stub's stream is answered.
  auto stub = pb::ExpertData::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Moe(&ctx);
  req.set_request_id(7);
  ASSERT_TRUE(stream->Write(req));
  pb::MoeResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.request_id(), 7u);
  EXPECT_EQ(resp.code(), 0) << resp.message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// Started on loopback, the service listens on loopback only: its UCX data
// plane opened TCP listeners on every interface (UCX_NET_DEVICES now the
// --listen host's device).
TEST(ServiceProcess, ListensOnTheListenHostOnly) {
  auto lo = UcxNetDeviceFor("127.0.0.1:1");
  ASSERT_TRUE(lo.ok()) << lo.status();
  ::hmoe::testing::TempDir dir;
  ::hmoe::testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--listen=127.0.0.1:0"}, dir.file("port")));
  auto info = ControlClient(MakeExpertChannel(proc.target())).Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  const std::vector<std::string> listening = ::hmoe::testing::ListeningAddresses(proc.pid());
  EXPECT_GE(listening.size(), 1u);
  for (const std::string& a : listening)
    EXPECT_TRUE(::hmoe::testing::IsLoopbackAddress(a))
        << "listening on " << a << " beyond loopback";
}

TEST(UcxNetDevice, TheListenHostsInterfaceOrEveryDevice) {
  auto lo = UcxNetDeviceFor("127.0.0.1:50051");
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_FALSE(lo->empty());
  EXPECT_EQ(*UcxNetDeviceFor("localhost:1"), *lo);
  EXPECT_EQ(*UcxNetDeviceFor("127.0.0.2:1"), *lo);  // all of 127/8 is loopback
  EXPECT_EQ(*UcxNetDeviceFor("0.0.0.0:1"), "");
  EXPECT_EQ(*UcxNetDeviceFor("[::]:1"), "");
  EXPECT_EQ(*UcxNetDeviceFor(":1"), "");
  EXPECT_EQ(*UcxNetDeviceFor("some-host-name:1"), "");  // not a literal: UCX's default
  auto far = UcxNetDeviceFor("203.0.113.77:1");         // TEST-NET-3: not ours
  EXPECT_EQ(far.status().code(), absl::StatusCode::kNotFound) << far.status();
  EXPECT_NE(far.status().message().find("203.0.113.77"), std::string::npos);
}

TEST(UcxNetDevice, ATargetsDevicesAreThoseItIsReachedBy) {
  auto lo = UcxNetDeviceFor("127.0.0.1:1");
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_EQ(UcxNetDevicesForTargets({"127.0.0.1:50061", "localhost:50062", "127.0.0.2:1"}), *lo);
  EXPECT_EQ(UcxNetDevicesForTargets({"127.0.0.1:50061", "some-host-name:1"}), "");
  EXPECT_EQ(UcxNetDevicesForTargets({}), "");
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

}  // namespace
}  // namespace hmoe
