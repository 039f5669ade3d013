// Model::health() comes from the backend: a backend that failed for good
// reports it through the driver, from any thread, without waiting for the
// pass that is running (the worker's health monitor polls it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "gpu_worker/driver/backend.h"
#include "gpu_worker/driver/model_driver.h"
#include "gpu_worker/routed_experts.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

class NoKv final : public KvCache {
 public:
  absl::Status Reserve(int64_t) override { return absl::OkStatus(); }
  void Shrink(int64_t) override {}
};

// Logits of zeros; Attention blocks while `hold` is set and, once `fail` is
// set, fails with a sticky INTERNAL, as the CUDA backend does after a CUDA error.
class FakeBackend final : public LayerBackend {
 public:
  explicit FakeBackend(int64_t vocab) : vocab_(vocab) {}
  std::atomic<bool> fail{false}, hold{false}, in_pass{false};

  const char* name() const override { return "fake"; }
  std::unique_ptr<KvCache> NewKvCache(int64_t) override { return std::make_unique<NoKv>(); }
  absl::Status health() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  absl::Status Begin(const PassTokens& t) override {
    rows_ = static_cast<int64_t>(t.logit_rows.size());
    return Broken();
  }
  absl::Status Attention(int) override {
    in_pass = true;
    while (hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (fail.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok())
        broken_ = absl::InternalError("CUDA PagedAttention: an illegal memory access");
    }
    return Broken();
  }
  absl::Status DenseMlp(int) override { return Broken(); }
  absl::Status Route(int, const GateSpec&, RoutedInput*) override {
    return absl::UnimplementedError("the fake backend has no router");
  }
  absl::Status StartSharedExperts(int) override { return Broken(); }
  absl::Status AddExperts(int, const float*) override { return Broken(); }
  absl::Status AddToResidual(const float*) override { return Broken(); }
  absl::Status Logits(float* out) override {
    std::fill(out, out + rows_ * vocab_, 0.0f);
    return Broken();
  }

 private:
  absl::Status Broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  int64_t vocab_, rows_ = 0;
  mutable std::mutex mu_;
  absl::Status broken_;
};

TEST(DriverHealth, ABackendThatFailedForGoodIsReportedWithoutWaitingForAPass) {
  auto config = LoadModelConfig(testing::FixturesDir() + "/mixtral_tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  // A dense-only view of the config, so no routed experts are needed.
  ModelConfig c = *config;
  c.num_layers = 1;
  c.layers.resize(1);
  c.layers[0].moe = false;
  ModelOptions o;
  o.backend = "fake";
  o.num_threads = 1;
  o.max_seq_len = 16;
  auto backend = std::make_unique<FakeBackend>(c.vocab_size);
  FakeBackend* fake = backend.get();
  auto model = CreateModelDriver(c, o, std::move(backend), nullptr, nullptr);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  auto seq = m.NewSequence();
  EXPECT_TRUE(m.health().ok());
  const std::vector<int32_t> two{1, 2}, three{3}, four{4};
  auto first = m.Prefill(*seq, two, LogitsMode::kLast);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(static_cast<int64_t>(first->size()), c.vocab_size);

  // A pass that will fail, held inside the backend: health() answers (still
  // OK) while it runs, then reports the failure once it happened.
  fake->hold = true;
  fake->fail = true;
  auto pass = std::async(std::launch::async,
                         [&] { return m.Prefill(*seq, three, LogitsMode::kLast).status(); });
  while (!fake->in_pass.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto h = std::async(std::launch::async, [&] { return m.health(); });
  ASSERT_EQ(h.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "health() waited for the running pass";
  EXPECT_TRUE(h.get().ok());
  fake->hold = false;
  const absl::Status st = pass.get();
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_EQ(m.health(), st);
  EXPECT_EQ(seq->length(), 2);  // the failed pass left the sequence as it was
  // Every later pass fails with the same status.
  EXPECT_EQ(m.Prefill(*seq, four, LogitsMode::kLast).status(), st);
}

}  // namespace
}  // namespace hmoe
