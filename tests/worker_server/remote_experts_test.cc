// PoolRoutedExperts: the model's routed experts over a real expert service
// (the tiny DeepSeek-V3 fixture), as the worker uses them.
#include "gpu_worker/server/remote_experts.h"

#include <cmath>
#include <string>
#include <vector>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }

// A call the service refuses as malformed (here: a NaN routing weight, which
// the router of a broken pass produces) is INTERNAL naming the field, not
// INVALID_ARGUMENT: the engine reads INVALID_ARGUMENT as one request's bad
// input and would fail each request of the pass as if it were its own.
TEST(PoolRoutedExperts, ARefusedCallIsInternalNotTheClientsInvalidArgument) {
  testing::TempDir dir;
  testing::ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir()}, dir.file("port")));
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  ExpertPoolOptions po;
  po.targets = {proc.target()};
  po.transport = TransportKind::kShm;
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  // The worker's checkpoint must be the one the shards serve.
  auto other =
      PoolRoutedExperts::Create(*config, pool->get(), absl::Seconds(10), "0123456789abcdef");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("another checkpoint"));
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto ours = RoutedExpertsFingerprint(**ckpt, *config);  // as hmoe-gpu-worker computes it
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_EQ((*pool)->model().source_fingerprint, *ours);
  auto experts = PoolRoutedExperts::Create(*config, pool->get(), absl::Seconds(10), *ours);
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
  ids[0] = -1;
  EXPECT_EQ((*experts)->Forward(b, out.data()).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace hmoe
