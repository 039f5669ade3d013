// Checkpoints whose routed experts ship quantized (compressed-tensors int4
// g32, mxfp4, fp8 128x128 blocks, mxfp8), written here by packers that
// follow the published layouts, read natively: the config's
// quantization_config understood, the codes and scales kept bit for bit,
// dequantized on request; every bad shape, scale count, NaN scale and
// unknown method refused naming the tensor or field.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "common/model_config.h"
#include "common/native_layout.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/native_checkpoint.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::hmoe::testing::AddNative;
using ::hmoe::testing::MakeNative;
using ::hmoe::testing::NativeCheckpoint;
using ::hmoe::testing::PackInt32;
using nlohmann::json;

void ExpectSameMatrix(const QuantMatrix& got, const QuantMatrix& want) {
  EXPECT_EQ(got.format, want.format);
  EXPECT_EQ(got.group, want.group);
  ASSERT_EQ(got.rows, want.rows);
  ASSERT_EQ(got.cols, want.cols);
  EXPECT_EQ(got.packed, want.packed);
  EXPECT_EQ(got.scale, want.scale);
  EXPECT_EQ(got.scale_bf16, want.scale_bf16);
  EXPECT_EQ(got.scale_e8m0, want.scale_e8m0);
}

class NativeCheckpointTest : public ::testing::TestWithParam<WeightFormat> {};

TEST_P(NativeCheckpointTest, ExpertsAreReadAsStoredAndDequantizedOnRequest) {
  const WeightFormat f = GetParam();
  ::hmoe::testing::TempDir dir;
  const NativeCheckpoint nc = MakeNative(dir.path(), f);
  auto cfg = LoadModelConfig(dir.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_TRUE(CheckWeights(*cfg, **ckpt).ok()) << CheckWeights(*cfg, **ckpt);
  EXPECT_TRUE(RoutedExpertsFingerprint(**ckpt, *cfg).ok());
  const auto native = CheckpointExpertFormat(*cfg, dir.path());
  ASSERT_TRUE(native.ok()) << native.status();
  EXPECT_EQ(native->format, f);
  EXPECT_EQ(native->group, Traits(f).default_group);
  int checked = 0;
  for (int l = 0; l < static_cast<int>(cfg->layers.size()); ++l) {
    if (!cfg->layers[l].moe) continue;
    const MoeWeightsSource src = CheckpointSource(**ckpt, *cfg, l);
    EXPECT_EQ(src.native_format, f);
    for (int64_t e = 0; e < src.num_experts; ++e) {
      auto w = src.expert(e);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(w->format, f);
      QuantOptions o;
      o.format = f;
      o.group = src.native_group;
      auto q = QuantizeExpert(*w, src, o);
      ASSERT_TRUE(q.ok()) << q.status();
      const ExpertProj projs[3] = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};
      const QuantMatrix* got[3] = {&q->gate, &q->up, &q->down};
      for (int i = 0; i < 3; ++i) {
        const std::string name = ExpertWeightName(*cfg, l, static_cast<int>(e), projs[i]);
        ExpectSameMatrix(*got[i], nc.written.at(name));
        ++checked;
      }
      // Another format: dequantized exactly (bf16 of At), then quantized.
      o.format = WeightFormat::kBf16;
      auto b = QuantizeExpert(*w, src, o);
      ASSERT_TRUE(b.ok()) << b.status();
      for (int64_t r = 0; r < b->down.rows; ++r)
        for (int64_t c = 0; c < b->down.cols; ++c)
          ASSERT_EQ(b->down.At(r, c), Bf16ToF32(F32ToBf16(q->down.At(r, c))));
      // A shard's slice: intermediate [0, 16) of 32 cuts down's scale
      // blocks (groups of 32 along its cols); fp8 cuts gate's 128x128 block
      // already (its rows).
      o.format = f;
      o.i_begin = 0;
      o.i_end = 16;
      auto s = QuantizeExpert(*w, src, o);
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(
          s.status().message().find(f == WeightFormat::kFp8 ? "gate: the slice [0, 16) x [0, 64)"
                                                            : "down: the slice [0, 64) x [0, 16)"),
          std::string::npos)
          << s.status();
    }
  }
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Formats, NativeCheckpointTest,
                         ::testing::Values(WeightFormat::kInt4Bf16, WeightFormat::kMxfp4,
                                           WeightFormat::kFp8, WeightFormat::kMxfp8),
                         [](const auto& info) {
                           return std::string(WeightFormatName(info.param));
                         });

// The stored tensors of `m` (ExpertWeights' layouts).
std::pair<Tensor, Tensor> StoredTensors(const QuantMatrix& m) {
  const int64_t sr = ScaleRows(m.format, m.group, m.rows),
                sc = ScalesPerRow(m.format, m.group, m.cols);
  Tensor codes, scales;
  switch (m.format) {
    case WeightFormat::kInt4Bf16: {
      const std::vector<int32_t> p = PackInt32(m);
      codes = Tensor::Empty(DType::kI32, {m.rows, (m.cols + 7) / 8});
      std::memcpy(codes.raw(), p.data(), p.size() * 4);
      scales = Tensor::Empty(DType::kBF16, {sr, sc});
      std::memcpy(scales.raw(), m.scale_bf16.data(), m.scale_bf16.size() * 2);
      break;
    }
    case WeightFormat::kMxfp4:
      codes = Tensor::Empty(DType::kU8, {m.rows, m.cols / 2});
      std::memcpy(codes.raw(), m.packed.data(), m.packed.size());
      scales = Tensor::Empty(DType::kF8E8M0, {sr, sc});
      std::memcpy(scales.raw(), m.scale_e8m0.data(), m.scale_e8m0.size());
      break;
    default:  // fp8
      codes = Tensor::Empty(DType::kF8E4M3, {m.rows, m.cols});
      std::memcpy(codes.raw(), m.packed.data(), m.packed.size());
      scales = Tensor::Empty(DType::kF32, {sr, sc});
      std::memcpy(scales.raw(), m.scale.data(), m.scale.size() * 4);
      break;
  }
  return {codes, scales};
}

// A tensor-parallel shard's slice on whole scale blocks is the native
// matrices' rows (gate, up) and cols (down), codes and scales as stored.
TEST(NativeCheckpointSlices, ShardsOnBlockBoundariesKeepTheStoredCodes) {
  for (WeightFormat f : {WeightFormat::kInt4Bf16, WeightFormat::kMxfp4, WeightFormat::kFp8}) {
    SCOPED_TRACE(WeightFormatName(f));
    const int group = Traits(f).default_group;
    const int64_t H = 96, I = f == WeightFormat::kFp8 ? 300 : 96;
    const int64_t i0 = f == WeightFormat::kFp8 ? 128 : 32, i1 = f == WeightFormat::kFp8 ? 256 : 64;
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 0.1f);
    auto random = [&](int64_t rows, int64_t cols) {
      std::vector<float> v(static_cast<size_t>(rows * cols));
      for (float& x : v) x = d(rng);
      return QuantizeMatrix(v.data(), rows, cols, f, group);
    };
    const QuantMatrix gate = random(I, H), up = random(I, H), down = random(H, I);
    ExpertWeights w;
    w.format = f;
    w.group = group;
    std::tie(w.gate, w.gate_scale_inv) = StoredTensors(gate);
    std::tie(w.up, w.up_scale_inv) = StoredTensors(up);
    std::tie(w.down, w.down_scale_inv) = StoredTensors(down);
    MoeWeightsSource src;
    src.hidden = H;
    src.intermediate = I;
    src.num_experts = 1;
    QuantOptions o;
    o.format = f;
    o.group = group;
    o.i_begin = i0;
    o.i_end = i1;
    auto q = QuantizeExpert(w, src, o);
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_EQ(q->gate.rows, i1 - i0);
    ASSERT_EQ(q->down.cols, i1 - i0);
    for (int64_t r = 0; r < i1 - i0; ++r)
      for (int64_t c = 0; c < H; ++c) {
        ASSERT_EQ(q->gate.At(r, c), gate.At(i0 + r, c)) << r << "," << c;
        ASSERT_EQ(q->up.At(r, c), up.At(i0 + r, c));
      }
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = 0; c < i1 - i0; ++c) ASSERT_EQ(q->down.At(r, c), down.At(r, i0 + c));
    EXPECT_EQ(q->down.packed.size(), static_cast<size_t>(H * RowBytes(f, i1 - i0)));
    EXPECT_EQ(q->down.scale.size() + q->down.scale_bf16.size() + q->down.scale_e8m0.size(),
              static_cast<size_t>(ScaleCount(f, group, H, i1 - i0)));
    // The last shard: to the end of a tail block (fp8: 300 = 2 x 128 + 44).
    o.i_begin = i1;
    o.i_end = I;
    auto tail = QuantizeExpert(w, src, o);
    ASSERT_TRUE(tail.ok()) << tail.status();
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = 0; c < I - i1; ++c) ASSERT_EQ(tail->down.At(r, c), down.At(r, i1 + c));
  }
}

// The first routed expert weight of the fixture's first MoE layer.
absl::Status LoadAll(const std::string& dir) {
  auto cfg = LoadModelConfig(dir);
  if (!cfg.ok()) return cfg.status();
  auto ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  for (int l = 0; l < static_cast<int>(cfg->layers.size()); ++l) {
    if (!cfg->layers[l].moe) continue;
    for (int64_t e = 0; e < cfg->moe.num_experts; ++e) {
      auto w = LoadExpertWeights(**ckpt, *cfg, l, e);
      if (!w.ok()) return w.status();
    }
  }
  return absl::OkStatus();
}

void ExpectRefused(const absl::Status& s, absl::StatusCode code,
                   const std::vector<std::string>& parts) {
  EXPECT_EQ(s.code(), code) << s;
  for (const std::string& p : parts)
    EXPECT_NE(s.message().find(p), std::string::npos) << p << ": " << s;
}

const char kVictim[] = "model.layers.2.mlp.experts.3.down_proj.weight";

TEST(NativeCheckpointErrors, TruncatedWeightPackedIsRefusedNamingItAndBothShapes) {
  ::hmoe::testing::TempDir dir;
  MakeNative(dir.path(), WeightFormat::kInt4Bf16,
             [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
               if (name != kVictim) return;
               std::vector<int32_t> p = PackInt32(m);
               const int64_t words = (m.cols + 7) / 8 - 1;  // one int32 short a row
               ASSERT_TRUE(w.Add(name + "_packed", DType::kI32, {m.rows, words}, p.data(),
                                 static_cast<size_t>(m.rows * words) * 4)
                               .ok());
               ASSERT_TRUE(w.Add(name + "_scale", DType::kBF16, {m.rows, m.cols / 32},
                                 m.scale_bf16.data(), m.scale_bf16.size() * 2)
                               .ok());
               *done = true;
             });
  auto cfg = LoadModelConfig(dir.path());
  ASSERT_TRUE(cfg.ok());
  ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kInvalidArgument,
                {std::string(kVictim) + "_packed", "I32 [64, 3]", "expected I32 [64, 4]"});
}

TEST(NativeCheckpointErrors, ScalesOfTheWrongShapeAreRefusedNamingBothShapes) {
  const std::pair<WeightFormat, std::vector<std::string>> cases[] = {
      {WeightFormat::kInt4Bf16, {"_scale is BF16 [64, 2], expected BF16 [64, 1]"}},
      {WeightFormat::kMxfp4, {"_scales is U8 [64, 2], expected F8_E8M0 / U8 [64, 1]"}},
      {WeightFormat::kFp8, {"_scale_inv is F32 [1, 2], expected F32 [1, 1]"}},
      {WeightFormat::kMxfp8, {"_scale is F8_E8M0 [64, 2], expected F8_E8M0 / U8 [64, 1]"}},
  };
  for (const auto& [f, parts] : cases) {
    SCOPED_TRACE(WeightFormatName(f));
    ::hmoe::testing::TempDir dir;
    MakeNative(dir.path(), f,
               [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
                 if (name != kVictim) return;
                 AddNative(w, name, m, /*bad_scales=*/true);
                 *done = true;
               });
    std::vector<std::string> want = parts;
    want.push_back(kVictim);
    ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kInvalidArgument, want);
  }
  // Fewer groups than the weight has: a 3-D scale tensor is no scale matrix.
  ::hmoe::testing::TempDir dir;
  MakeNative(dir.path(), WeightFormat::kMxfp4,
             [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
               if (name != kVictim) return;
               ASSERT_TRUE(w.Add(name + "_blocks", DType::kU8, {m.rows, m.cols / 32, 16},
                                 m.packed.data(), m.packed.size())
                               .ok());
               ASSERT_TRUE(w.Add(name + "_scales", DType::kU8, {m.rows / 2, 2}, m.scale_e8m0.data(),
                                 m.scale_e8m0.size())
                               .ok());
               *done = true;
             });
  ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kInvalidArgument,
                {std::string(kVictim) + "_scales", "U8 [32, 2]", "expected F8_E8M0 / U8 [64, 1]"});
}

TEST(NativeCheckpointErrors, AnE8M0ScaleOf0xFFIsRefused) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8}) {
    SCOPED_TRACE(WeightFormatName(f));
    ::hmoe::testing::TempDir dir;
    MakeNative(dir.path(), f,
               [](const std::string& name, QuantMatrix& m, SafetensorsWriter&, bool*) {
                 if (name == kVictim) m.scale_e8m0[5] = 0xFF;
               });
    ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kInvalidArgument,
                  {std::string(kVictim) + (f == WeightFormat::kMxfp4 ? "_scales" : "_scale"),
                   "[5, 0] is 0xFF"});
  }
}

// Every convention (common/native_layout.h row) through the real loader on
// a written checkpoint: read as stored; a truncated codes tensor, a scale
// tensor of the wrong shape and a scale without a value each refused
// naming the tensor.
class NativeLayoutTest : public ::testing::TestWithParam<size_t> {
 protected:
  const NativeLayout& layout() const { return kNativeLayouts[GetParam()]; }
  WeightFormat format() const { return ParseWeightFormat(layout().expert_format).value(); }
  std::string Codes() const { return NativeTensorName(kVictim, layout().codes); }
  std::string Scales() const { return NativeTensorName(kVictim, layout().scales); }
  // The fixture in this convention, `mutate` applied to kVictim's matrix.
  NativeCheckpoint Make(const std::string& dir,
                        const std::function<void(QuantMatrix&, SafetensorsWriter&)>& mutate) {
    const NativeLayout* l = &layout();
    return MakeNative(
        dir, format(),
        [&](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
          if (name != kVictim || !mutate) return;
          mutate(m, w);
          *done = true;
        },
        nullptr, l);
  }
  // Loads every expert and keeps it in its format (what the service packs).
  absl::Status LoadAndKeep(const std::string& dir) {
    auto cfg = LoadModelConfig(dir);
    if (!cfg.ok()) return cfg.status();
    auto ckpt = Checkpoint::Open(dir);
    if (!ckpt.ok()) return ckpt.status();
    RETURN_IF_ERROR(CheckWeights(*cfg, **ckpt));
    for (int l = 0; l < static_cast<int>(cfg->layers.size()); ++l) {
      if (!cfg->layers[l].moe) continue;
      const MoeWeightsSource src = CheckpointSource(**ckpt, *cfg, l);
      for (int64_t e = 0; e < src.num_experts; ++e) {
        ASSIGN_OR_RETURN(const ExpertWeights w, src.expert(e));
        QuantOptions o;
        o.format = src.native_format;
        o.group = src.native_group;
        RETURN_IF_ERROR(QuantizeExpert(w, src, o).status());
      }
    }
    return absl::OkStatus();
  }
};

TEST_P(NativeLayoutTest, IsReadAsStored) {
  ::hmoe::testing::TempDir dir;
  const NativeCheckpoint nc = Make(dir.path(), nullptr);
  auto cfg = LoadModelConfig(dir.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(FindNativeLayout(cfg->quantization), &layout());
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(CheckWeights(*cfg, **ckpt).ok()) << CheckWeights(*cfg, **ckpt);
  const MoeWeightsSource src = CheckpointSource(**ckpt, *cfg, 2);
  ASSERT_EQ(src.native_format, format());
  auto w = src.expert(3);
  ASSERT_TRUE(w.ok()) << w.status();
  QuantOptions o;
  o.format = format();
  o.group = src.native_group;
  auto q = QuantizeExpert(*w, src, o);
  ASSERT_TRUE(q.ok()) << q.status();
  ExpectSameMatrix(q->down, nc.written.at(kVictim));
  EXPECT_TRUE(LoadAndKeep(dir.path()).ok()) << LoadAndKeep(dir.path());
}

TEST_P(NativeLayoutTest, TruncatedCodesAreRefusedNamingThem) {
  ::hmoe::testing::TempDir dir;
  Make(dir.path(), [&](QuantMatrix& m, SafetensorsWriter& w) {
    // The codes (and, consistently, the scales) of the last row missing.
    QuantMatrix t = m;
    t.rows = m.rows - 1;
    t.packed.resize(static_cast<size_t>(t.rows * RowBytes(t.format, t.cols)));
    const size_t scales = static_cast<size_t>(ScaleCount(t.format, t.group, t.rows, t.cols));
    if (!t.scale.empty()) t.scale.resize(scales);
    if (!t.scale_bf16.empty()) t.scale_bf16.resize(scales);
    if (!t.scale_e8m0.empty()) t.scale_e8m0.resize(scales);
    AddNative(w, kVictim, t, /*bad_scales=*/false, &layout());
  });
  ExpectRefused(LoadAndKeep(dir.path()), absl::StatusCode::kInvalidArgument,
                {Codes(), " [63, ", "expected "});
}

TEST_P(NativeLayoutTest, ScalesOfTheWrongShapeAreRefusedNamingThem) {
  ::hmoe::testing::TempDir dir;
  Make(dir.path(), [&](QuantMatrix& m, SafetensorsWriter& w) {
    AddNative(w, kVictim, m, /*bad_scales=*/true, &layout());
  });
  ExpectRefused(LoadAndKeep(dir.path()), absl::StatusCode::kInvalidArgument,
                {Scales() + " is ", ", expected "});
}

// The e8m0 NaN (0xFF), a NaN bf16 or an infinite f32 scale.
TEST_P(NativeLayoutTest, AScaleWithoutAValueIsRefusedNamingIt) {
  ::hmoe::testing::TempDir dir;
  Make(dir.path(), [&](QuantMatrix& m, SafetensorsWriter& w) {
    if (!m.scale_e8m0.empty()) m.scale_e8m0.back() = 0xFF;
    if (!m.scale_bf16.empty()) m.scale_bf16.back() = 0x7FC0;
    if (!m.scale.empty()) m.scale.back() = std::numeric_limits<float>::infinity();
    AddNative(w, kVictim, m, /*bad_scales=*/false, &layout());
  });
  const int64_t sr = ScaleRows(format(), Traits(format()).default_group, 64),
                sc = ScalesPerRow(format(), Traits(format()).default_group, 32);
  ExpectRefused(LoadAndKeep(dir.path()), absl::StatusCode::kInvalidArgument,
                {Scales() + " [" + std::to_string(sr - 1) + ", " + std::to_string(sc - 1) + "] is ",
                 Traits(format()).scale_type == ScaleType::kE8M0  ? "0xFF"
                 : Traits(format()).scale_type == ScaleType::kF32 ? "inf"
                                                                  : "nan"});
}

INSTANTIATE_TEST_SUITE_P(Layouts, NativeLayoutTest,
                         ::testing::Range<size_t>(0, std::size(kNativeLayouts)),
                         [](const auto& info) {
                           const NativeLayout& l = kNativeLayouts[info.param];
                           std::string n =
                               absl::StrCat(std::string(l.method), "_", std::string(l.ct_format));
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

TEST(NativeCheckpointErrors, AWrongWeightShapeIsRefused) {
  ::hmoe::testing::TempDir dir;
  MakeNative(dir.path(), WeightFormat::kInt4Bf16,
             [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
               if (name != kVictim) return;
               const std::vector<int32_t> p = PackInt32(m);
               ASSERT_TRUE(w.Add(name + "_packed", DType::kI32, {m.rows, (m.cols + 7) / 8},
                                 p.data(), p.size() * 4)
                               .ok());
               ASSERT_TRUE(w.Add(name + "_scale", DType::kBF16, {m.rows, m.cols / 32},
                                 m.scale_bf16.data(), m.scale_bf16.size() * 2)
                               .ok());
               const int64_t shape[2] = {m.cols, m.rows};
               ASSERT_TRUE(w.Add(name + "_shape", DType::kI64, {2}, shape, sizeof(shape)).ok());
               *done = true;
             });
  ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kInvalidArgument,
                {std::string(kVictim) + "_shape", "says [32, 64]", "expected [64, 32]"});
}

TEST(NativeCheckpointErrors, UnknownOrUnreadQuantizationIsRefusedNamingIt) {
  ::hmoe::testing::TempDir dir;
  MakeNative(dir.path(), WeightFormat::kMxfp4, nullptr, [](json& j) {
    j["quantization_config"] = {{"quant_method", "awq"}};
  });
  ExpectRefused(LoadModelConfig(dir.path()).status(), absl::StatusCode::kUnimplemented,
                {"quant_method \"awq\""});
  ::hmoe::testing::TempDir d2;
  MakeNative(d2.path(), WeightFormat::kInt4Bf16, nullptr, [](json& j) {
    j["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  });
  ExpectRefused(LoadModelConfig(d2.path()).status(), absl::StatusCode::kUnimplemented,
                {"config_groups.group_0.weights.num_bits 8"});
  ::hmoe::testing::TempDir d3;
  MakeNative(d3.path(), WeightFormat::kInt4Bf16, nullptr, [](json& j) {
    j["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
  });
  ExpectRefused(LoadModelConfig(d3.path()).status(), absl::StatusCode::kUnimplemented,
                {"symmetric false"});
  ::hmoe::testing::TempDir d4;
  MakeNative(d4.path(), WeightFormat::kInt4Bf16, nullptr,
             [](json& j) { j["quantization_config"]["format"] = "marlin-24"; });
  ExpectRefused(LoadModelConfig(d4.path()).status(), absl::StatusCode::kUnimplemented,
                {"format \"marlin-24\""});
  // compressed-tensors' FP4 / FP6 formats other than MXFP4 (nvfp4: e4m3
  // scales per 16 and a global scale), and an MX format's args not its own.
  for (const char* format : {"nvfp4-pack-quantized", "mxfp6-pack-quantized"}) {
    ::hmoe::testing::TempDir d;
    MakeNative(d.path(), WeightFormat::kMxfp4, nullptr, [&](json& j) {
      j["quantization_config"] =
          ::hmoe::testing::QuantConfig(*FindCompressedTensorsLayout("mxfp4-pack-quantized"));
      j["quantization_config"]["format"] = format;
    });
    ExpectRefused(
        LoadModelConfig(d.path()).status(), absl::StatusCode::kUnimplemented,
        {"config_groups.group_0.format \"" + std::string(format) + "\"", "mxfp4-pack-quantized"});
  }
  ::hmoe::testing::TempDir d5;
  MakeNative(d5.path(), WeightFormat::kMxfp4, nullptr, [](json& j) {
    j["quantization_config"] =
        ::hmoe::testing::QuantConfig(*FindCompressedTensorsLayout("mxfp4-pack-quantized"));
    j["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int";
  });
  ExpectRefused(LoadModelConfig(d5.path()).status(), absl::StatusCode::kUnimplemented,
                {"config_groups.group_0.weights.type \"int\""});
  ::hmoe::testing::TempDir d6;
  MakeNative(d6.path(), WeightFormat::kMxfp8, nullptr, [](json& j) {
    j["quantization_config"] =
        ::hmoe::testing::QuantConfig(*FindCompressedTensorsLayout("mxfp8-quantized"));
    j["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64;
  });
  ExpectRefused(LoadModelConfig(d6.path()).status(), absl::StatusCode::kUnimplemented,
                {"config_groups.group_0.weights.group_size 64"});
}

TEST(NativeCheckpointErrors, AnExpertHalfQuantizedIsRefused) {
  ::hmoe::testing::TempDir dir;
  MakeNative(
      dir.path(), WeightFormat::kMxfp4,
      [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
        if (name != kVictim) return;
        std::vector<uint16_t> bf(static_cast<size_t>(m.rows * m.cols));
        for (int64_t r = 0; r < m.rows; ++r)
          for (int64_t c = 0; c < m.cols; ++c)
            bf[static_cast<size_t>(r * m.cols + c)] = F32ToBf16(m.At(r, c));
        ASSERT_TRUE(w.Add(name, DType::kBF16, {m.rows, m.cols}, bf.data(), bf.size() * 2).ok());
        *done = true;
      });
  ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kUnimplemented,
                {"layer 2 expert 3", "some projections as mxfp4"});
}

TEST(NativeCheckpointErrors, CheckWeightsNamesAMissingScaleTensor) {
  ::hmoe::testing::TempDir dir;
  MakeNative(dir.path(), WeightFormat::kMxfp4,
             [](const std::string& name, QuantMatrix& m, SafetensorsWriter& w, bool* done) {
               if (name != kVictim) return;
               ASSERT_TRUE(w.Add(name + "_blocks", DType::kU8, {m.rows, m.cols / 32, 16},
                                 m.packed.data(), m.packed.size())
                               .ok());
               *done = true;  // no _scales
             });
  auto cfg = LoadModelConfig(dir.path());
  ASSERT_TRUE(cfg.ok());
  auto ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok());
  ExpectRefused(CheckWeights(*cfg, **ckpt), absl::StatusCode::kNotFound,
                {"1 missing tensor(s): " + std::string(kVictim) + "_scales"});
  ExpectRefused(LoadAll(dir.path()), absl::StatusCode::kNotFound,
                {std::string(kVictim) + "_scales"});
}

}  // namespace
}  // namespace hmoe
