// Dense weight formats (ModelOptions::weights): the loader both backends
// share (gpu_worker/cpu/dense_weights.h) and the model's logits under each
// format, on every backend (cuda: against the CPU reference at the same
// format).
#include "gpu_worker/cpu/dense_weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::RelErr;

std::string Fixture(const std::string& name) { return testing::FixturesDir() + "/" + name; }

const std::vector<int32_t> kPrompt{0, 5, 17, 42, 7, 99, 3, 11, 64, 2};

std::unique_ptr<Model> LoadWith(const std::string& dir, const std::string& backend,
                                DenseWeights w) {
  ModelOptions o;
  o.backend = backend;
  o.num_threads = 2;
  o.weights = w;
  auto m = Model::Load(dir, o);
  EXPECT_TRUE(m.ok()) << DenseWeightsName(w) << ": " << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// sum (a - b)^2 / sum b^2 (the CUDA backend agreement tests' measure).
double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? num / den : num;
}

// Prefill logits of kPrompt (all rows), two decode steps' (last row), then
// a 40-token prefill's (all rows: the CUDA backend's path above 32 tokens).
std::vector<float> RunSteps(const Model& m) {
  auto s = m.NewSequence();
  auto a = m.Prefill(*s, kPrompt);
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return {};
  std::vector<float> out = *a;
  for (int32_t tok : {9, 30}) {
    auto d = m.Decode(*s, tok);
    EXPECT_TRUE(d.ok()) << d.status();
    if (d.ok()) out.insert(out.end(), d->begin(), d->end());
  }
  std::vector<int32_t> more(40);
  for (size_t i = 0; i < more.size(); ++i) more[i] = static_cast<int32_t>((i * 7 + 3) % 50);
  auto b = m.Prefill(*s, more);
  EXPECT_TRUE(b.ok()) << b.status();
  if (b.ok()) out.insert(out.end(), b->begin(), b->end());
  return out;
}

TEST(DenseWeightLoad, FollowsDenseFormatOf) {
  ModelConfig bf16_ckpt, fp8_ckpt;
  fp8_ckpt.quantization.method = "fp8";
  fp8_ckpt.quantization.weight_block = {128, 128};
  for (DenseWeights w : {DenseWeights::kFp8, DenseWeights::kInt8, DenseWeights::kInt4}) {
    for (const ModelConfig* c : {&bf16_ckpt, &fp8_ckpt}) {
      const cpu::WeightLoad l = cpu::WeightLoadFor(*c, w);
      EXPECT_EQ(l.format, DenseFormatOf(w).format) << DenseWeightsName(w);
      EXPECT_EQ(l.group, DenseFormatOf(w).group) << DenseWeightsName(w);
      EXPECT_TRUE(l.quantized());
    }
  }
  EXPECT_FALSE(cpu::WeightLoadFor(bf16_ckpt, DenseWeights::kAuto).quantized());
  EXPECT_FALSE(cpu::WeightLoadFor(fp8_ckpt, DenseWeights::kBf16).quantized());
  const cpu::WeightLoad a = cpu::WeightLoadFor(fp8_ckpt, DenseWeights::kAuto);
  EXPECT_TRUE(a.keep_fp8);
  EXPECT_EQ(a.fp8_block, 128);
  // fp8 blocks of another edge are not DenseFormatOf's: auto dequantizes them.
  fp8_ckpt.quantization.weight_block = {16, 16};
  EXPECT_FALSE(cpu::WeightLoadFor(fp8_ckpt, DenseWeights::kAuto).quantized());
}

// Each format's stored codes: within half a quantization step of the
// weight, scales as the trait table lays them out.
TEST(DenseWeightLoad, QuantizesWithinHalfAStep) {
  auto ckpt = Checkpoint::Open(Fixture("deepseek_v3_tiny"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const std::string name = "model.layers.0.self_attn.q_b_proj.weight";
  auto ref = cpu::LoadMatrix(**ckpt, name);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int64_t R = ref->rows, C = ref->cols;
  std::vector<float> w(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r) ref->RowToF32(r, w.data() + r * C);
  ModelConfig c;
  for (DenseWeights f : {DenseWeights::kFp8, DenseWeights::kInt8, DenseWeights::kInt4}) {
    const cpu::WeightLoad l = cpu::WeightLoadFor(c, f);
    auto q = cpu::LoadDenseMatrix(**ckpt, name, l);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->format, l.format);
    EXPECT_EQ(static_cast<int64_t>(q->scale.size()),
              ScaleRows(l.format, l.group, R) * ScalesPerRow(l.format, l.group, C));
    auto m = cpu::LoadDenseAsMatrix(**ckpt, name, l);
    ASSERT_TRUE(m.ok()) << m.status();
    double changed = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t col = 0; col < C; ++col) {
        const float v = w[static_cast<size_t>(r * C + col)], s = q->ScaleAt(r, col);
        const float got = m->f32[r * C + col];
        EXPECT_EQ(got, q->At(r, col));
        // fp8: e4m3's step is 2^-3 of the value's power of two (at most 32 scales at 448).
        const float step = f == DenseWeights::kFp8 ? std::max(std::abs(v) / 8.0f, s / 64.0f) : s;
        ASSERT_LE(std::abs(got - v), 0.5f * step * 1.0001f + 1e-12f)
            << DenseWeightsName(f) << " [" << r << ", " << col << "]";
        changed += got != v;
      }
    EXPECT_GT(changed, 0) << DenseWeightsName(f);
  }
}

class DenseWeightsModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND(GetParam()); }
};
INSTANTIATE_TEST_SUITE_P(Backends, DenseWeightsModel, ::testing::ValuesIn(testing::TestBackends()),
                         testing::BackendParamName());

// Each format changes the logits a little (they are not bf16's) and the
// CPU reference and this backend agree at the same format.
TEST_P(DenseWeightsModel, FormatsStayCloseToBf16) {
  // ds3_fortunes is trained (its logits mean something); qwen3_moe_tiny's
  // random weights route on near ties, so a flipped expert moves more.
  for (const char* fixture : {"ds3_fortunes", "qwen3_moe_tiny"}) {
    const bool trained = std::string(fixture) == "ds3_fortunes";
    const std::string dir = Fixture(fixture);
    auto base = LoadWith(dir, "cpu", DenseWeights::kBf16);
    ASSERT_TRUE(base);
    const std::vector<float> want = RunSteps(*base);
    for (DenseWeights w : {DenseWeights::kFp8, DenseWeights::kInt8, DenseWeights::kInt4}) {
      SCOPED_TRACE(std::string(fixture) + " " + std::string(DenseWeightsName(w)));
      auto ref = LoadWith(dir, "cpu", w);
      auto m = LoadWith(dir, GetParam(), w);
      ASSERT_TRUE(ref && m);
      EXPECT_EQ(m->options().weights, w);
      const std::vector<float> r = RunSteps(*ref), got = RunSteps(*m);
      ASSERT_EQ(r.size(), want.size());
      ASSERT_EQ(got.size(), want.size());
      const double drift = RelErr(r.data(), want.data(), static_cast<int64_t>(want.size()));
      std::printf("%s %s: max |logit - bf16's| / max |bf16's| %.4f\n", fixture,
                  std::string(DenseWeightsName(w)).c_str(), drift);
      EXPECT_GT(drift, 0.0);
      EXPECT_LT(drift, (trained ? 1.0 : 4.0) * (w == DenseWeights::kInt4 ? 0.3 : 0.1));
      if (GetParam() != "cpu") {
        // The device's sums (f32, another order; bf16 activations) against the
        // reference's, as bf16 weights agree (tests/cuda/backend_agreement_test.cc).
        EXPECT_LE(Nmse(got, r), 1e-3);
      }
    }
  }
}

// A checkpoint whose projections and LM head ship as DeepSeek's fp8
// (128 x 128 blocks): weights fp8 and auto keep those codes, so the logits
// are those of the checkpoint's values dequantized (weights bf16 on the CPU
// reference: f32 dequantization), exactly.
TEST_P(DenseWeightsModel, Fp8CheckpointLoadsNatively) {
  testing::TempDir dir;
  const auto fp8_edit = [](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
    const bool dense =
        t.rank() == 2 && (n.find("_proj") != std::string::npos || n == "lm_head.weight");
    if (!dense) return testing::Keep(n, t, w);
    const int64_t R = t.dim(0), C = t.dim(1);
    const testing::Fp8Blocks f = testing::QuantizeFp8Blocks(t.ToF32(), R, C, 128);
    EXPECT_TRUE(w.Add(n, DType::kF8E4M3, {R, C}, f.q.data(), f.q.size()).ok());
    EXPECT_TRUE(w.Add(n + "_scale_inv", DType::kF32, {f.block_rows, f.block_cols}, f.scale.data(),
                      f.scale.size() * 4)
                    .ok());
    return true;
  };
  testing::RewriteCheckpoint(Fixture("deepseek_v3_tiny"), dir.path(), fp8_edit,
                             testing::Fp8Config(128));
  auto old_path = LoadWith(dir.path(), "cpu", DenseWeights::kBf16);
  ASSERT_TRUE(old_path);
  const std::vector<float> want = RunSteps(*old_path);
  for (DenseWeights w : {DenseWeights::kFp8, DenseWeights::kAuto}) {
    SCOPED_TRACE(std::string(DenseWeightsName(w)));
    auto m = LoadWith(dir.path(), GetParam(), w);
    ASSERT_TRUE(m);
    const std::vector<float> got = RunSteps(*m);
    if (GetParam() == "cpu") {
      EXPECT_EQ(got, want);
    } else {
      EXPECT_LE(Nmse(got, want), 1e-3);
    }
  }
  // int8 from fp8: dequantized, then quantized per row.
  auto i8 = LoadWith(dir.path(), GetParam(), DenseWeights::kInt8);
  ASSERT_TRUE(i8);
  const std::vector<float> got = RunSteps(*i8);
  const double drift = RelErr(got.data(), want.data(), static_cast<int64_t>(want.size()));
  EXPECT_GT(drift, 0.0);
  EXPECT_LT(drift, 0.5);  // random weights: see FormatsStayCloseToBf16
}

// fp8 scales missing or of the wrong shape: refused at load, naming the
// tensor (and both shapes), with weights fp8 (kept native) as with bf16.
TEST_P(DenseWeightsModel, BadFp8ScalesAreRefused) {
  const std::string bad = "model.layers.0.self_attn.o_proj.weight";
  for (bool drop : {true, false}) {
    testing::TempDir dir;
    const auto edit = [&](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
      if (n != bad) return testing::Keep(n, t, w);
      const int64_t R = t.dim(0), C = t.dim(1);
      const testing::Fp8Blocks f = testing::QuantizeFp8Blocks(t.ToF32(), R, C, 128);
      EXPECT_TRUE(w.Add(n, DType::kF8E4M3, {R, C}, f.q.data(), f.q.size()).ok());
      if (!drop) {
        std::vector<float> s(static_cast<size_t>(f.block_rows * f.block_cols + 1), 1.0f);
        EXPECT_TRUE(w.Add(n + "_scale_inv", DType::kF32, {f.block_rows, f.block_cols + 1}, s.data(),
                          s.size() * 4)
                        .ok());
      }
      return true;
    };
    testing::RewriteCheckpoint(Fixture("deepseek_v3_tiny"), dir.path(), edit,
                               testing::Fp8Config(128));
    for (DenseWeights w : {DenseWeights::kFp8, DenseWeights::kBf16, DenseWeights::kInt4}) {
      SCOPED_TRACE(std::string(DenseWeightsName(w)) + (drop ? " missing" : " wrong shape"));
      ModelOptions o;
      o.backend = GetParam();
      o.num_threads = 2;
      o.weights = w;
      auto m = Model::Load(dir.path(), o);
      ASSERT_FALSE(m.ok());
      const std::string msg(m.status().message());
      EXPECT_THAT(msg, HasSubstr("o_proj.weight_scale_inv"));
      if (drop) {
        EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
      } else {
        EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
        EXPECT_THAT(msg, HasSubstr("[1, 2]"));  // given
        EXPECT_THAT(msg, HasSubstr("[1, 1]"));  // expected
      }
    }
  }
}

}  // namespace
}  // namespace hmoe
