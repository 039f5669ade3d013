// The worker-side tests' expert service: the tiny DeepSeek-V3 fixture served
// by a real hmoe-expert-service child process, reached through an ExpertPool.
#pragma once

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "gpu_worker/server/remote_experts.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

namespace hmoe::testing {

inline std::string ModelDir() { return FixturesDir() + "/deepseek_v3_tiny"; }

// `model_dir`'s service in `proc`, and a pool over shm to it (null on
// failure), with `options`' other settings (fail-fast, metrics).
inline std::unique_ptr<ExpertPool> StartShm(ServiceProcess& proc, TempDir& dir,
                                            const std::string& model_dir = ModelDir(),
                                            const ExpertPoolOptions& options = {}) {
  EXPECT_TRUE(proc.Start({"--model-dir=" + model_dir}, dir.file("port")));
  ExpertPoolOptions po = options;
  po.targets = {proc.target()};
  po.transport = TransportKind::kShm;
  auto pool = ExpertPool::Connect(po);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

// A real service of `model_dir` (whose config is `config`) and the worker's
// PoolRoutedExperts over shm to it.
struct ServedExperts {
  std::unique_ptr<ExpertPool> pool;
  std::unique_ptr<PoolRoutedExperts> experts;
};
// Fails the calling test (wrap in ASSERT_NO_FATAL_FAILURE) if a step fails.
inline void ServeExperts(ServiceProcess& proc, TempDir& dir, const ModelConfig& config,
                         const std::string& model_dir, ServedExperts* out,
                         absl::Duration call_timeout = absl::Seconds(10),
                         const ExpertPoolOptions& options = {}) {
  ASSERT_NO_FATAL_FAILURE(out->pool = StartShm(proc, dir, model_dir, options));
  ASSERT_NE(out->pool, nullptr);
  auto experts = PoolRoutedExperts::Create(config, out->pool.get(), call_timeout, "");
  ASSERT_TRUE(experts.ok()) << experts.status();
  out->experts = std::move(*experts);
}

// Fail-fast as the worker's pool (1 s after a missed call deadline; after a
// failed health check 30 s, which outlasts a test, where the worker's
// monitor checks every second), metrics in `metrics` (one registry per pool:
// its names register once).
inline ExpertPoolOptions FailFastPoolOptions(MetricsRegistry* metrics) {
  ExpertPoolOptions po;
  po.fail_fast_after_miss = absl::Seconds(1);
  po.fail_fast_after_failed_check = absl::Seconds(30);
  po.metrics = metrics;
  return po;
}

}  // namespace hmoe::testing
