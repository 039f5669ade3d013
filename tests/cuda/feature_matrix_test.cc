// The CUDA backend's feature matrix: every expert-call path (host copy, host
// node, device wait, device send; gpu_worker/cuda/expert_call_path.h) x
// Expert Deferral {0, 2} x hot experts {off, on}, over a real expert
// service's shm slots, on every model fixture. Logits are compared bit for
// bit, pass by pass:
//   - hot experts off: every path equals the host-copy path;
//   - hot experts on: the host-copy path equals itself with them off (hot
//     experts run only in slot passes), and the three slot paths equal one
//     another (the hot side's numerics are its own: cuda_hot_experts_test).
// Deferral 2 is min(2, experts_per_token - 1) on fixtures of fewer experts
// per token. Needs a GPU (skipped without one).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_placement.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "gpu_worker/model.h"
#include "gpu_worker/server/remote_experts.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

struct Path {
  const char* name;
  bool slots;
  SlotCalls calls;
};
constexpr Path kPaths[] = {{"host copy", false, SlotCalls::kHostNodes},
                           {"host node", true, SlotCalls::kHostNodes},
                           {"device wait", true, SlotCalls::kDeviceWaits},
                           {"device send", true, SlotCalls::kDeviceSends}};

using Logits = std::vector<std::vector<float>>;  // pass by pass

// A large pass (37 tokens, host copies), a slot pass (5 tokens, bucket 8),
// then 6 decode steps of each sequence, greedy.
Logits RunPasses(const ModelConfig& config, const std::string& dir, RoutedExperts* experts,
                 const Path& path, int deferred, std::shared_ptr<const Placement> hot) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.deferred_experts = deferred;
  o.cuda.expert_slots = path.slots;
  o.cuda.slot_calls = path.calls;
  o.cuda.hot_experts = std::move(hot);
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return {};
  auto m = Model::Create(config, **ckpt, o, experts);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  // The path asked for is the path taken (no silent step down).
  EXPECT_STREQ((*m)->stats().expert_call_path, path.name);
  Logits out;
  std::vector<int32_t> big, small = {1, 5, 17, 42, 7};
  for (int i = 0; i < 37; ++i) big.push_back((7 * i + 3) % 50);
  auto a = (*m)->NewSequence(), b = (*m)->NewSequence();
  for (auto [seq, prompt] : {std::pair{a.get(), &big}, std::pair{b.get(), &small}}) {
    auto lg = (*m)->Prefill(*seq, *prompt, LogitsMode::kLast);
    EXPECT_TRUE(lg.ok()) << lg.status();
    if (!lg.ok()) return {};
    out.push_back(*lg);
  }
  int32_t next[2] = {3, 4};
  for (int step = 0; step < 6; ++step) {
    for (int s = 0; s < 2; ++s) {
      auto l = (*m)->Decode(s == 0 ? *a : *b, next[s]);
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) return {};
      next[s] = static_cast<int32_t>(std::max_element(l->begin(), l->end()) - l->begin());
      out.push_back(*l);
    }
  }
  if (path.slots) {
    EXPECT_GT((*m)->stats().graph_launches, 0);
  }
  return out;
}

void ExpectBitEqual(const Logits& got, const Logits& want, const std::string& what) {
  ASSERT_FALSE(want.empty()) << what;
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what;
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * sizeof(float)), 0)
        << what << ": pass " << i << " differs";
  }
}

class CudaFeatureMatrix : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

TEST_P(CudaFeatureMatrix, EveryPathDeferralAndHotCombinationIsBitForBit) {
  const std::string dir = testing::ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  if (config->num_moe_layers() == 0) GTEST_SKIP() << GetParam() << " has no MoE layer";
  testing::TempDir tmp;
  testing::ServiceProcess proc;
  testing::ServedExperts served;
  ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc, tmp, *config, dir, &served));
  // Every other expert of each MoE layer hot, in bf16.
  auto hot = std::make_shared<Placement>();
  hot->model_type = config->model_type;
  hot->num_experts = config->moe.num_experts;
  for (int l = 0; l < config->num_layers; ++l) {
    if (!config->layers[static_cast<size_t>(l)].moe) continue;
    for (int32_t e = 0; e < config->moe.num_experts; e += 2) hot->hot[l].push_back(e);
  }
  const int K = static_cast<int>(config->moe.experts_per_token);
  for (int deferred : {0, std::min(2, K - 1)}) {
    const std::string at = GetParam() + ", deferred " + std::to_string(deferred);
    const Logits copy = RunPasses(*config, dir, served.experts.get(), kPaths[0], deferred, nullptr);
    ASSERT_FALSE(copy.empty()) << at;
    for (const Path& p : kPaths) {
      SCOPED_TRACE(at + ", " + p.name + ", hot off");
      ExpectBitEqual(RunPasses(*config, dir, served.experts.get(), p, deferred, nullptr), copy,
                     "against the host-copy path");
    }
    {
      SCOPED_TRACE(at + ", host copy, hot on");
      ExpectBitEqual(RunPasses(*config, dir, served.experts.get(), kPaths[0], deferred, hot), copy,
                     "against the host-copy path without hot experts");
    }
    const Logits host_node =
        RunPasses(*config, dir, served.experts.get(), kPaths[1], deferred, hot);
    for (const Path& p : {kPaths[2], kPaths[3]}) {
      SCOPED_TRACE(at + ", " + p.name + ", hot on");
      ExpectBitEqual(RunPasses(*config, dir, served.experts.get(), p, deferred, hot), host_node,
                     "against the host-node path with hot experts");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaFeatureMatrix,
                         ::testing::ValuesIn(testing::CudaModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace hmoe
