// Model API contracts: bad input, full context, broken checkpoints, expert
// failures, external experts, fp8 block-scaled checkpoints.
#include <filesystem>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/model_test_util.h"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::RelErr;
namespace fs = std::filesystem;

std::string Fixture(const std::string& name) { return testing::FixturesDir() + "/" + name; }

std::unique_ptr<Model> LoadOrDie(const std::string& dir, ModelOptions opt = {},
                                 RoutedExperts* experts = nullptr) {
  opt.num_threads = opt.num_threads ? opt.num_threads : 2;
  auto m = Model::Load(dir, opt, experts);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

const std::vector<int32_t> kPrompt{0, 5, 17, 42, 7, 99, 3};

TEST(ModelErrors, BadTokenIds) {
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

TEST(ModelErrors, ContextFull) {
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

TEST(ModelErrors, ForeignSequenceAndBadOptions) {
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

// Forwards to another RoutedExperts, or fails with UNAVAILABLE.
class FlakyExperts : public RoutedExperts {
 public:
  explicit FlakyExperts(RoutedExperts* inner) : inner_(inner) {}
  absl::Status Forward(const ExpertBatch& b, float* out) override {
    ++calls;
    if (fail) return absl::UnavailableError("expert service down");
    return inner_->Forward(b, out);
  }
  bool fail = false;
  int calls = 0;

 private:
  RoutedExperts* inner_;
};

TEST(ModelErrors, ExpertFailureLeavesSequenceIntactAndExternalExpertsMatch) {
  const std::string dir = Fixture("deepseek_v2_tiny");
  auto base = LoadOrDie(dir);
  ASSERT_TRUE(base);
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok());
  auto ref = MakeReferenceRoutedExperts(base->config(), **ckpt, 1);
  ASSERT_TRUE(ref.ok()) << ref.status();
  FlakyExperts flaky(ref->get());
  auto m = LoadOrDie(dir, {}, &flaky);
  ASSERT_TRUE(m);

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
  EXPECT_EQ((*ref)->Forward(b, out.data()).code(), absl::StatusCode::kInvalidArgument);
  b.layer = 1;
  const int32_t id = 99;
  const float w = 1.0f;
  std::vector<float> h(static_cast<size_t>(b.hidden_size));
  out.resize(h.size());
  b.num_tokens = 1;
  b.hidden = h.data();
  b.expert_ids = &id;
  b.weights = &w;
  auto ticket = (*ref)->Submit(b, out.data());
  ASSERT_TRUE(ticket.ok());
  EXPECT_THAT(std::string((*ref)->Wait(*ticket).message()), HasSubstr("expert id 99"));
  EXPECT_EQ((*ref)->Wait(*ticket).code(), absl::StatusCode::kInvalidArgument);  // already waited
}

// An fp8 checkpoint (block-scaled e4m3 + F32 scale_inv, 16x16 blocks) gives
// exactly the logits of the same weights stored dequantized as F32.
TEST(ModelFp8, BlockScaledWeightsDequantizeExactly) {
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
  auto c = Model::Load(bare.path());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("_proj.weight"));
}

}  // namespace
}  // namespace hmoe
