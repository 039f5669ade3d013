// PoolRoutedExperts under the cuda backend: the model's routed experts over a
// real expert service (the tiny DeepSeek-V3 fixture), on every expert-call
// path. Skips without a usable GPU (or in a build without CUDA).
#include "gpu_worker/server/remote_experts.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

using testing::ModelDir;

struct Path {
  const char* name;
  bool slots, graphs, device_calls;
};

// Prefill of 5 tokens, then `steps` greedy decode steps on one path: the
// logits of every pass. Checks one graph launch per decode step where the
// path replays graphs.
void RunPath(const ModelConfig& config, RoutedExperts* experts, const Path& p, int deferred,
             int steps, std::vector<std::vector<float>>* got) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.deferred_experts = deferred;
  o.cuda.expert_slots = p.slots;
  o.cuda.graphs = p.graphs;
  o.cuda.slot_calls = p.device_calls ? SlotCalls::kDeviceSends : SlotCalls::kHostNodes;
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto m = Model::Create(config, **ckpt, o, experts);
  ASSERT_TRUE(m.ok()) << m.status();
  auto seq = (*m)->NewSequence();
  auto lg = (*m)->Prefill(*seq, std::vector<int32_t>{1, 5, 17, 42, 7}, LogitsMode::kLast);
  ASSERT_TRUE(lg.ok()) << lg.status();
  got->push_back(*lg);
  const ModelStats before = (*m)->stats();
  int32_t next = 3;
  for (int step = 0; step < steps; ++step) {
    auto l = (*m)->Decode(*seq, next);
    ASSERT_TRUE(l.ok()) << "step " << step << ": " << l.status();
    next = static_cast<int32_t>(std::max_element(l->begin(), l->end()) - l->begin());
    got->push_back(*l);
  }
  const ModelStats after = (*m)->stats();
  if (p.graphs) {
    EXPECT_EQ(after.graph_launches - before.graph_launches, steps);
  } else {
    EXPECT_EQ(after.graph_launches, 0);
  }
}

void ExpectSameBits(const std::vector<std::vector<float>>& got,
                    const std::vector<std::vector<float>>& first) {
  ASSERT_EQ(got.size(), first.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), first[i].size());
    EXPECT_EQ(std::memcmp(got[i].data(), first[i].data(), got[i].size() * sizeof(float)), 0)
        << "pass " << i << " differs from the first path's";
  }
}

// Serves the fixture's experts, then runs `steps` decode steps on each path,
// with and without Expert Deferral: every path's logits equal the first
// path's bit for bit. Prints each path's time per pass.
void ExpectPathsAgree(const std::vector<Path>& paths, int steps) {
  testing::TempDir dir;
  testing::ServiceProcess proc;
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  testing::ServedExperts served;
  ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc, dir, *config, ModelDir(), &served));
  for (int deferred : {0, 1}) {
    std::vector<std::vector<float>> first;  // the first path's logits, pass by pass
    for (const Path& p : paths) {
      SCOPED_TRACE(::testing::Message() << p.name << ", deferred " << deferred);
      std::vector<std::vector<float>> got;
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_NO_FATAL_FAILURE(RunPath(*config, served.experts.get(), p, deferred, steps, &got));
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::printf("[ paths    ] %s deferred %d: %d steps, %.2f ms per pass\n", p.name, deferred,
                  steps, ms / (steps + 1));
      if (first.empty()) {
        first = got;
        continue;
      }
      ExpectSameBits(got, first);
    }
  }
}

// The cuda backend over a real service's shm slots: the device waiting for
// each answer itself (a kernel polling the slot's state word) gives the
// same logits, bit for bit, as host wait nodes, as eager slot passes and as
// the host-copy path, with and without Expert Deferral; one graph launch per
// decode step.
TEST(PoolRoutedExperts, CudaDeviceWaitsEqualHostWaitsBitForBit) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  ExpectPathsAgree({{"device", true, true, true},
                    {"host", true, true, false},
                    {"eager", true, false, true},
                    {"copy", false, false, false}},
                   6);
}

// A long greedy decode (320 steps: 20 KV blocks of 16 tokens) through
// device-sent slot calls and replayed graphs equals the host-copy path bit
// for bit.
TEST(PoolRoutedExperts, CudaLongDecodeThroughSlotsEqualsHostCopy) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  ExpectPathsAgree({{"device", true, true, true}, {"copy", false, false, false}}, 320);
}

}  // namespace
}  // namespace hmoe
