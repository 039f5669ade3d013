// The CPU-checkable part of the CUDA backend's feature matrix
// (tests/cuda/feature_matrix_test.cc has the whole of it, on a GPU): a MoE
// layer's calls through a real expert service's shm slots, driven as each
// expert-call path drives them (host node: Submit and Wait; device wait:
// Submit, then the slot's state word polled as WaitHostWord polls it; device
// send: Arm, the request written and REQUEST stored into the word as
// SendExpertCall does, then polled), x Expert Deferral {0, 2} (the call and
// its later part in the layer's two slots) x hot experts {off, on} (hot
// slots sent empty), on every model fixture: each answer equals the
// host-copy path's (RoutedExperts::Forward of the same call), bit for bit.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/server/remote_experts.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

enum class Path { kHostNode, kDeviceWait, kDeviceSend };
constexpr Path kPaths[] = {Path::kHostNode, Path::kDeviceWait, Path::kDeviceSend};
const char* Name(Path p) {
  return p == Path::kHostNode     ? "host node"
         : p == Path::kDeviceWait ? "device wait"
                                  : "device send";
}

// One part of a layer's call: bf16-representable rows (what a slot holds).
struct Part {
  int64_t T = 0;
  int k = 0;
  std::vector<float> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Polls `slot`'s state word until it leaves the busy range (5 s at most).
bool PollAnswered(const ExpertSlots& s, int slot) {
  const ExpertSlots::DeviceWait dw = s.device_wait(slot);
  const auto* word = reinterpret_cast<const std::atomic<uint32_t>*>(dw.word);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until) {
    const uint32_t v = word->load(std::memory_order_acquire);
    if (v < dw.busy_lo || v > dw.busy_hi) return true;
    std::this_thread::yield();
  }
  return false;
}

// `parts` sent in slots 0, 1, ... by `path` and waited for; their answers.
std::vector<std::vector<float>> ThroughSlots(ExpertSlots& s, Path path, int layer,
                                             const std::vector<Part>& parts) {
  std::vector<std::vector<float>> out;
  if (path == Path::kDeviceSend) s.SetDeviceSends(true);
  for (size_t i = 0; i < parts.size(); ++i) {
    const int slot = static_cast<int>(i);
    const Part& p = parts[i];
    const SlotView v = s.view(slot);
    for (size_t j = 0; j < p.hidden.size(); ++j) v.hidden[j] = F32ToBf16(p.hidden[j]);
    std::memcpy(v.ids, p.ids.data(), p.ids.size() * 4);
    std::memcpy(v.weights, p.weights.data(), p.weights.size() * 4);
    if (path == Path::kDeviceSend) {
      EXPECT_TRUE(s.Arm(slot, layer, static_cast<int32_t>(p.T), p.k));
      const ExpertSlots::DeviceWait dw = s.device_wait(slot);
      EXPECT_NE(dw.request, 0u);
      reinterpret_cast<std::atomic<uint32_t>*>(dw.word)->store(dw.request,
                                                               std::memory_order_release);
    } else {
      s.Submit(slot, layer, static_cast<int32_t>(p.T), p.k);
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const int slot = static_cast<int>(i);
    if (path != Path::kHostNode) {
      EXPECT_TRUE(PollAnswered(s, slot)) << "slot " << slot;
    }
    s.Wait(slot);
    const float* o = s.view(slot).out;
    out.emplace_back(o, o + parts[i].T * s.hidden());
  }
  if (path == Path::kDeviceSend) s.SetDeviceSends(false);
  EXPECT_TRUE(s.TakeStatus().ok());
  return out;
}

class SlotFeatureMatrix : public ::testing::TestWithParam<std::string> {};

TEST_P(SlotFeatureMatrix, EveryPathDeferralAndHotCombinationEqualsHostCopies) {
  const std::string dir = testing::ModelFixturesRoot() + "/" + GetParam();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  if (config->num_moe_layers() == 0) GTEST_SKIP() << GetParam() << " has no MoE layer";
  testing::TempDir tmp;
  testing::ServiceProcess proc;
  testing::ServedExperts served;
  ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc, tmp, *config, dir, &served));
  const int64_t H = config->hidden_size, E = config->moe.num_experts, T = 5;
  const int K = static_cast<int>(config->moe.experts_per_token);
  ExpertSlotsOptions so;
  so.hidden = H;
  so.num_slots = 2;  // a layer's call and its later part
  so.max_tokens = 32;
  so.top_k = K;
  auto slots = served.experts->MakeSlots(so);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_TRUE((*slots)->Prepare(absl::Now() + absl::Seconds(10)).ok());
  int layer = 0;
  while (!config->layers[static_cast<size_t>(layer)].moe) ++layer;
  // A routed call as the router leaves it.
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.05f, 1.f);
  std::vector<float> hidden(static_cast<size_t>(T * H));
  for (float& x : hidden) x = Bf16ToF32(F32ToBf16(nd(rng)));
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> weights(ids.size());
  std::vector<int32_t> all(static_cast<size_t>(E));
  for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < K; ++j) {
      ids[static_cast<size_t>(t * K + j)] = all[static_cast<size_t>(j)];
      weights[static_cast<size_t>(t * K + j)] = ud(rng);
    }
  }
  std::vector<uint8_t> hot_mask(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; e += 2) hot_mask[static_cast<size_t>(e)] = 1;
  for (int deferred : {0, std::min(2, K - 1)}) {
    for (bool hot : {false, true}) {
      // Deferral's split, then the hot slots of the call taken out.
      Part now{T, K - deferred, hidden, {}, {}}, later{T, deferred, hidden, {}, {}};
      now.ids.resize(static_cast<size_t>(T * now.k));
      now.weights.resize(now.ids.size());
      later.ids.resize(static_cast<size_t>(T * later.k));
      later.weights.resize(later.ids.size());
      SplitDeferred(ids.data(), weights.data(), T, K, deferred, now.ids.data(), now.weights.data(),
                    later.ids.data(), later.weights.data());
      if (hot) {
        std::vector<int32_t> cold(now.ids.size()), hot_ids(now.ids.size());
        SplitHot(now.ids.data(), T * now.k, hot_mask.data(), E, cold.data(), hot_ids.data());
        now.ids = cold;
      }
      std::vector<Part> parts = {now};
      if (deferred > 0) parts.push_back(later);
      // The host-copy path: Forward of each part.
      std::vector<std::vector<float>> want;
      for (const Part& p : parts) {
        std::vector<float> o(static_cast<size_t>(T * H));
        ExpertBatch b{layer, T, H, p.hidden.data(), p.k, p.ids.data(), p.weights.data()};
        ASSERT_TRUE(served.experts->Forward(b, o.data()).ok());
        want.push_back(std::move(o));
      }
      for (Path path : kPaths) {
        SCOPED_TRACE(::testing::Message() << GetParam() << ", " << Name(path) << ", deferred "
                                          << deferred << ", hot " << (hot ? "on" : "off"));
        const auto got = ThroughSlots(**slots, path, layer, parts);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].size() * 4), 0)
              << "part " << i << " differs from the host-copy path";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SlotFeatureMatrix,
                         ::testing::ValuesIn(testing::ModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace hmoe
