// The expert calls the CUDA backend's slot paths make (host node, device
// wait, device send), played here on the CPU over a real service's zero-copy
// shm slots: the device's send and its poll of the slot's state word are
// this thread's stores and loads. Each call is the pool's own: counted in
// its metrics as a Submit / Wait call is, and refused at once while the
// service is known down, with the CPU path's messages.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "gmock/gmock.h"
#include "gpu_worker/server/remote_experts.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::ModelDir;

enum class Path { kHostNode, kDeviceWait, kDeviceSend };
const char* PathName(Path p) {
  switch (p) {
    case Path::kHostNode:
      return "host node";
    case Path::kDeviceWait:
      return "device wait";
    case Path::kDeviceSend:
      return "device send";
  }
  return "?";
}

// The value of `series` (name{labels} as rendered); 0 when absent.
double Sample(const std::string& text, const std::string& series) {
  return testing::PrometheusSample(text, series, 0);
}

class DeviceCalls : public ::testing::Test {
 protected:
  // The service, a pool over shm with the worker's fail-fast settings and
  // metrics, its PoolRoutedExperts (call timeout `timeout`) and 2 slots.
  void Start(absl::Duration timeout) {
    auto config = LoadModelConfig(ModelDir());
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    testing::ServedExperts served;
    ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc_, dir_, config_, ModelDir(), &served,
                                                  timeout,
                                                  testing::FailFastPoolOptions(&metrics_)));
    pool_ = std::move(served.pool);
    experts_ = std::move(served.experts);
    ExpertSlotsOptions so;
    so.hidden = config_.hidden_size;
    so.num_slots = 2;
    so.max_tokens = 4;
    so.top_k = config_.moe.experts_per_token;
    auto slots = experts_->MakeSlots(so);
    ASSERT_TRUE(slots.ok()) << slots.status();
    slots_ = std::move(*slots);
    ASSERT_STREQ(slots_->kind(), "shm (zero copy)");
    layer_ = pool_->model().moe_layers[0];
  }

  // One call of `tokens` rows in `slot` by `path`, its failure if any;
  // `answered` runs once the device paths saw the answer (before Wait).
  absl::Status Call(Path path, int slot, int32_t tokens,
                    const std::function<void()>& answered = nullptr) {
    const int32_t k = config_.moe.experts_per_token;
    const SlotView v = slots_->view(slot);
    std::memset(v.hidden, 0, static_cast<size_t>(tokens * config_.hidden_size * 2));
    for (int32_t t = 0; t < tokens; ++t) {
      for (int32_t j = 0; j < k; ++j) {
        v.ids[t * k + j] = (t + j) % static_cast<int32_t>(config_.moe.num_experts);
        v.weights[t * k + j] = 0.25f;
      }
    }
    const ExpertSlots::DeviceWait dw = slots_->device_wait(slot);
    auto* word = reinterpret_cast<std::atomic<uint32_t>*>(dw.word);
    if (path == Path::kDeviceSend) {
      slots_->SetDeviceSends(true);
      // The device sends only what the host armed.
      if (slots_->Arm(slot, layer_, tokens, k)) word->store(dw.request, std::memory_order_release);
    } else {
      slots_->Submit(slot, layer_, tokens, k);
    }
    if (path != Path::kHostNode) {
      // The device's poll, with its own timeout (the call's).
      const auto until = absl::ToChronoTime(absl::Now() + slots_->call_timeout());
      while (std::chrono::system_clock::now() < until) {
        const uint32_t s = word->load(std::memory_order_acquire);
        if (s < dw.busy_lo || s > dw.busy_hi) break;
        std::this_thread::yield();
      }
    }
    if (answered) answered();
    slots_->Wait(slot);
    if (path == Path::kDeviceSend) slots_->SetDeviceSends(false);
    return slots_->TakeStatus();
  }

  std::string Series(const char* name, const std::string& more = "") const {
    return absl::StrCat(name, "{transport=\"shm\",shard=\"", proc_.target(), "\"", more, "}");
  }
  double Calls(const char* outcome) {
    return Sample(metrics_.RenderPrometheus(),
                  Series("hmoe_expert_calls_total", absl::StrCat(",outcome=\"", outcome, "\"")));
  }
  double Metric(const char* name, const std::string& more = "") {
    return Sample(metrics_.RenderPrometheus(), Series(name, more));
  }
  double Up() {
    return Sample(metrics_.RenderPrometheus(),
                  absl::StrCat("hmoe_expert_shard_up{shard=\"", proc_.target(), "\"}"));
  }

  testing::TempDir dir_;
  testing::ServiceProcess proc_;
  ModelConfig config_;
  MetricsRegistry metrics_;
  std::unique_ptr<ExpertPool> pool_;
  std::unique_ptr<PoolRoutedExperts> experts_;
  std::unique_ptr<ExpertSlots> slots_;
  int32_t layer_ = 0;
};

// Whoever sends a call, it is counted once: calls by outcome, token rows,
// payload bytes and the latency histogram, as a Submit / Wait call is.
TEST_F(DeviceCalls, EveryPathIsCountedAsThePoolsOwnCalls) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(10)));
  const int64_t H = config_.hidden_size, k = config_.moe.experts_per_token;
  int64_t calls = 0, tokens = 0;
  // The pool's own path (the host copy path's RoutedExperts::Forward).
  {
    std::vector<float> hidden(static_cast<size_t>(3 * H), 0.f), out(hidden.size());
    std::vector<int32_t> ids(static_cast<size_t>(3 * k));
    std::vector<float> w(ids.size(), 0.25f);
    for (size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<int32_t>(i % static_cast<size_t>(config_.moe.num_experts));
    ExpertBatch b{layer_, 3, H, hidden.data(), static_cast<int>(k), ids.data(), w.data()};
    ASSERT_TRUE(experts_->Forward(b, out.data()).ok());
    calls += 1;
    tokens += 3;
  }
  EXPECT_EQ(Calls("ok"), calls);
  for (Path path : {Path::kHostNode, Path::kDeviceWait, Path::kDeviceSend}) {
    SCOPED_TRACE(PathName(path));
    for (int slot = 0; slot < 2; ++slot) {
      ASSERT_TRUE(Call(path, slot, 2 + slot).ok());
      calls += 1;
      tokens += 2 + slot;
    }
    EXPECT_EQ(Calls("ok"), calls);
    EXPECT_EQ(Metric("hmoe_expert_call_seconds_count"), calls);
    EXPECT_EQ(Metric("hmoe_expert_call_tokens_total"), tokens);
    EXPECT_EQ(Metric("hmoe_expert_call_bytes_total", ",direction=\"sent\""),
              tokens * (H * 2 + k * 8));
    EXPECT_EQ(Metric("hmoe_expert_call_bytes_total", ",direction=\"received\""), tokens * H * 4);
  }
  // Armed, never sent by the device (its pass stopped first): no call.
  slots_->SetDeviceSends(true);
  ASSERT_TRUE(slots_->Arm(0, layer_, 1, static_cast<int32_t>(k)));
  slots_->Wait(0);
  slots_->SetDeviceSends(false);
  EXPECT_THAT(std::string(slots_->TakeStatus().message()), HasSubstr("never sent"));
  EXPECT_EQ(Calls("ok"), calls);
  EXPECT_EQ(Calls("aborted"), 0);
  EXPECT_EQ(Metric("hmoe_expert_call_seconds_count"), calls);
  EXPECT_EQ(Up(), 1);
}

// A garbage answer (a NaN, an infinity) is refused: the call fails
// DATA_LOSS naming the value's place (INTERNAL to the engine, which re-runs
// the pass request by request), the pass that read it is dropped, and the
// failure is counted; the next call is served.
TEST_F(DeviceCalls, AGarbageAnswerIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(10)));
  const int64_t H = config_.hidden_size;
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity()};
  for (Path path : {Path::kDeviceSend, Path::kDeviceWait}) {
    for (float v : bad) {
      SCOPED_TRACE(absl::StrCat(PathName(path), " ", v));
      const absl::Status st =
          Call(path, 0, 2, [&] { const_cast<float*>(slots_->view(0).out)[H + 5] = v; });
      EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("answer was refused")) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("non-finite value (row 1, column 5)")) << st;
      EXPECT_TRUE(Call(path, 0, 2).ok());
    }
  }
  EXPECT_EQ(Calls("data_loss"), 4);
  EXPECT_EQ(Calls("ok"), 4);
  EXPECT_EQ(Up(), 1) << "a garbage answer is not a service down";
  // The pool's own path (the CPU backend's, the cuda host copy path's): a
  // NaN hidden row comes back NaN and is refused alike.
  const int64_t k = config_.moe.experts_per_token;
  std::vector<float> hidden(static_cast<size_t>(2 * H), 0.f), out(hidden.size());
  hidden[static_cast<size_t>(H + 7)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<int32_t> ids(static_cast<size_t>(2 * k));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % k);
  std::vector<float> w(ids.size(), 0.25f);
  const absl::Status st = experts_->Forward(
      ExpertBatch{layer_, 2, H, hidden.data(), static_cast<int>(k), ids.data(), w.data()},
      out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("non-finite value (row 1, column ")) << st;
}

// Answers that keep failing DATA_LOSS while the service's control plane
// answers (a segment another server took over, a service answering garbage)
// are a broken data path: DataPathsBroken (the worker's health) says so
// after kDataPathBrokenAfter in a row, and a served call clears it.
TEST_F(DeviceCalls, DataLossInARowIsABrokenDataPath) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(10)));
  const int64_t H = config_.hidden_size;
  auto garbage = [&] {
    const_cast<float*>(slots_->view(0).out)[H + 1] = std::numeric_limits<float>::quiet_NaN();
  };
  for (int i = 1; i <= ExpertPool::kDataPathBrokenAfter; ++i) {
    EXPECT_EQ(pool_->DataPathsBroken(), std::vector<bool>{false}) << "after " << i - 1;
    EXPECT_FALSE(Call(Path::kDeviceSend, 0, 2, garbage).ok());
  }
  EXPECT_EQ(pool_->DataPathsBroken(), std::vector<bool>{true});
  ASSERT_TRUE(Call(Path::kDeviceSend, 0, 2).ok());
  EXPECT_EQ(pool_->DataPathsBroken(), std::vector<bool>{false});
}

// A hung service (stopped) while the device waits on a slot word: the call
// costs one timeout and ends UNAVAILABLE with the CPU path's words; the
// calls after it, and the reconnect before a pass, fail at once (the miss's
// fail-fast, then the failed health check's) without waiting for the
// service; continued and found serving, the same slots serve again.
TEST_F(DeviceCalls, AHungServiceFailsFastOnTheDevicePath) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Milliseconds(500)));
  const int32_t k = config_.moe.experts_per_token;
  ASSERT_TRUE(Call(Path::kDeviceSend, 0, 1).ok());
  proc_.Signal(SIGSTOP);
  absl::Time t0 = absl::Now();
  absl::Status st = Call(Path::kDeviceSend, 0, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("did not answer within 500ms")) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(Calls("deadline_exceeded"), 1);

  // Within the miss's fail-fast second: the pass's reconnect and its calls
  // are refused at once, nothing is sent.
  t0 = absl::Now();
  absl::StatusOr<uint64_t> prep = slots_->Prepare(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(prep.status().code(), absl::StatusCode::kUnavailable) << prep.status();
  EXPECT_THAT(std::string(prep.status().message()), HasSubstr("missed a call deadline"));
  slots_->SetDeviceSends(true);
  EXPECT_FALSE(slots_->Arm(1, layer_, 1, k)) << "armed for a service failing fast";
  EXPECT_TRUE(slots_->has_failure()) << "the device's waits end at once";
  slots_->Wait(1);
  slots_->SetDeviceSends(false);
  st = slots_->TakeStatus();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("failing fast")) << st;
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(100));
  EXPECT_EQ(Calls("unavailable"), 1);

  // The health check finds it down: refused at once, however long after.
  for (Health h : pool_->CheckHealth(absl::Milliseconds(300))) EXPECT_NE(h, Health::kServing);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  t0 = absl::Now();
  prep = slots_->Prepare(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(prep.status().code(), absl::StatusCode::kUnavailable) << prep.status();
  EXPECT_THAT(std::string(prep.status().message()), HasSubstr("last health check"));
  st = Call(Path::kDeviceSend, 1, 1);
  EXPECT_THAT(std::string(st.message()), HasSubstr("last health check")) << st;
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(100));
  EXPECT_EQ(Up(), 0);

  proc_.Signal(SIGCONT);
  for (Health h : pool_->CheckHealth(absl::Seconds(2))) EXPECT_EQ(h, Health::kServing);
  ASSERT_TRUE(slots_->Prepare(absl::Now() + absl::Seconds(10)).ok());
  // The slot of the abandoned call is free once the service finished it.
  absl::Status back;
  for (int i = 0; i < 50; ++i) {
    back = Call(Path::kDeviceSend, 0, 1);
    if (back.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(back.ok()) << back;
  EXPECT_TRUE(Call(Path::kDeviceSend, 1, 2).ok());
  EXPECT_EQ(Up(), 1);
}

// A killed service: the device's wait ends (the watchdog's check), the call
// is UNAVAILABLE and the shard down; once a health check found it down a
// pass is refused at once (no reconnect attempt per request); restarted and
// found serving, the slots reconnect (a new generation) and serve.
TEST_F(DeviceCalls, AKilledServiceIsDownUntilItIsBack) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(2)));
  ASSERT_TRUE(slots_->Prepare(absl::Now() + absl::Seconds(10)).ok());
  const uint64_t gen = *slots_->Prepare(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(Call(Path::kDeviceSend, 0, 1).ok());
  proc_.Kill(SIGKILL);
  // What the watchdog polls while the device waits.
  for (int i = 0; i < 100 && slots_->service_alive(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(slots_->service_alive());
  absl::Status st = Call(Path::kDeviceSend, 1, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(Up(), 0);
  for (Health h : pool_->CheckHealth(absl::Milliseconds(300))) EXPECT_NE(h, Health::kServing);
  for (int i = 0; i < 3; ++i) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<uint64_t> prep = slots_->Prepare(absl::Now() + absl::Seconds(10));
    EXPECT_EQ(prep.status().code(), absl::StatusCode::kUnavailable) << prep.status();
    EXPECT_THAT(std::string(prep.status().message()), HasSubstr("last health check"));
    EXPECT_LT(absl::Now() - t0, absl::Milliseconds(100));
  }
  ASSERT_TRUE(proc_.Restart());
  for (Health h : pool_->CheckHealth(absl::Seconds(2))) EXPECT_EQ(h, Health::kServing);
  absl::StatusOr<uint64_t> prep = slots_->Prepare(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(prep.ok()) << prep.status();
  EXPECT_NE(*prep, gen) << "the slots moved to the new service's segment";
  EXPECT_TRUE(Call(Path::kDeviceSend, 0, 1).ok());
  EXPECT_TRUE(Call(Path::kHostNode, 1, 2).ok());
  EXPECT_EQ(Up(), 1);
}

}  // namespace
}  // namespace hmoe
