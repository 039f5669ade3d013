// Faults under the cuda backend's device-sent expert calls (one CUDA Graph
// per decode step, the device sending each call over a real service's
// zero-copy shm slots and polling its state word): the calls counted as the
// pool's own, a service killed, stopped or restarted while the device waits
// on a slot word, a garbage answer, the GPU's memory taken at start and the
// KV pool run dry. Every fault ends the pass with a status (never a hung
// GPU, a crash or a broken backend) and the graph path serves again without
// a new Model. Skips without a usable GPU (or in a build without CUDA).
#include <cuda_runtime.h>
#include <signal.h>

#include <algorithm>
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
#include "common/safetensors.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gpu_worker/model.h"
#include "gpu_worker/server/remote_experts.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/backends.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/worker_server/pool_test_util.h"

namespace hmoe {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::ModelDir;

// The value of `series` (name{labels} as rendered); 0 when absent.
double Sample(const std::string& text, const std::string& series) {
  return testing::PrometheusSample(text, series, 0);
}

const std::vector<int32_t>& Prompt() {
  static const std::vector<int32_t> p = {1, 5, 17, 42, 7};
  return p;
}

bool Finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

class CudaDeviceFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    HMOE_SKIP_UNLESS_BACKEND("cuda");
    auto config = LoadModelConfig(ModelDir());
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    auto ckpt = Checkpoint::Open(ModelDir());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(*ckpt);
  }

  // The service, a pool over shm with the worker's fail-fast settings and
  // metrics, PoolRoutedExperts with call timeout `timeout`, and a cuda Model
  // whose decode steps are CUDA Graphs of device-sent calls.
  void Start(absl::Duration timeout, PrefillExperts prefill = PrefillExperts::kCpu) {
    // A second Start: what uses the old pool and registry goes first.
    model_.reset();
    experts_.reset();
    pool_.reset();
    metrics_ = std::make_unique<MetricsRegistry>();  // one per pool (names register once)
    testing::ServedExperts served;
    ASSERT_NO_FATAL_FAILURE(testing::ServeExperts(proc_, dir_, config_, ModelDir(), &served,
                                                  timeout,
                                                  testing::FailFastPoolOptions(metrics_.get())));
    pool_ = std::move(served.pool);
    experts_ = std::move(served.experts);
    ModelOptions o;
    o.backend = "cuda";
    o.num_threads = 2;
    o.cuda.graphs = true;
    o.cuda.slot_calls = SlotCalls::kDeviceSends;
    o.cuda.prefill_experts = prefill;
    auto m = Model::Create(config_, *ckpt_, o, experts_.get());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
    ASSERT_STREQ(model_->stats().expert_call_path, "device send");
  }

  // Logits of Prompt() then `steps` greedy decode steps on a fresh sequence.
  std::vector<std::vector<float>> Run(int steps) {
    std::vector<std::vector<float>> r;
    auto seq = model_->NewSequence();
    auto lg = model_->Prefill(*seq, Prompt(), LogitsMode::kLast);
    EXPECT_TRUE(lg.ok()) << lg.status();
    if (!lg.ok()) return r;
    r.push_back(*lg);
    for (int i = 0; i < steps; ++i) {
      const auto& last = r.back();
      auto l = model_->Decode(
          *seq, static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      r.push_back(*l);
    }
    return r;
  }

  std::string Shard() const { return proc_.target(); }
  double Calls(const char* outcome) {
    return Sample(metrics_->RenderPrometheus(),
                  absl::StrCat("hmoe_expert_calls_total{transport=\"shm\",shard=\"", Shard(),
                               "\",outcome=\"", outcome, "\"}"));
  }
  double Tokens() {
    return Sample(
        metrics_->RenderPrometheus(),
        absl::StrCat("hmoe_expert_call_tokens_total{transport=\"shm\",shard=\"", Shard(), "\"}"));
  }
  // Whether every shard is serving at one check (as the worker's monitor's).
  bool ServingNow() {
    for (Health h : pool_->CheckHealth(absl::Milliseconds(500)))
      if (h != Health::kServing) return false;
    return true;
  }
  // Whether every shard is found serving within 10 s (checked as the
  // worker's monitor does; a restarted service's channel may first be in
  // its reconnect backoff).
  bool Serving() {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    for (;;) {
      bool all = true;
      for (Health h : pool_->CheckHealth(absl::Milliseconds(500))) all &= h == Health::kServing;
      if (all) return true;
      if (absl::Now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // Decodes continuously in a thread (a fresh sequence every 8 steps) until
  // a step fails; `fault` runs 300 ms in. The failure and how long after the
  // fault it came.
  std::pair<absl::Status, absl::Duration> FailWhileDecoding(const std::function<void()>& fault) {
    std::atomic<bool> stop{false};
    absl::Status failed;
    absl::Time failed_at;
    std::thread t([&] {
      while (!stop.load()) {
        auto seq = model_->NewSequence();
        auto lg = model_->Prefill(*seq, Prompt(), LogitsMode::kLast);
        absl::Status st = lg.status();
        for (int i = 0; st.ok() && i < 8; ++i) st = model_->Decode(*seq, 3 + i).status();
        if (!st.ok()) {
          failed = st;
          failed_at = absl::Now();
          return;
        }
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const absl::Time at = absl::Now();
    fault();
    // A step that never ends is the defect this looks for: give up after 20 s.
    for (int i = 0; i < 2000 && failed.ok(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stop.store(true);
    t.join();
    return {failed, failed.ok() ? absl::InfiniteDuration() : failed_at - at};
  }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  testing::TempDir dir_;
  testing::ServiceProcess proc_;
  std::unique_ptr<MetricsRegistry> metrics_;
  std::unique_ptr<ExpertPool> pool_;
  std::unique_ptr<PoolRoutedExperts> experts_;
  std::unique_ptr<Model> model_;
};

// Every call the device sends is counted: one per MoE layer per decode step,
// its one token each (no hot experts, no deferral).
TEST_F(CudaDeviceFaults, DeviceSentCallsAreCounted) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(10)));
  auto seq = model_->NewSequence();
  ASSERT_TRUE(model_->Prefill(*seq, Prompt(), LogitsMode::kLast).ok());
  const double calls = Calls("ok"), tokens = Tokens();
  EXPECT_GT(calls, 0) << "the prefill's calls";
  const int64_t launches = model_->stats().graph_launches;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(model_->Decode(*seq, 3 + i).ok());
  EXPECT_EQ(model_->stats().graph_launches - launches, 6);
  const int64_t moe = config_.num_moe_layers();
  EXPECT_EQ(Calls("ok") - calls, 6 * moe);
  EXPECT_EQ(Tokens() - tokens, 6 * moe);
  EXPECT_EQ(Calls("unavailable") + Calls("deadline_exceeded"), 0);
}

// kill -9 while graphs of device-sent calls run: the watchdog ends the
// device's wait (well within the 5 s expert timeout), the step fails
// UNAVAILABLE; once the health check saw it down, steps are refused at once
// ('last health check'); restarted, the same Model serves the same logits
// (the slots moved: the graphs are captured again).
TEST_F(CudaDeviceFaults, KillDuringGraphDecode) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(5)));
  const auto want = Run(4);
  ASSERT_EQ(want.size(), 5u);
  auto [st, after] = FailWhileDecoding([&] { proc_.Kill(SIGKILL); });
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(after, absl::Seconds(3)) << "the watchdog, not the expert timeout, ends the wait";
  EXPECT_TRUE(model_->health().ok()) << model_->health();
  EXPECT_FALSE(ServingNow());
  for (int i = 0; i < 3; ++i) {
    const absl::Time t0 = absl::Now();
    auto seq = model_->NewSequence();
    auto lg = model_->Prefill(*seq, Prompt(), LogitsMode::kLast);
    EXPECT_EQ(lg.status().code(), absl::StatusCode::kUnavailable) << lg.status();
    EXPECT_THAT(std::string(lg.status().message()), HasSubstr("last health check"));
    EXPECT_LT(absl::Now() - t0, absl::Milliseconds(300));
  }
  ASSERT_TRUE(proc_.Restart());
  ASSERT_TRUE(Serving());
  const int64_t captures = model_->stats().graph_captures;
  const auto got = Run(4);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4), 0) << "pass " << i;
  EXPECT_GT(model_->stats().graph_captures, captures);
  EXPECT_TRUE(model_->health().ok());
}

// SIGSTOP while graphs of device-sent calls run: one expert timeout, then
// UNAVAILABLE with the CPU path's words; the next steps fail at once (the
// miss's fail-fast, then the health check's); SIGCONT: served again, same
// logits, with the same graphs (the slots did not move).
TEST_F(CudaDeviceFaults, StopAndContinueDuringGraphDecode) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(1)));
  const auto want = Run(4);
  ASSERT_EQ(want.size(), 5u);
  auto [st, after] = FailWhileDecoding([&] { proc_.Signal(SIGSTOP); });
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("did not answer within 1s")) << st;
  EXPECT_LT(after, absl::Seconds(4));
  auto seq = model_->NewSequence();
  absl::Time t0 = absl::Now();
  auto lg = model_->Prefill(*seq, Prompt(), LogitsMode::kLast);
  EXPECT_EQ(lg.status().code(), absl::StatusCode::kUnavailable) << lg.status();
  EXPECT_THAT(std::string(lg.status().message()), HasSubstr("failing fast"));
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(300));
  EXPECT_FALSE(ServingNow());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  t0 = absl::Now();
  lg = model_->Prefill(*seq, Prompt(), LogitsMode::kLast);
  EXPECT_THAT(std::string(lg.status().message()), HasSubstr("last health check")) << lg.status();
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(300));
  EXPECT_TRUE(model_->health().ok());
  proc_.Signal(SIGCONT);
  ASSERT_TRUE(Serving());
  // The abandoned call finishes at the service; then the slots serve again.
  std::vector<std::vector<float>> got;
  for (int i = 0; i < 50 && got.size() != want.size(); ++i) {
    auto s = model_->NewSequence();
    if (!model_->Prefill(*s, Prompt(), LogitsMode::kLast).ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    got = Run(4);
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].size() * 4), 0) << "pass " << i;
  EXPECT_GE(Calls("deadline_exceeded"), 1);
}

// The same faults during a long prefill (more tokens than a slot pass:
// the host copy path, or hybrid prefill's split between the GPU's streamed
// experts and the service): the pass ends with a status within the expert
// timeout and the model serves again once the service is back.
TEST_F(CudaDeviceFaults, FaultsDuringHybridPrefill) {
  for (PrefillExperts policy : {PrefillExperts::kCpu, PrefillExperts::kAuto}) {
    SCOPED_TRACE(policy == PrefillExperts::kCpu ? "cpu" : "auto");
    ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(2), policy));
    std::vector<int32_t> prompt;
    for (int i = 0; i < 48; ++i) prompt.push_back((7 * i + 3) % 50);
    auto seq = model_->NewSequence();
    auto want = model_->Prefill(*seq, prompt, LogitsMode::kLast);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int sig : {SIGSTOP, SIGKILL}) {
      SCOPED_TRACE(sig == SIGSTOP ? "SIGSTOP" : "SIGKILL");
      if (sig == SIGSTOP)
        proc_.Signal(SIGSTOP);
      else
        proc_.Kill(SIGKILL);
      const absl::Time t0 = absl::Now();
      auto s = model_->NewSequence();
      auto got = model_->Prefill(*s, prompt, LogitsMode::kLast);
      // kAuto may have put every expert of this prompt on the GPU: then it
      // is served; else the service's failure, within the timeout.
      if (!got.ok()) {
        EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
      }
      EXPECT_LT(absl::Now() - t0, absl::Seconds(4));
      EXPECT_TRUE(model_->health().ok());
      if (sig == SIGSTOP)
        proc_.Signal(SIGCONT);
      else
        ASSERT_TRUE(proc_.Restart());
      ASSERT_TRUE(Serving());
      absl::StatusOr<std::vector<float>> back;
      for (int i = 0; i < 50; ++i) {
        auto s2 = model_->NewSequence();
        back = model_->Prefill(*s2, prompt, LogitsMode::kLast);
        if (back.ok()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(std::memcmp(back->data(), want->data(), back->size() * 4), 0);
    }
    model_.reset();
    experts_.reset();
    pool_.reset();
    proc_.Kill(SIGKILL);
  }
}

// In-process experts whose answers can be poisoned: the cuda backend's slots
// over them (RoutedExperts::MakeSlots: host nodes) carry the poison.
class PoisonedExperts final : public RoutedExperts {
 public:
  explicit PoisonedExperts(std::unique_ptr<RoutedExperts> inner) : inner_(std::move(inner)) {}
  absl::Status Forward(const ExpertBatch& b, float* out) override {
    RETURN_IF_ERROR(inner_->Forward(b, out));
    const float v = poison_.load();
    if (v != 0 && b.num_tokens > 0) out[b.num_tokens * b.hidden_size - 1] = v;
    return absl::OkStatus();
  }
  std::atomic<float> poison_{0};

 private:
  std::unique_ptr<RoutedExperts> inner_;
};

// A NaN or an infinity in an answer: the pass fails DATA_LOSS naming it,
// nothing non-finite reaches the logits, and the next pass is served.
TEST_F(CudaDeviceFaults, AGarbageAnswerIsRefused) {
  auto ref = MakeReferenceRoutedExperts(config_, *ckpt_, 2);
  ASSERT_TRUE(ref.ok()) << ref.status();
  PoisonedExperts experts(std::move(*ref));
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  auto m = Model::Create(config_, *ckpt_, o, &experts);
  ASSERT_TRUE(m.ok()) << m.status();
  auto seq = (*m)->NewSequence();
  auto first = (*m)->Prefill(*seq, Prompt(), LogitsMode::kLast);
  ASSERT_TRUE(first.ok()) << first.status();
  for (float v :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    experts.poison_.store(v);
    auto bad = (*m)->Decode(*seq, 3);
    ASSERT_FALSE(bad.ok() && Finite(*bad)) << "a non-finite answer was added";
    if (!bad.ok()) {
      EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
      EXPECT_THAT(std::string(bad.status().message()), HasSubstr("non-finite"));
    }
    experts.poison_.store(0);
    auto good = (*m)->Decode(*seq, 3);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_TRUE(Finite(*good));
    EXPECT_TRUE((*m)->health().ok());
  }
}

// The GPU's memory taken by someone else at start: a clear error, and
// nothing of the failed start left on the GPU; with the memory back, the
// same start succeeds.
TEST_F(CudaDeviceFaults, OutOfMemoryAtStartIsClearAndLeavesNothing) {
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  // Leave 48 MiB: less than the backend's workspace, KV cache and weights.
  void* hog = nullptr;
  const size_t take = free0 > (size_t{48} << 20) ? free0 - (size_t{48} << 20) : 0;
  ASSERT_EQ(cudaMalloc(&hog, take), cudaSuccess);
  size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  auto m = Model::Create(config_, *ckpt_, o, nullptr);
  EXPECT_FALSE(m.ok());
  if (!m.ok()) {
    EXPECT_THAT(m.status().code(),
                AnyOf(absl::StatusCode::kResourceExhausted, absl::StatusCode::kFailedPrecondition))
        << m.status();
    EXPECT_THAT(std::string(m.status().message()), ::testing::ContainsRegex("GiB|MiB|memory"))
        << m.status();
  }
  m = absl::UnknownError("released");
  size_t free2 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free2, &total), cudaSuccess);
  EXPECT_GE(free2 + (size_t{8} << 20), free1) << "the failed start left GPU memory behind";
  ASSERT_EQ(cudaFree(hog), cudaSuccess);
  auto again = Model::Create(config_, *ckpt_, o, nullptr);
  EXPECT_TRUE(again.ok()) << again.status();
}

// A KV pool run dry by many long sequences: RESOURCE_EXHAUSTED for the
// step that needs a block (the sequence as it was), never a crash; the
// blocks come back with the sequences and serve again.
TEST_F(CudaDeviceFaults, AnExhaustedKvPoolIsResourceExhausted) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.cuda.kv_blocks = 8;
  auto m = Model::Create(config_, *ckpt_, o, nullptr);
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t block = (*m)->kv_block_tokens();
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < 3 * block; ++i) prompt.push_back(static_cast<int32_t>((5 * i + 1) % 50));
  std::vector<std::unique_ptr<Sequence>> seqs;
  absl::Status st;
  for (int i = 0; i < 8 && st.ok(); ++i) {
    seqs.push_back((*m)->NewSequence());
    st = (*m)->Prefill(*seqs.back(), prompt, LogitsMode::kLast).status();
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE((*m)->health().ok());
  seqs.clear();
  auto s = (*m)->NewSequence();
  auto lg = (*m)->Prefill(*s, prompt, LogitsMode::kLast);
  EXPECT_TRUE(lg.ok()) << lg.status();
}

}  // namespace
}  // namespace hmoe
