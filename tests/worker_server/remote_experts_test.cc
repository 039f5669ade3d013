// PoolRoutedExperts: the model's routed experts over a real expert service
// (the tiny DeepSeek-V3 fixture), as the worker uses them.
#include "gpu_worker/server/remote_experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "gmock/gmock.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::ModelDir;
using testing::StartShm;

// A call the service refuses as malformed (here: a NaN routing weight, which
// the router of a broken pass produces) is INTERNAL naming the field, not
// INVALID_ARGUMENT: the engine reads INVALID_ARGUMENT as one request's bad
// input and would fail each request of the pass as if it were its own.
TEST(PoolRoutedExperts, ARefusedCallIsInternalNotTheClientsInvalidArgument) {
  testing::TempDir dir;
  testing::ServiceProcess proc;
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  std::unique_ptr<ExpertPool> pool;
  ASSERT_NO_FATAL_FAILURE(pool = StartShm(proc, dir));
  ASSERT_NE(pool, nullptr);
  // The worker's checkpoint must be the one the shards serve.
  auto other =
      PoolRoutedExperts::Create(*config, pool.get(), absl::Seconds(10), "0123456789abcdef");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("another checkpoint"));
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto ours = RoutedExpertsFingerprint(**ckpt, *config);  // as hmoe-gpu-worker computes it
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_EQ(pool->model().source_fingerprint, *ours);
  auto experts = PoolRoutedExperts::Create(*config, pool.get(), absl::Seconds(10), *ours);
  ASSERT_TRUE(experts.ok()) << experts.status();
  int layer = 0;
  while (!config->layers[static_cast<size_t>(layer)].moe) ++layer;
  const int64_t T = 3, H = config->hidden_size;
  const int k = static_cast<int>(config->moe.experts_per_token);
  std::vector<float> hidden(static_cast<size_t>(T * H), 0.25f);
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> weights(static_cast<size_t>(T * k), 0.5f);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int32_t>(i % static_cast<size_t>(config->moe.num_experts));
  std::vector<float> out(static_cast<size_t>(T * H));
  ExpertBatch b{layer, T, H, hidden.data(), k, ids.data(), weights.data()};
  ASSERT_TRUE((*experts)->Forward(b, out.data()).ok());

  weights[4] = std::nanf("");
  const absl::Status st = (*experts)->Forward(b, out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("expert_weights[4]"));
  // The worker's own malformed batch likewise.
  ids[0] = -2;  // (-1 is kNoExpert, an empty slot)
  EXPECT_EQ((*experts)->Forward(b, out.data()).code(), absl::StatusCode::kInternal);
}

// kNoExpert slots over a real service: a call's hot and cold halves
// (SplitHot) sum to the whole call within fp32 summation tolerance, and a
// call of empty slots only is zeros.
TEST(PoolRoutedExperts, EmptySlotsAreSkippedAndTheSplitHalvesSumToTheWhole) {
  testing::TempDir dir;
  testing::ServiceProcess proc;
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  testing::ServedExperts served;
  ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc, dir, *config, ModelDir(), &served));
  int layer = 0;
  while (!config->layers[static_cast<size_t>(layer)].moe) ++layer;
  const int64_t T = 5, H = config->hidden_size, E = config->moe.num_experts;
  const int k = static_cast<int>(config->moe.experts_per_token);
  std::vector<float> hidden(static_cast<size_t>(T * H));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> weights(static_cast<size_t>(T * k));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 5 + i / static_cast<size_t>(k)) % static_cast<size_t>(E));
    weights[i] = 0.1f + 0.05f * static_cast<float>(i % 7);
  }
  std::vector<uint8_t> hot(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; e += 2) hot[static_cast<size_t>(e)] = 1;
  std::vector<int32_t> cold_ids(ids.size()), hot_ids(ids.size());
  const int64_t n_hot = SplitHot(ids.data(), T * k, hot.data(), E, cold_ids.data(), hot_ids.data());
  ASSERT_GT(n_hot, 0);
  ASSERT_LT(n_hot, T * k);
  std::vector<float> whole(static_cast<size_t>(T * H)), a(whole.size()), b(whole.size());
  ExpertBatch batch{layer, T, H, hidden.data(), k, ids.data(), weights.data()};
  ASSERT_TRUE(served.experts->Forward(batch, whole.data()).ok());
  batch.expert_ids = cold_ids.data();
  ASSERT_TRUE(served.experts->Forward(batch, a.data()).ok());
  batch.expert_ids = hot_ids.data();
  ASSERT_TRUE(served.experts->Forward(batch, b.data()).ok());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) + b[i] - whole[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(whole[i])));
  }
  EXPECT_GT(scale, 0);
  EXPECT_LE(diff, 1e-5 * scale);
  std::vector<int32_t> none(ids.size(), kNoExpert);
  batch.expert_ids = none.data();
  std::fill(a.begin(), a.end(), 7.0f);
  ASSERT_TRUE(served.experts->Forward(batch, a.data()).ok());
  for (float v : a) ASSERT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace hmoe
