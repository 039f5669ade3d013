// The engine's metrics (EngineOptions::metrics) move exactly with what its
// final events report.
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gpu_worker/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  GenerateEvent final_event;
  std::vector<int32_t> ids;
  bool done = false;

  Engine::Callback Callback() {
    return [this](const GenerateEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (ev.finish != FinishReason::kNone) {
        final_event = ev;
        done = true;
        cv.notify_all();
      }
    };
  }
  bool Wait() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(60), [&] { return done; });
  }
};

// The value of `series` (name plus labels, as rendered) in the text; -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ')
      return std::stod(line.substr(series.size() + 1));
  return -1;
}

GenerateRequest Short(int i, int max_tokens) {
  GenerateRequest r;
  r.prompt = {static_cast<int32_t>(3 + i), static_cast<int32_t>(100 + 7 * i),
              static_cast<int32_t>(40 + i)};
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// A model whose passes all fail UNAVAILABLE (the expert service gone).
class DownModel final : public Model {
 public:
  explicit DownModel(const Model* inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_->config(); }
  const ModelOptions& options() const override { return inner_->options(); }
  std::unique_ptr<Sequence> NewSequence() const override { return inner_->NewSequence(); }
  absl::Status ForwardBatch(absl::Span<const ForwardStep>) const override {
    return absl::UnavailableError("expert service gone");
  }

 private:
  const Model* inner_;
};

class EngineMetricsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    HMOE_SKIP_UNLESS_BACKEND(GetParam());
    static auto* models = new std::map<std::string, std::unique_ptr<Model>>;
    auto& m = (*models)[GetParam()];
    if (!m) {
      ModelOptions mo;
      mo.max_seq_len = 256;
      mo.backend = GetParam();
      auto loaded = Model::Load(testing::FixturesDir() + "/deepseek_v3_tiny", mo);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      m = std::move(*loaded);
    }
    model_ = m.get();
  }
  const Model* model_ = nullptr;
};

// Requests of several lengths and outcomes: every counter and histogram
// count is what the final events say.
TEST_P(EngineMetricsTest, CountersAndHistogramsFollowTheFinalEvents) {
  MetricsRegistry reg;
  EngineOptions o;
  o.metrics = &reg;
  o.prefill_chunk = 4;
  auto engine = Engine::Create(model_, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::string before = reg.RenderPrometheus();
  EXPECT_EQ(Sample(before, "hmoe_kv_blocks_capacity"),
            static_cast<double>((*engine)->stats().kv_blocks_total));
  EXPECT_EQ(Sample(before, "hmoe_requests_finished_total{outcome=\"length\"}"), 0);
  EXPECT_EQ(Sample(before, "hmoe_time_to_first_token_seconds_count"), 0);

  // A request that stops at its third token (its greedy third, found first).
  Collector probe;
  ASSERT_TRUE((*engine)->Submit(Short(7, 3), probe.Callback()).ok());
  ASSERT_TRUE(probe.Wait());
  ASSERT_EQ(probe.ids.size(), 3u);
  std::vector<GenerateRequest> reqs = {Short(7, 3)};
  reqs[0].max_tokens = 50;
  reqs[0].stop_token_ids = {probe.ids[2]};
  for (int i = 0; i < 5; ++i) reqs.push_back(Short(i, 1 + 3 * i));     // 1, 4, 7, 10, 13 tokens
  reqs[3].prompt.insert(reqs[3].prompt.end(), {7, 8, 9, 10, 11, 12});  // chunked prefill
  GenerateRequest expired = Short(8, 5);
  expired.deadline = absl::Now() - absl::Seconds(1);
  reqs.push_back(expired);
  std::vector<Collector> cs(reqs.size() + 1);
  cs.back().final_event = probe.final_event;  // counted too
  cs.back().done = true;
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_TRUE((*engine)->Submit(reqs[i], cs[i].Callback()).ok());
  std::map<std::string, int> outcomes;
  int64_t completion = 0, with_tokens = 0, after_first = 0, prompt = 0;
  for (size_t i = 0; i < cs.size(); ++i) {
    ASSERT_TRUE(cs[i].Wait());
    const GenerateEvent& ev = cs[i].final_event;
    ++outcomes[FinishReasonName(ev.finish)];
    completion += ev.completion_tokens;
    if (ev.completion_tokens > 0) {
      ++with_tokens;
      after_first += ev.completion_tokens - 1;
      prompt += ev.prompt_tokens;  // a request that produced a token prefilled all its prompt
    }
  }
  EXPECT_EQ(outcomes["deadline"], 1);
  EXPECT_EQ(outcomes["stop"], 1);
  EXPECT_EQ(outcomes["length"], 6);

  const std::string text = reg.RenderPrometheus();
  for (const char* outcome :
       {"stop", "length", "stop_string", "cancelled", "deadline", "error", "rejected"})
    EXPECT_EQ(Sample(text, absl::StrCat("hmoe_requests_finished_total{outcome=\"", outcome, "\"}")),
              outcomes[outcome])
        << outcome << "\n"
        << text;
  EXPECT_EQ(Sample(text, "hmoe_generation_tokens_total"), completion);
  EXPECT_EQ(Sample(text, "hmoe_generation_tokens_total"),
            static_cast<double>((*engine)->stats().tokens_generated));
  EXPECT_EQ(Sample(text, "hmoe_prompt_tokens_total"), prompt);
  EXPECT_EQ(Sample(text, "hmoe_time_to_first_token_seconds_count"), with_tokens);
  EXPECT_EQ(Sample(text, "hmoe_inter_token_latency_seconds_count"), after_first);
  EXPECT_EQ(Sample(text, "hmoe_request_duration_seconds_count"), static_cast<double>(cs.size()));
  // Every request but the expired one was admitted.
  EXPECT_EQ(Sample(text, "hmoe_request_queue_seconds_count"), static_cast<double>(cs.size() - 1));
  EXPECT_GT(Sample(text, "hmoe_time_to_first_token_seconds_sum"), 0);
  EXPECT_GE(Sample(text, "hmoe_forward_pass_seconds_count{kind=\"prefill\"}") +
                Sample(text, "hmoe_forward_pass_seconds_count{kind=\"mixed\"}"),
            1);
  EXPECT_GE(Sample(text, "hmoe_forward_pass_seconds_count{kind=\"decode\"}"), 1);
  EXPECT_EQ(Sample(text, "hmoe_requests_running"), 0);
  EXPECT_EQ(Sample(text, "hmoe_requests_waiting"), 0);
  EXPECT_EQ(Sample(text, "hmoe_kv_blocks_used"), 0);
}

// One request alone: ceil(prompt / chunk) prefill passes, then one decode
// pass per token after the first; nothing mixed.
TEST_P(EngineMetricsTest, PassKindsOfOneRequest) {
  MetricsRegistry reg;
  EngineOptions o;
  o.metrics = &reg;
  o.prefill_chunk = 2;
  auto engine = Engine::Create(model_, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  GenerateRequest r = Short(0, 6);
  r.prompt.push_back(11);
  r.prompt.push_back(12);  // 5 prompt tokens: 3 prefill passes
  Collector c;
  ASSERT_TRUE((*engine)->Submit(r, c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  ASSERT_EQ(c.final_event.finish, FinishReason::kLength);
  const std::string text = reg.RenderPrometheus();
  EXPECT_EQ(Sample(text, "hmoe_forward_pass_seconds_count{kind=\"prefill\"}"), 3);
  EXPECT_EQ(Sample(text, "hmoe_forward_pass_seconds_count{kind=\"decode\"}"), 5);
  EXPECT_EQ(Sample(text, "hmoe_forward_pass_seconds_count{kind=\"mixed\"}"), 0);
  EXPECT_EQ(Sample(text, "hmoe_prompt_tokens_total"), 5);
  EXPECT_EQ(Sample(text, "hmoe_generation_tokens_total"), 6);
  EXPECT_EQ(Sample(text, "hmoe_inter_token_latency_seconds_count"), 5);
  EXPECT_EQ(Sample(text, "hmoe_requests_finished_total{outcome=\"length\"}"), 1);
}

// A full queue counts as rejected; a failed pass as error; a shutdown's
// cut as cancelled. Gauges return to 0.
TEST_P(EngineMetricsTest, RejectedErrorAndShutOut) {
  MetricsRegistry reg;
  {
    DownModel down(model_);
    EngineOptions o;
    o.metrics = &reg;
    auto engine = Engine::Create(&down, nullptr, o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Collector c;
    ASSERT_TRUE((*engine)->Submit(Short(0, 4), c.Callback()).ok());
    ASSERT_TRUE(c.Wait());
    EXPECT_EQ(c.final_event.finish, FinishReason::kError);
  }
  const std::string failed = reg.RenderPrometheus();
  EXPECT_EQ(Sample(failed, "hmoe_requests_finished_total{outcome=\"error\"}"), 1);
  EXPECT_EQ(Sample(failed, "hmoe_prompt_tokens_total"), 0);  // its prefill failed
  EXPECT_EQ(Sample(failed, "hmoe_time_to_first_token_seconds_count"), 0);
  EXPECT_EQ(Sample(failed, "hmoe_forward_pass_seconds_count{kind=\"prefill\"}"), 1);

  // The same registry again (a re-created engine shares the series).
  EngineOptions o;
  o.metrics = &reg;
  o.max_batch = 1;
  o.max_queue = 2;
  auto engine = Engine::Create(model_, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Collector> cs(8);
  int accepted = 0, rejected = 0;
  for (auto& c : cs) {
    auto s = (*engine)->Submit(Short(1, 200), c.Callback());
    if (s.ok())
      ++accepted;
    else if (absl::IsResourceExhausted(s.status()))
      ++rejected;
  }
  ASSERT_GE(rejected, 1);
  (*engine)->Shutdown(absl::ZeroDuration());
  int cancelled = 0;
  for (auto& c : cs)
    if (c.done && c.final_event.finish == FinishReason::kCancelled) ++cancelled;
  ASSERT_GE(cancelled, 1);
  const std::string text = reg.RenderPrometheus();
  EXPECT_EQ(Sample(text, "hmoe_requests_finished_total{outcome=\"rejected\"}"), rejected);
  EXPECT_EQ(Sample(text, "hmoe_requests_finished_total{outcome=\"cancelled\"}"), cancelled);
  EXPECT_EQ(Sample(text, "hmoe_request_duration_seconds_count"), 1 + accepted);
  EXPECT_EQ(Sample(text, "hmoe_requests_running"), 0);
  EXPECT_EQ(Sample(text, "hmoe_requests_waiting"), 0);
  EXPECT_EQ(Sample(text, "hmoe_kv_blocks_used"), 0);

  // promtool accepts the engine's metrics as rendered.
  if (access("/usr/bin/promtool", X_OK) != 0) return;
  testing::TempDir dir;
  {
    std::ofstream f(dir.file("m.txt"));
    f << text;
  }
  const int rc = std::system(
      absl::StrCat("/usr/bin/promtool check metrics < '", dir.file("m.txt"), "'").c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << text;
}

// Without a registry nothing is registered anywhere and the engine runs as before.
TEST_P(EngineMetricsTest, NoRegistryNoMetrics) {
  auto engine = Engine::Create(model_, nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  Collector c;
  ASSERT_TRUE((*engine)->Submit(Short(2, 3), c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.final_event.completion_tokens, 3);
  EXPECT_GT(c.final_event.time_to_first_token_ms, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineMetricsTest, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

}  // namespace
}  // namespace hmoe
