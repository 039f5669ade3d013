// Model API contracts: bad input, full context, broken checkpoints, expert
// failures, external experts, fp8 block-scaled checkpoints.
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::RelErr;
namespace fs = std::filesystem;

std::string Fixture(const std::string& name) { return testing::FixturesDir() + "/" + name; }

// The backend LoadOrDie builds (BackendModelErrors sets it per test).
std::string& CurrentBackend() {
  static std::string* b = new std::string("cpu");
  return *b;
}

std::unique_ptr<Model> LoadOrDie(const std::string& dir, ModelOptions opt = {},
                                 RoutedExperts* experts = nullptr) {
  opt.num_threads = opt.num_threads ? opt.num_threads : 2;
  opt.backend = CurrentBackend();
  auto m = Model::Load(dir, opt, experts);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

const std::vector<int32_t> kPrompt{0, 5, 17, 42, 7, 99, 3};

// The error paths every backend shares, once per backend.
class BackendModelErrors : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    HMOE_SKIP_UNLESS_BACKEND(GetParam());
    CurrentBackend() = GetParam();
  }
  void TearDown() override { CurrentBackend() = "cpu"; }
};
INSTANTIATE_TEST_SUITE_P(Backends, BackendModelErrors, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

TEST_P(BackendModelErrors, BadTokenIds) {
  auto m = LoadOrDie(Fixture("mixtral_tiny"));
  ASSERT_TRUE(m);
  const int64_t V = m->config().vocab_size;
  auto seq = m->NewSequence();
  auto r = m->Prefill(*seq, {1, 2, static_cast<int32_t>(V)});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(absl::StrCat("token id ", V)));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(absl::StrCat("[0, ", V, ")")));
  EXPECT_EQ(m->Decode(*seq, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Prefill(*seq, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(seq->length(), 0);  // failed calls leave the sequence alone
  EXPECT_TRUE(m->Prefill(*seq, kPrompt).ok());
}

TEST_P(BackendModelErrors, ContextFull) {
  ModelOptions opt;
  opt.max_seq_len = 8;
  auto m = LoadOrDie(Fixture("deepseek_v3_tiny"), opt);
  ASSERT_TRUE(m);
  auto seq = m->NewSequence();
  EXPECT_EQ(seq->capacity(), 8);
  ASSERT_TRUE(m->Prefill(*seq, kPrompt).ok());
  auto r = m->Prefill(*seq, {1, 2});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("capacity of 8"));
  EXPECT_EQ(seq->length(), 7);
  EXPECT_TRUE(m->Decode(*seq, 1).ok());
  EXPECT_EQ(m->Decode(*seq, 1).status().code(), absl::StatusCode::kResourceExhausted);
  seq->Reset();
  EXPECT_TRUE(m->Decode(*seq, 1).ok());
}

TEST_P(BackendModelErrors, ForeignSequenceAndBadOptions) {
  auto a = LoadOrDie(Fixture("qwen3_moe_tiny"));
  auto b = LoadOrDie(Fixture("qwen3_moe_tiny"));
  ASSERT_TRUE(a && b);
  auto seq = a->NewSequence();
  EXPECT_EQ(b->Decode(*seq, 1).status().code(), absl::StatusCode::kInvalidArgument);
  ModelOptions bad;
  bad.num_threads = -1;
  EXPECT_EQ(Model::Load(Fixture("qwen3_moe_tiny"), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Model::Load("/nonexistent/model").status().code(), absl::StatusCode::kNotFound);
}

using testing::Keep;
using testing::RewriteCheckpoint;

TEST(ModelErrors, MissingTensorIsNamed) {
  testing::TempDir dir;
  const std::string victim = "model.layers.1.self_attn.kv_b_proj.weight";
  RewriteCheckpoint(Fixture("deepseek_v3_tiny"), dir.path(),
                    [&](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
                      return n == victim ? false : Keep(n, t, w);
                    });
  auto m = Model::Load(dir.path());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(victim));
}

TEST(ModelErrors, MisshapedTensorIsNamed) {
  // k_proj stored transposed: same bytes, wrong shape.
  testing::TempDir dir2;
  const std::string o = "model.layers.2.self_attn.k_proj.weight";
  RewriteCheckpoint(Fixture("mixtral_tiny"), dir2.path(),
                    [&](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
                      if (n != o) return Keep(n, t, w);
                      EXPECT_TRUE(w.Add(n, t.dtype(), {t.dim(1), t.dim(0)}, t.raw(),
                                        static_cast<size_t>(t.nbytes()))
                                      .ok());
                      return true;
                    });
  auto m = Model::Load(dir2.path());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(o));
}

// Forwards to another RoutedExperts, or fails with UNAVAILABLE (always, or
// from the call after `fail_after` more calls); records each call's tokens.
class FlakyExperts : public RoutedExperts {
 public:
  explicit FlakyExperts(RoutedExperts* inner) : inner_(inner) {}
  absl::Status Forward(const ExpertBatch& b, float* out) override {
    ++calls;
    tokens.push_back(b.num_tokens);
    if (fail || fail_after == 0) return absl::UnavailableError("expert service down");
    if (fail_after > 0) --fail_after;
    return inner_->Forward(b, out);
  }
  bool fail = false;
  int fail_after = -1;  // < 0: never
  int calls = 0;
  std::vector<int64_t> tokens;

 private:
  RoutedExperts* inner_;
};

// A fixture model twice: `base` with its own experts, `m` with the same
// reference experts behind `flaky`.
struct FlakyRig {
  explicit FlakyRig(const std::string& dir) {
    base = LoadOrDie(dir);
    auto c = Checkpoint::Open(dir);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!base || !c.ok()) return;
    ckpt = std::move(*c);
    auto r = MakeReferenceRoutedExperts(base->config(), *ckpt, 1);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return;
    ref = std::move(*r);
    flaky = std::make_unique<FlakyExperts>(ref.get());
    m = LoadOrDie(dir, {}, flaky.get());
  }
  bool ok() const { return m != nullptr; }
  std::unique_ptr<Model> base;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<RoutedExperts> ref;
  std::unique_ptr<FlakyExperts> flaky;
  std::unique_ptr<Model> m;
};

TEST(ModelErrors, ExpertFailureLeavesSequenceIntactAndExternalExpertsMatch) {
  FlakyRig rig(Fixture("deepseek_v2_tiny"));
  ASSERT_TRUE(rig.ok());
  auto& base = rig.base;
  auto& m = rig.m;
  auto& ref = rig.ref;
  FlakyExperts& flaky = *rig.flaky;

  auto seq = m->NewSequence();
  ASSERT_TRUE(m->Prefill(*seq, absl::MakeConstSpan(kPrompt).subspan(0, 4)).ok());
  flaky.fail = true;
  auto r = m->Prefill(*seq, absl::MakeConstSpan(kPrompt).subspan(4));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("routed experts"));
  EXPECT_EQ(seq->length(), 4);
  flaky.fail = false;
  auto rest = m->Prefill(*seq, absl::MakeConstSpan(kPrompt).subspan(4), LogitsMode::kLast);
  ASSERT_TRUE(rest.ok()) << rest.status();

  auto bseq = base->NewSequence();
  auto want = base->Prefill(*bseq, kPrompt, LogitsMode::kLast);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(*rest, *want);
  EXPECT_GT(flaky.calls, 0);

  // The async pair and batch validation of the reference.
  ExpertBatch b;
  b.layer = 0;  // dense layer
  b.hidden_size = base->config().hidden_size;
  b.top_k = 1;
  std::vector<float> out(1);
  EXPECT_EQ(ref->Forward(b, out.data()).code(), absl::StatusCode::kInvalidArgument);
  b.layer = 1;
  const int32_t id = 99;
  const float w = 1.0f;
  std::vector<float> h(static_cast<size_t>(b.hidden_size));
  out.resize(h.size());
  b.num_tokens = 1;
  b.hidden = h.data();
  b.expert_ids = &id;
  b.weights = &w;
  auto ticket = ref->Submit(b, out.data());
  ASSERT_TRUE(ticket.ok());
  EXPECT_THAT(std::string(ref->Wait(*ticket).message()), HasSubstr("expert id 99"));
  EXPECT_EQ(ref->Wait(*ticket).code(), absl::StatusCode::kInvalidArgument);  // already waited
}

// Only the asynchronous pair: Submit starts the inner Forward on a thread,
// Wait joins it (or fails, with `fail_wait`). Forward itself is an error.
class AsyncOnlyExperts : public RoutedExperts {
 public:
  explicit AsyncOnlyExperts(RoutedExperts* inner) : inner_(inner) {}
  absl::Status Forward(const ExpertBatch&, float*) override {
    return absl::InternalError("the model must use Submit / Wait");
  }
  absl::StatusOr<uint64_t> Submit(const ExpertBatch& b, float* out) override {
    const uint64_t t = next_++;
    const std::string name = absl::StrCat(b.layer, "/", b.top_k);
    log.push_back("S" + name);
    names_[t] = name;
    calls.push_back({b.layer, b.top_k,
                     std::vector<int32_t>(b.expert_ids, b.expert_ids + b.num_tokens * b.top_k),
                     std::vector<float>(b.weights, b.weights + b.num_tokens * b.top_k)});
    running_[t] =
        std::async(std::launch::async, [this, b, out] { return inner_->Forward(b, out); });
    return t;
  }
  absl::Status Wait(uint64_t t) override {
    auto it = running_.find(t);
    if (it == running_.end()) return absl::InvalidArgumentError("unknown ticket");
    absl::Status st = it->second.get();
    running_.erase(it);
    ++waits;
    log.push_back("W" + names_[t]);
    const bool fail =
        fail_wait || (fail_wait_k > 0 && names_[t].ends_with(absl::StrCat("/", fail_wait_k)));
    return fail ? absl::UnavailableError("answer lost") : st;
  }
  size_t in_flight() const { return running_.size(); }
  struct Call {
    int layer, k;
    std::vector<int32_t> ids;
    std::vector<float> weights;
  };
  bool fail_wait = false;
  int fail_wait_k = 0;  // > 0: fail the waits of calls with this top_k
  int waits = 0;
  std::vector<std::string> log;  // "S<layer>/<k>" per Submit, "W<layer>/<k>" per Wait
  std::vector<Call> calls;

 private:
  RoutedExperts* inner_;
  uint64_t next_ = 1;
  std::map<uint64_t, std::future<absl::Status>> running_;
  std::map<uint64_t, std::string> names_;
};

// The model submits each layer's routed experts and computes the shared
// experts before it waits; a failed Wait is the layer's failure.
TEST(ModelErrors, RoutedExpertsAreSubmittedAndWaitedOn) {
  FlakyRig rig(Fixture("deepseek_v3_tiny"));
  ASSERT_TRUE(rig.ok());
  AsyncOnlyExperts async(rig.ref.get());
  auto m = LoadOrDie(Fixture("deepseek_v3_tiny"), {}, &async);
  ASSERT_TRUE(m);
  auto seq = m->NewSequence();
  auto bseq = rig.base->NewSequence();
  auto got = m->Prefill(*seq, kPrompt);
  auto want = rig.base->Prefill(*bseq, kPrompt);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(*got, *want);
  EXPECT_GT(async.waits, 0);
  async.fail_wait = true;
  auto r = m->Decode(*seq, 5);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("routed experts: answer lost"));
  EXPECT_EQ(seq->length(), static_cast<int64_t>(kPrompt.size()));
}

// Expert Deferral, deferred_experts = 1 on a model with MoE layers 1 and 2
// (of 3): layer 1 sends its 3 highest-weighted experts per token and, as a
// second call, the lowest one, which is waited on only after layer 2 (the
// last layer, which never defers); a failure of that late call fails the
// step, leaves the Sequence and no call behind.
TEST(ModelErrors, ExpertDeferralJoinsTheLowestWeightedExpertsOneLayerLate) {
  const std::string dir = Fixture("deepseek_v3_tiny");
  FlakyRig rig(dir);
  ASSERT_TRUE(rig.ok());
  AsyncOnlyExperts exact(rig.ref.get()), late(rig.ref.get());
  auto m0 = LoadOrDie(dir, {}, &exact);
  ModelOptions opt;
  opt.deferred_experts = 1;
  auto m1 = LoadOrDie(dir, opt, &late);
  ASSERT_TRUE(m0 && m1);
  auto s0 = m0->NewSequence();
  auto s1 = m1->NewSequence();
  auto want = m0->Prefill(*s0, kPrompt, LogitsMode::kLast);
  auto got = m1->Prefill(*s1, kPrompt, LogitsMode::kLast);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(late.log, (std::vector<std::string>{"S1/3", "S1/1", "W1/3", "S2/4", "W2/4", "W1/1"}));
  // Layer 1 sees the same hidden states in both: the split is of the same routing.
  ASSERT_EQ(exact.calls.size(), 2u);
  ASSERT_EQ(late.calls.size(), 3u);
  const auto& full = exact.calls[0];
  const auto& now = late.calls[0];
  const auto& later = late.calls[1];
  for (size_t t = 0; t < kPrompt.size(); ++t) {
    std::vector<std::pair<int32_t, float>> a, b;
    for (size_t j = 0; j < 4; ++j) a.push_back({full.ids[t * 4 + j], full.weights[t * 4 + j]});
    for (size_t j = 0; j < 3; ++j) b.push_back({now.ids[t * 3 + j], now.weights[t * 3 + j]});
    b.push_back({later.ids[t], later.weights[t]});
    for (size_t j = 0; j < 3; ++j) EXPECT_LE(later.weights[t], now.weights[t * 3 + j]) << t;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    EXPECT_EQ(a, b) << "token " << t;
  }
  // The join changes the numbers, a little.
  EXPECT_NE(*got, *want);
  EXPECT_LT(RelErr(got->data(), want->data(), static_cast<int64_t>(want->size())), 0.5);

  late.fail_wait_k = 1;
  auto r = m1->Decode(*s1, 5);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("layer 1 deferred routed experts: answer lost"));
  EXPECT_EQ(s1->length(), static_cast<int64_t>(kPrompt.size()));
  EXPECT_EQ(late.in_flight(), 0u);

  for (int bad : {-1, 4}) {
    opt.deferred_experts = bad;
    auto m = Model::Load(dir, opt, &late);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(m.status().message()),
                HasSubstr("deferred_experts must be 0 or in [1, 3]"));
  }
}

// ForwardBatch: one expert call per MoE layer for all the steps' tokens;
// a bad step is named; a failure anywhere, also after some layers' caches
// were written, leaves every Sequence as it was.
TEST(ModelErrors, ForwardBatchIsOneExpertCallPerLayerAndAllOrNothing) {
  FlakyRig rig(Fixture("deepseek_v3_tiny"));
  ASSERT_TRUE(rig.ok());
  auto& base = rig.base;
  auto& m = rig.m;
  FlakyExperts& flaky = *rig.flaky;
  int moe_layers = 0;
  for (const auto& l : m->config().layers) moe_layers += l.moe ? 1 : 0;
  ASSERT_GE(moe_layers, 2);
  const int64_t V = m->config().vocab_size;

  auto s1 = m->NewSequence();
  auto s2 = m->NewSequence();
  ASSERT_TRUE(m->Prefill(*s1, absl::MakeConstSpan(kPrompt).subspan(0, 4)).ok());
  const std::vector<int32_t> one = {kPrompt[4]}, three = {kPrompt[0], kPrompt[1], kPrompt[2]};
  const std::vector<int32_t> bad = {kPrompt[0], static_cast<int32_t>(V)};
  std::vector<float> l1, l2;
  auto expect_refused = [&](std::vector<ForwardStep> steps, const std::string& needle) {
    absl::Status st = m->ForwardBatch(steps);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(needle));
    EXPECT_EQ(s1->length(), 4);
    EXPECT_EQ(s2->length(), 0);
  };
  expect_refused({{s1.get(), one, LogitsMode::kLast, &l1}, {s2.get(), bad, LogitsMode::kLast, &l2}},
                 absl::StrCat("step 1: token id ", V, " at index 1"));
  expect_refused({{s1.get(), one, LogitsMode::kLast, &l1}, {s1.get(), one, LogitsMode::kLast, &l2}},
                 "step 1: ForwardBatch: the Sequence of step 0 appears again");
  expect_refused({{s1.get(), one, LogitsMode::kLast, nullptr}}, "no logits output");
  expect_refused({}, "no steps");
  EXPECT_EQ(flaky.calls, 1 * moe_layers);  // only the first Prefill reached the experts

  // Fails in the second MoE layer: the first layers' caches were written.
  flaky.tokens.clear();
  flaky.fail_after = 1;
  const std::vector<ForwardStep> steps = {{s1.get(), one, LogitsMode::kLast, &l1},
                                          {s2.get(), three, LogitsMode::kAll, &l2}};
  absl::Status st = m->ForwardBatch(steps);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(s1->length(), 4);
  EXPECT_EQ(s2->length(), 0);
  flaky.fail_after = -1;
  flaky.tokens.clear();
  ASSERT_TRUE(m->ForwardBatch(steps).ok());
  EXPECT_EQ(flaky.tokens, std::vector<int64_t>(static_cast<size_t>(moe_layers), 4));
  EXPECT_EQ(s1->length(), 5);
  EXPECT_EQ(s2->length(), 3);

  auto b1 = base->NewSequence();
  auto b2 = base->NewSequence();
  auto want1 = base->Prefill(*b1, absl::MakeConstSpan(kPrompt).subspan(0, 5), LogitsMode::kLast);
  auto want2 = base->Prefill(*b2, three, LogitsMode::kAll);
  ASSERT_TRUE(want1.ok() && want2.ok());
  EXPECT_EQ(l1, *want1);
  EXPECT_EQ(l2, *want2);
}

// An fp8 checkpoint (block-scaled e4m3 + F32 scale_inv, 16x16 blocks) gives
// exactly the logits of the same weights stored dequantized as F32, on every
// backend (cuda: both dequantized at load, then rounded to bf16 alike).
TEST_P(BackendModelErrors, Fp8BlockScaledWeightsDequantizeExactly) {
  testing::TempDir fp8_dir, f32_dir;
  const int64_t B = 16;
  const std::string src = Fixture("deepseek_v3_tiny");
  RewriteCheckpoint(src, fp8_dir.path(), testing::Fp8ProjEdit(true, B), testing::Fp8Config(B));
  RewriteCheckpoint(src, f32_dir.path(), testing::Fp8ProjEdit(false, B));
  auto a = LoadOrDie(fp8_dir.path()), b = LoadOrDie(f32_dir.path()), orig = LoadOrDie(src);
  ASSERT_TRUE(a && b && orig);
  auto sa = a->NewSequence(), sb = b->NewSequence(), so = orig->NewSequence();
  auto la = a->Prefill(*sa, kPrompt), lb = b->Prefill(*sb, kPrompt),
       lo = orig->Prefill(*so, kPrompt);
  ASSERT_TRUE(la.ok() && lb.ok() && lo.ok());
  EXPECT_EQ(*la, *lb);
  const double drift = RelErr(la->data(), lo->data(), static_cast<int64_t>(lo->size()));
  EXPECT_GT(drift, 0.0);   // fp8 really changed the weights
  EXPECT_LT(drift, 0.25);  // and stayed close
  // fp8 weights without a quantization_config are refused, naming the tensor.
  testing::TempDir bare;
  fs::copy_file(fp8_dir.path() + "/model.safetensors", bare.path() + "/model.safetensors");
  fs::copy_file(src + "/config.json", bare.path() + "/config.json");
  ModelOptions bare_opt;
  bare_opt.backend = GetParam();
  auto c = Model::Load(bare.path(), bare_opt);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("_proj.weight"));
}

}  // namespace
}  // namespace hmoe
