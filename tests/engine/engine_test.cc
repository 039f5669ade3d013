#include "gpu_worker/engine/engine.h"

#include <condition_variable>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "common/safetensors.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

// Collects one request's events; Wait() returns once the final one arrived.
struct Collector {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> ids;
  std::string text;
  GenerateEvent final_event;
  bool done = false;
  int events = 0;

  Engine::Callback Callback() {
    return [this](const GenerateEvent& ev) {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      text += ev.text;
      ++events;
      if (ev.finish != FinishReason::kNone) {
        final_event = ev;
        done = true;
        cv.notify_all();
      }
    };
  }
  bool Wait(absl::Duration d = absl::Seconds(60)) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, absl::ToChronoMilliseconds(d), [&] { return done; });
  }
};

// Runs once per model backend (testing::TestBackends()).
class EngineTest : public ::testing::TestWithParam<std::string> {
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
  static void SetUpTestSuite() {
    const std::string dir = testing::FixturesDir() + "/deepseek_v3_tiny";
    auto ref = SafetensorsFile::Open(dir + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (float v : (*ref)->Get("prompt_ids")->ToF32()) prompt_->push_back(static_cast<int32_t>(v));
    for (float v : (*ref)->Get("greedy_ids")->ToF32()) greedy_->push_back(static_cast<int32_t>(v));
    auto t = Tokenizer::FromFile(testing::FixturesDir() + "/tokenizer.json");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }
  std::unique_ptr<Engine> Make(EngineOptions o = {}, bool with_tokenizer = false) {
    auto e = Engine::Create(model_, with_tokenizer ? tokenizer_ : nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  }
  GenerateRequest Greedy(int max_tokens) {
    GenerateRequest r;
    r.prompt = *prompt_;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    return r;
  }
  static Model* model_;
  static Tokenizer* tokenizer_;
  static inline std::vector<int32_t>* prompt_ = new std::vector<int32_t>;
  static inline std::vector<int32_t>* greedy_ = new std::vector<int32_t>;
};
Model* EngineTest::model_ = nullptr;
Tokenizer* EngineTest::tokenizer_ = nullptr;

TEST_P(EngineTest, GreedyMatchesTransformers) {
  auto engine = Make();
  Collector c;
  GenerateRequest r = Greedy(static_cast<int>(greedy_->size()));
  ASSERT_TRUE(engine->Submit(r, c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.ids, *greedy_);
  EXPECT_EQ(c.final_event.finish, FinishReason::kLength);
  EXPECT_EQ(c.final_event.completion_tokens, static_cast<int64_t>(greedy_->size()));
  EXPECT_EQ(c.final_event.prompt_tokens, static_cast<int64_t>(prompt_->size()));
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
}

TEST_P(EngineTest, ChunkedPrefillGivesTheSameTokens) {
  EngineOptions o;
  o.prefill_chunk = 3;  // prompt split across several steps
  auto engine = Make(o);
  Collector c;
  ASSERT_TRUE(engine->Submit(Greedy(8), c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.ids, std::vector<int32_t>(greedy_->begin(), greedy_->begin() + 8));
}

// 16 concurrent requests with different prompts get what each gets alone.
TEST_P(EngineTest, ConcurrentRequestsEqualSolo) {
  const int n = 16;
  std::vector<GenerateRequest> reqs(n);
  for (int i = 0; i < n; ++i) {
    reqs[i].prompt = {static_cast<int32_t>(3 + i), static_cast<int32_t>(100 + 7 * i),
                      static_cast<int32_t>(40 + i)};
    reqs[i].max_tokens = 6 + i % 3;
    reqs[i].ignore_eos = true;
    if (i % 2) {
      reqs[i].sampling.temperature = 0.8f;
      reqs[i].sampling.has_seed = true;
      reqs[i].sampling.seed = 1000 + static_cast<uint64_t>(i);
    }
  }
  std::vector<std::vector<int32_t>> solo(n);
  {
    auto engine = Make();
    for (int i = 0; i < n; ++i) {
      Collector c;
      ASSERT_TRUE(engine->Submit(reqs[i], c.Callback()).ok());
      ASSERT_TRUE(c.Wait());
      solo[i] = c.ids;
    }
  }
  auto engine = Make();
  std::vector<Collector> cs(n);
  for (int i = 0; i < n; ++i) ASSERT_TRUE(engine->Submit(reqs[i], cs[i].Callback()).ok());
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(cs[i].Wait());
    EXPECT_EQ(cs[i].ids, solo[i]) << i;
    EXPECT_EQ(static_cast<int>(cs[i].ids.size()), reqs[i].max_tokens);
  }
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
  EXPECT_EQ(engine->stats().completed, n);
}

TEST_P(EngineTest, BadRequestsAreRefusedByField) {
  auto engine = Make();
  auto expect = [&](GenerateRequest r, const char* needle) {
    auto s = engine->Submit(std::move(r), nullptr).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
  };
  GenerateRequest r = Greedy(4);
  r.prompt.clear();
  expect(r, "prompt is empty");
  r = Greedy(4);
  r.prompt[1] = 512;  // vocab 512
  expect(r, "token id 512");
  r = Greedy(0);
  expect(r, "max_tokens");
  r = Greedy(4);
  r.prompt.assign(256, 5);  // context 256
  expect(r, "context");
  r = Greedy(4);
  r.sampling.temperature = -1;
  expect(r, "temperature");
  r = Greedy(4);
  r.sampling.top_p = 0;
  expect(r, "top_p");
  r = Greedy(4);
  r.sampling.top_k = -3;
  expect(r, "top_k");
  r = Greedy(4);
  r.stop_strings = {"x"};
  expect(r, "tokenizer");  // no tokenizer on this engine
  // Stop conditions are bounded (each is checked after every token) and
  // named as the API's fields.
  r = Greedy(4);
  r.stop_strings.assign(kMaxStopStrings + 1, "x");
  expect(r, "stop: 65 strings; at most 64");
  r = Greedy(4);
  r.stop_strings = {"a", std::string(kMaxStopStringBytes + 1, 'x')};
  expect(r, "stop[1]: 1025 bytes; at most 1024");
  r = Greedy(4);
  r.stop_strings = {"a", ""};
  expect(r, "stop[1] is empty");
  r = Greedy(4);
  r.stop_strings = {"caf\xe9"};
  expect(r, "stop[0] is not valid UTF-8");
  r = Greedy(4);
  r.stop_token_ids.assign(kMaxStopTokenIds + 1, 3);
  expect(r, "stop_token_ids: 1025 ids; at most 1024");
  // Still serving.
  Collector c;
  ASSERT_TRUE(engine->Submit(Greedy(2), c.Callback()).ok());
  EXPECT_TRUE(c.Wait());
}

TEST_P(EngineTest, CancelAndDeadlineFreeBlocks) {
  EngineOptions o;
  o.max_batch = 1;  // the second request waits in the queue
  auto engine = Make(o);
  Collector running, queued, expired;
  auto id = engine->Submit(Greedy(200), running.Callback());
  ASSERT_TRUE(id.ok());
  auto id2 = engine->Submit(Greedy(5), queued.Callback());
  ASSERT_TRUE(id2.ok());
  GenerateRequest late = Greedy(5);
  late.deadline = absl::Now() + absl::Milliseconds(1);
  ASSERT_TRUE(engine->Submit(late, expired.Callback()).ok());
  for (int i = 0; i < 30000 && engine->stats().tokens_generated < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GE(engine->stats().tokens_generated, 3);
  EXPECT_GT(engine->stats().kv_blocks_used, 0);
  engine->Cancel(*id);
  ASSERT_TRUE(running.Wait());
  EXPECT_EQ(running.final_event.finish, FinishReason::kCancelled);
  EXPECT_EQ(running.final_event.status.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(expired.Wait());
  EXPECT_EQ(expired.final_event.finish, FinishReason::kDeadline);
  EXPECT_EQ(expired.final_event.status.code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(queued.Wait());
  EXPECT_EQ(queued.final_event.finish, FinishReason::kLength);
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
  EXPECT_EQ(engine->stats().running, 0);
}

TEST_P(EngineTest, QueueLimitAndShutdown) {
  EngineOptions o;
  o.max_batch = 1;
  o.max_queue = 2;
  auto engine = Make(o);
  std::vector<Collector> cs(8);
  int accepted = 0, exhausted = 0;
  for (auto& c : cs) {
    auto s = engine->Submit(Greedy(200), c.Callback());
    if (s.ok())
      ++accepted;
    else if (s.status().code() == absl::StatusCode::kResourceExhausted)
      ++exhausted;
  }
  EXPECT_GE(exhausted, 1);
  EXPECT_GE(accepted, 2);
  engine->Shutdown(absl::ZeroDuration());  // ends what's left
  int ended = 0, shut_out = 0;
  for (auto& c : cs) {
    if (!c.done) continue;
    ++ended;
    // Cut by the shutdown: UNAVAILABLE (api.proto: retry elsewhere), never
    // the client's CANCELLED.
    if (c.final_event.status.ok()) continue;
    EXPECT_EQ(c.final_event.status.code(), absl::StatusCode::kUnavailable) << c.final_event.status;
    ++shut_out;
  }
  EXPECT_EQ(ended, accepted);  // every accepted request got its final event
  EXPECT_GE(shut_out, 1);      // 200 tokens each, one at a time: not all finished
  EXPECT_EQ(engine->Submit(Greedy(1), nullptr).status().code(), absl::StatusCode::kUnavailable);
  // A queue of 0 would refuse every request.
  o.max_queue = 0;
  EXPECT_EQ(Engine::Create(model_, nullptr, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(EngineTest, StopStringsTruncateText) {
  auto engine = Make({}, /*with_tokenizer=*/true);
  Collector full;
  ASSERT_TRUE(engine->Submit(Greedy(16), full.Callback()).ok());
  ASSERT_TRUE(full.Wait());
  auto whole = tokenizer_->Decode(full.ids, true);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(full.text, *whole);  // streamed deltas add up to the decoded text
  ASSERT_GE(whole->size(), 6u);
  // Stop at a substring in the middle of the text.
  const std::string stop = whole->substr(whole->size() / 2, 2);
  const size_t cut = whole->find(stop);
  GenerateRequest r = Greedy(16);
  r.stop_strings = {stop};
  Collector c;
  ASSERT_TRUE(engine->Submit(r, c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.final_event.finish, FinishReason::kStopString);
  EXPECT_EQ(c.text, whole->substr(0, cut));
  // A stop token ends generation with reason "stop".
  r = Greedy(16);
  r.stop_token_ids = {(*greedy_)[3]};
  Collector d;
  ASSERT_TRUE(engine->Submit(r, d.Callback()).ok());
  ASSERT_TRUE(d.Wait());
  EXPECT_EQ(d.final_event.finish, FinishReason::kStopToken);
  EXPECT_EQ(d.ids.back(), (*greedy_)[3]);
}

// The fixture model behind a wrapper that records each pass's steps, can
// hold the first pass until Release() (so requests submitted meanwhile are
// admitted together), and fails a pass holding a step that starts with
// `poison` (a prompt chunk) with `poison_status`.
class InstrumentedModel final : public Model {
 public:
  explicit InstrumentedModel(const Model* inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_->config(); }
  const ModelOptions& options() const override { return inner_->options(); }
  std::unique_ptr<Sequence> NewSequence() const override { return inner_->NewSequence(); }
  absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      passes_.push_back(static_cast<int>(steps.size()));
      cv_.notify_all();
      cv_.wait(lock, [&] { return !hold_ && passes_.size() != hold_pass_; });
    }
    for (const ForwardStep& st : steps)
      if (!poison.empty() && st.tokens.size() >= poison.size() &&
          std::equal(poison.begin(), poison.end(), st.tokens.begin()))
        return steps.size() == 1 && !poison_alone_status.ok() ? poison_alone_status : poison_status;
    RETURN_IF_ERROR(inner_->ForwardBatch(steps));
    for (const ForwardStep& st : steps)
      if (!nan_for.empty() && st.tokens.size() >= nan_for.size() &&
          std::equal(nan_for.begin(), nan_for.end(), st.tokens.begin()) && st.logits != nullptr &&
          st.logits->size() > 5)
        (*st.logits)[5] = std::numeric_limits<float>::quiet_NaN();
    return absl::OkStatus();
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  bool WaitForPasses(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return passes_.size() >= n; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = false;
    cv_.notify_all();
  }
  // Holds pass number `n` (1-based) alone until ReleasePass().
  void HoldPass(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_pass_ = n;
  }
  void ReleasePass() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_pass_ = 0;
    cv_.notify_all();
  }
  std::vector<int> passes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return passes_;
  }
  std::vector<int32_t> poison;  // set before the engine runs
  absl::Status poison_status;
  absl::Status poison_alone_status;  // when set: the poisoned step run alone
  std::vector<int32_t> nan_for;      // a step starting so gets a NaN logit (token 5)

 private:
  const Model* inner_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::vector<int> passes_;  // steps per ForwardBatch call
  bool hold_ = false;
  size_t hold_pass_ = 0;  // 0: none
};

GenerateRequest Short(int i, int max_tokens) {
  GenerateRequest r;
  r.prompt = {static_cast<int32_t>(3 + i), static_cast<int32_t>(100 + 7 * i),
              static_cast<int32_t>(40 + i)};
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// The fixture model with another context length.
class ContextModel final : public Model {
 public:
  ContextModel(const Model* inner, int64_t max_seq_len)
      : inner_(inner), options_(inner->options()) {
    options_.max_seq_len = max_seq_len;
  }
  const ModelConfig& config() const override { return inner_->config(); }
  const ModelOptions& options() const override { return options_; }
  std::unique_ptr<Sequence> NewSequence() const override { return inner_->NewSequence(); }
  absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const override {
    return inner_->ForwardBatch(steps);
  }

 private:
  const Model* inner_;
  ModelOptions options_;
};

// A running request cancelled between passes gives its batch slot and KV
// blocks to a waiting one in the very next pass (before: one pass later).
TEST_P(EngineTest, ACancelledRequestsSlotIsTakenByTheNextPass) {
  InstrumentedModel model(model_);
  EngineOptions o;
  o.max_batch = 2;
  auto engine = Engine::Create(&model, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Collector a, c, b;
  model.Hold();
  ASSERT_TRUE((*engine)->Submit(Short(0, 20), a.Callback()).ok());
  ASSERT_TRUE(model.WaitForPasses(1));  // A's prefill, held
  auto c_id = (*engine)->Submit(Short(1, 20), c.Callback());
  ASSERT_TRUE(c_id.ok());
  ASSERT_TRUE((*engine)->Submit(Short(2, 3), b.Callback()).ok());
  model.HoldPass(2);
  model.Release();
  ASSERT_TRUE(model.WaitForPasses(2));  // A's decode and C's prefill; B waits
  (*engine)->Cancel(*c_id);
  model.ReleasePass();
  for (Collector* x : {&a, &b, &c}) ASSERT_TRUE(x->Wait());
  EXPECT_EQ(c.final_event.finish, FinishReason::kCancelled);
  const std::vector<int> passes = model.passes();
  ASSERT_GE(passes.size(), 3u);
  EXPECT_EQ(passes[1], 2);
  EXPECT_EQ(passes[2], 2) << "pass 3 should hold A's decode and B's prefill";
  EXPECT_EQ((*engine)->stats().kv_blocks_used, 0);
}

// The default KV budget reserves whole blocks per request: max_batch
// requests of the full context fit together when the context is not a
// multiple of the block (100 tokens: 7 blocks each, 14 for two; before: 13).
TEST_P(EngineTest, TheDefaultKvBudgetFitsMaxBatchFullContexts) {
  ContextModel ctx(model_, 100);
  InstrumentedModel model(&ctx);
  EngineOptions o;
  o.max_batch = 2;
  auto engine = Engine::Create(&model, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Collector> cs(2);
  model.Hold();
  ASSERT_TRUE((*engine)->Submit(Short(0, 97), cs[0].Callback()).ok());
  ASSERT_TRUE(model.WaitForPasses(1));
  ASSERT_TRUE((*engine)->Submit(Short(1, 97), cs[1].Callback()).ok());
  model.HoldPass(2);
  model.Release();
  ASSERT_TRUE(model.WaitForPasses(2));
  EXPECT_EQ((*engine)->stats().running, 2);
  EXPECT_EQ((*engine)->stats().kv_blocks_used, 14);
  model.ReleasePass();
  for (auto& c : cs) {
    ASSERT_TRUE(c.Wait());
    EXPECT_EQ(c.final_event.finish, FinishReason::kLength);
    EXPECT_EQ(c.ids.size(), 97u);
  }
}

// A KV cache smaller than one context (--kv-blocks) is every request's
// context: max_tokens stops there (finish "length", as at the model's
// context) instead of refusing the request, and max_context() says so.
TEST_P(EngineTest, AKvCacheSmallerThanTheContextBoundsEachRequest) {
  EngineOptions o;
  o.kv_blocks = 4;  // 64 tokens; the model holds 256
  auto engine = Make(o);
  EXPECT_EQ(engine->max_context(), 64);
  GenerateRequest r;
  for (int i = 0; i < 10; ++i) r.prompt.push_back(5 + i);
  r.max_tokens = 100;
  r.ignore_eos = true;
  Collector c;
  ASSERT_TRUE(engine->Submit(r, c.Callback()).ok());
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.final_event.finish, FinishReason::kLength);
  EXPECT_EQ(c.ids.size(), 54u);
  r.prompt.assign(64, 7);
  Collector never;
  auto refused = engine->Submit(r, never.Callback());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("the context holds 64 (the KV cache's size)"));
  EXPECT_EQ(Make()->max_context(), 256);
}

// The default KV budget (max_batch x context) is computed without overflow:
// an absurd context is INVALID_ARGUMENT saying why, not a wrapped count.
TEST_P(EngineTest, AnAbsurdContextIsRefusedNotOverflowed) {
  for (int64_t ctx : {std::numeric_limits<int64_t>::max() / 4, int64_t{1} << 42}) {
    ContextModel model(model_, ctx);
    auto e = Engine::Create(&model, nullptr, {});
    ASSERT_FALSE(e.ok()) << ctx;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_THAT(std::string(e.status().message()), HasSubstr("more KV cache than any machine"));
  }
  ContextModel zero(model_, 0);
  EXPECT_EQ(Engine::Create(&zero, nullptr, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// The gRPC layer cancels a call once its deadline passes, so a cancel that
// comes after the deadline must still end the request kDeadline (before: the
// cancel was looked at first and the reason depended on timing).
TEST_P(EngineTest, ACancelAfterTheDeadlineEndsItAsTheDeadline) {
  InstrumentedModel model(model_);
  auto engine = Engine::Create(&model, nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  Collector c;
  GenerateRequest r = Short(0, 8);
  r.deadline = absl::Now() + absl::Milliseconds(100);
  model.Hold();
  auto id = (*engine)->Submit(r, c.Callback());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(model.WaitForPasses(1));
  absl::SleepFor(absl::Milliseconds(150));
  (*engine)->Cancel(*id);
  model.Release();
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.final_event.finish, FinishReason::kDeadline);
  EXPECT_EQ(c.final_event.status.code(), absl::StatusCode::kDeadlineExceeded);
}

// A pass that gives one request a NaN logit ends that request with INTERNAL
// (kError) naming the token; the request beside it gets what it gets alone.
TEST_P(EngineTest, NonFiniteLogitsEndOnlyThatRequest) {
  std::vector<int32_t> solo;
  {
    auto engine = Make();
    Collector c;
    ASSERT_TRUE(engine->Submit(Short(1, 4), c.Callback()).ok());
    ASSERT_TRUE(c.Wait());
    solo = c.ids;
  }
  InstrumentedModel model(model_);
  model.nan_for = Short(0, 4).prompt;
  auto engine = Engine::Create(&model, nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  Collector bad, good;
  model.Hold();
  ASSERT_TRUE((*engine)->Submit(Short(0, 4), bad.Callback()).ok());
  ASSERT_TRUE((*engine)->Submit(Short(1, 4), good.Callback()).ok());
  model.Release();
  ASSERT_TRUE(bad.Wait());
  ASSERT_TRUE(good.Wait());
  EXPECT_EQ(bad.final_event.finish, FinishReason::kError);
  EXPECT_EQ(bad.final_event.status.code(), absl::StatusCode::kInternal) << bad.final_event.status;
  EXPECT_THAT(std::string(bad.final_event.status.message()), HasSubstr("token 5"));
  EXPECT_TRUE(bad.ids.empty());
  EXPECT_EQ(good.final_event.finish, FinishReason::kLength);
  EXPECT_EQ(good.ids, solo);
  EXPECT_EQ((*engine)->stats().kv_blocks_used, 0);
}

// Every running request decodes in the same forward pass as the others and
// the prompt chunks: 8 requests of 6 tokens take 7 passes, not 48, and get
// what each gets alone.
TEST_P(EngineTest, AllRunningRequestsShareOneForwardPassPerStep) {
  const int n = 8, max_tokens = 6;
  std::vector<std::vector<int32_t>> solo(n);
  {
    auto engine = Make();
    for (int i = 0; i < n; ++i) {
      Collector c;
      ASSERT_TRUE(engine->Submit(Short(i, max_tokens), c.Callback()).ok());
      ASSERT_TRUE(c.Wait());
      solo[i] = c.ids;
    }
  }
  InstrumentedModel model(model_);
  auto engine = Engine::Create(&model, nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Collector> cs(n);
  model.Hold();
  ASSERT_TRUE((*engine)->Submit(Short(0, max_tokens), cs[0].Callback()).ok());
  ASSERT_TRUE(model.WaitForPasses(1));  // the first prefill, held
  for (int i = 1; i < n; ++i)
    ASSERT_TRUE((*engine)->Submit(Short(i, max_tokens), cs[i].Callback()).ok());
  model.Release();
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(cs[i].Wait());
    EXPECT_EQ(cs[i].ids, solo[i]) << i;
  }
  const std::vector<int> passes = model.passes();
  int steps = 0, widest = 0;
  for (int p : passes) {
    steps += p;
    widest = std::max(widest, p);
  }
  // One prefill step and max_tokens - 1 decode steps per request; the first
  // request's prefill alone (held), then the other 7 prompts (21 tokens, one
  // prefill_chunk) with its first decode, then decodes together.
  EXPECT_EQ(steps, n * max_tokens);
  EXPECT_EQ(static_cast<int>(passes.size()), 1 + max_tokens);
  EXPECT_EQ(widest, n);
}

// A pass fails for one request's reason, but re-run alone that step fails
// for everyone's (the expert service went away meanwhile): the steps not yet
// re-run fail with it instead of each waiting out its own failure.
TEST_P(EngineTest, ARerunThatFailsForEveryoneEndsTheRerun) {
  InstrumentedModel model(model_);
  model.poison = Short(1, 5).prompt;
  model.poison_status = absl::InvalidArgumentError("poisoned prompt");
  model.poison_alone_status = absl::UnavailableError("expert service down");
  EngineOptions o;
  o.prefill_chunk = 3;
  auto engine = Engine::Create(&model, nullptr, o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<Collector> cs(2);
  model.Hold();
  ASSERT_TRUE((*engine)->Submit(Short(0, 5), cs[0].Callback()).ok());
  ASSERT_TRUE(model.WaitForPasses(1));
  ASSERT_TRUE((*engine)->Submit(Short(1, 5), cs[1].Callback()).ok());
  model.Release();
  for (auto& c : cs) ASSERT_TRUE(c.Wait());
  // Pass 2 = request 1's prompt + request 0's decode; re-run: request 1
  // alone fails UNAVAILABLE, request 0 is not re-run.
  EXPECT_EQ(model.passes(), (std::vector<int>{1, 2, 1}));
  for (auto& c : cs) {
    EXPECT_EQ(c.final_event.finish, FinishReason::kError);
    EXPECT_EQ(c.final_event.status, model.poison_alone_status);
  }
  EXPECT_EQ((*engine)->stats().kv_blocks_used, 0);
}

// Cancelled while its next token is sampled and sent but not yet in the
// cache: the request ends at the next step with that token, its blocks free,
// and the token is never run.
TEST_P(EngineTest, CancelWithATokenPendingEndsAtTheNextStep) {
  InstrumentedModel model(model_);
  auto engine = Engine::Create(&model, nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  Collector c;
  model.Hold();
  auto id = (*engine)->Submit(Short(0, 10), c.Callback());
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(model.WaitForPasses(1));  // its prefill, held
  (*engine)->Cancel(*id);
  model.Release();
  ASSERT_TRUE(c.Wait());
  EXPECT_EQ(c.final_event.finish, FinishReason::kCancelled);
  EXPECT_EQ(c.ids.size(), 1u);
  EXPECT_EQ(c.final_event.completion_tokens, 1);
  EXPECT_EQ(model.passes(), std::vector<int>{1});
  EXPECT_EQ((*engine)->stats().kv_blocks_used, 0);
  EXPECT_EQ((*engine)->stats().running, 0);
}

// A pass that fails for one request's reason (INVALID_ARGUMENT) fails only
// that request; one that fails for everyone's (UNAVAILABLE) fails every
// request in it and no other.
TEST_P(EngineTest, AFailedPassFailsOnlyTheRequestsItConcerns) {
  std::vector<std::vector<int32_t>> solo(3);
  {
    auto engine = Make();
    for (int i : {0, 2}) {
      Collector c;
      ASSERT_TRUE(engine->Submit(Short(i, 5), c.Callback()).ok());
      ASSERT_TRUE(c.Wait());
      solo[i] = c.ids;
    }
  }
  for (const absl::Status& st :
       {absl::InvalidArgumentError("poisoned prompt"),
        absl::InternalError("the worker's expert call was refused: expert_weights[3]: nan"),
        absl::UnavailableError("expert service down")}) {
    SCOPED_TRACE(st.ToString());
    InstrumentedModel model(model_);
    model.poison = Short(1, 5).prompt;
    model.poison_status = st;
    EngineOptions o;
    o.prefill_chunk = 3;  // one 3-token prompt per pass: request 2 comes a pass later
    auto engine = Engine::Create(&model, nullptr, o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<Collector> cs(3);
    model.Hold();
    ASSERT_TRUE((*engine)->Submit(Short(0, 5), cs[0].Callback()).ok());
    ASSERT_TRUE(model.WaitForPasses(1));
    for (int i : {1, 2}) ASSERT_TRUE((*engine)->Submit(Short(i, 5), cs[i].Callback()).ok());
    model.Release();
    for (auto& c : cs) ASSERT_TRUE(c.Wait());
    // Request 1's prefill shares its pass with request 0's first decode.
    EXPECT_EQ(cs[1].final_event.finish, FinishReason::kError);
    EXPECT_EQ(cs[1].final_event.status, st);
    if (!absl::IsUnavailable(st)) {  // one request's: the others unharmed
      EXPECT_EQ(cs[0].final_event.finish, FinishReason::kLength);
      EXPECT_EQ(cs[0].ids, solo[0]);
    } else {
      EXPECT_EQ(cs[0].final_event.finish, FinishReason::kError);
      EXPECT_EQ(cs[0].final_event.status, st);
      EXPECT_EQ(cs[0].ids.size(), 1u);  // sampled after its prefill, before the failed pass
    }
    EXPECT_EQ(cs[2].final_event.finish, FinishReason::kLength);
    EXPECT_EQ(cs[2].ids, solo[2]);
    EXPECT_EQ((*engine)->stats().kv_blocks_used, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

}  // namespace
}  // namespace hmoe
