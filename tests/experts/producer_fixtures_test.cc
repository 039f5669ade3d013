// Checkpoints whose routed experts were quantized by the formats' own
// producers (tests/fixtures/native_producers: compressed-tensors' int4 g32
// and mxfp8 compressors, compressed-tensors' mxfp4 laid out as gpt-oss ships
// it, compressed-tensors' mxfp4 and mxfp8 checkpoints as it saves them
// itself, transformers' fine-grained fp8 quantizer), read through the checkpoint
// source and dequantized here, against the producer's own dequantization
// stored beside them (producer_dequant.safetensors), bit for bit as
// tests/testing/producer_fixtures.h says.
#include "tests/testing/producer_fixtures.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "common/model_config.h"
#include "common/native_layout.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::hmoe::testing::Mismatch;
using Fixture = ::hmoe::testing::ProducerFixture;

std::string FixtureDir(const Fixture& f) { return ::hmoe::testing::ProducerFixtureDir(f); }

struct Comparison {
  int64_t matrices = 0, elements = 0;
  std::vector<Mismatch> mismatches;
};

// Reads every routed expert of the checkpoint in `dir` natively (the
// checkpoint source, the format kept as stored) and compares each weight with
// `producer`'s tensor of the same name.
Comparison CompareWithProducer(const std::string& dir, const Fixture& fx,
                               const SafetensorsFile& producer) {
  Comparison out;
  auto cfg = LoadModelConfig(dir);
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  if (!cfg.ok()) return out;
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return out;
  EXPECT_TRUE(CheckWeights(*cfg, **ckpt).ok()) << CheckWeights(*cfg, **ckpt);
  auto native = CheckpointExpertFormat(*cfg, dir);
  EXPECT_TRUE(native.ok()) << native.status();
  if (!native.ok()) return out;
  EXPECT_EQ(native->format, fx.format);
  EXPECT_EQ(native->group, fx.group);
  for (int l = 0; l < static_cast<int>(cfg->layers.size()); ++l) {
    if (!cfg->layers[l].moe) continue;
    const MoeWeightsSource src = CheckpointSource(**ckpt, *cfg, l);
    EXPECT_EQ(src.native_format, fx.format);
    for (int64_t e = 0; e < src.num_experts; ++e) {
      auto w = src.expert(e);
      EXPECT_TRUE(w.ok()) << w.status();
      if (!w.ok()) return out;
      QuantOptions o;
      o.format = fx.format;
      o.group = src.native_group;
      auto q = QuantizeExpert(*w, src, o);
      EXPECT_TRUE(q.ok()) << q.status();
      if (!q.ok()) return out;
      const ExpertProj projs[3] = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};
      const QuantMatrix* got[3] = {&q->gate, &q->up, &q->down};
      for (int i = 0; i < 3; ++i) {
        const QuantMatrix& m = *got[i];
        EXPECT_EQ(m.format, fx.format);
        const std::string name = ExpertWeightName(*cfg, l, static_cast<int>(e), projs[i]);
        auto p = producer.Get(name);
        EXPECT_TRUE(p.ok()) << p.status();
        if (!p.ok()) return out;
        if (!::hmoe::testing::CompareWithProducer(m, *p, name, &out.mismatches, &out.elements))
          return out;
        ++out.matrices;
      }
    }
  }
  return out;
}

std::string Describe(const Comparison& c) {
  return ::hmoe::testing::Describe(c.mismatches, c.elements);
}

class ProducerFixtureTest : public ::testing::TestWithParam<Fixture> {
 protected:
  std::unique_ptr<SafetensorsFile> Producer() {
    auto p = SafetensorsFile::Open(FixtureDir(GetParam()) + "/producer_dequant.safetensors");
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
};

TEST_P(ProducerFixtureTest, OurDequantizationIsTheProducers) {
  const Fixture& fx = GetParam();
  auto producer = Producer();
  ASSERT_NE(producer, nullptr);
  const Comparison c = CompareWithProducer(FixtureDir(fx), fx, *producer);
  EXPECT_GT(c.matrices, 0);
  EXPECT_EQ(static_cast<size_t>(c.matrices), producer->entries().size());
  EXPECT_TRUE(c.mismatches.empty()) << Describe(c);
}

// The fixture's convention (common/native_layout.h) per its config.json.
const NativeLayout& LayoutOf(const Fixture& fx) {
  static const NativeLayout none{};
  auto cfg = LoadModelConfig(FixtureDir(fx));
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  const NativeLayout* l = cfg.ok() ? FindNativeLayout(cfg->quantization) : nullptr;
  EXPECT_NE(l, nullptr) << fx.dir;
  return l != nullptr ? *l : none;
}

// A copy of the fixture with one byte of `tensor` changed by `edit`.
void CopyWithEdit(const Fixture& fx, const std::string& dst, const std::string& tensor,
                  int64_t byte, const std::function<void(uint8_t*)>& edit) {
  bool found = false;
  ::hmoe::testing::RewriteCheckpoint(
      FixtureDir(fx), dst, [&](const std::string& name, const Tensor& t, SafetensorsWriter& w) {
        if (name != tensor) return ::hmoe::testing::Keep(name, t, w);
        std::vector<uint8_t> bytes(static_cast<const uint8_t*>(t.raw()),
                                   static_cast<const uint8_t*>(t.raw()) + t.nbytes());
        edit(&bytes[static_cast<size_t>(byte)]);
        EXPECT_TRUE(w.Add(name, t.dtype(), t.shape(), bytes.data(), bytes.size()).ok());
        found = true;
        return true;
      });
  ASSERT_TRUE(found) << tensor;
}

// The comparison can fail: one code changed in a copy is exactly one element
// off (the low nibble / byte of the first stored word is element (0, 0)).
TEST_P(ProducerFixtureTest, OneCodeChangedIsCaught) {
  const Fixture& fx = GetParam();
  auto producer = Producer();
  ASSERT_NE(producer, nullptr);
  ::hmoe::testing::TempDir dir;
  const std::string gate = "model.layers.0.mlp.experts.0.gate_proj.weight";
  CopyWithEdit(fx, dir.path(), NativeTensorName(gate, LayoutOf(fx).codes), 0, [&](uint8_t* b) {
    if (fx.format == WeightFormat::kInt4Bf16 || fx.format == WeightFormat::kMxfp4)
      *b ^= 0x01;  // the low nibble: element (0, 0)
    else
      *b ^= 0x08;  // e4m3: the low exponent bit
  });
  const Comparison c = CompareWithProducer(dir.path(), fx, *producer);
  ASSERT_EQ(c.mismatches.size(), 1u) << Describe(c);
  EXPECT_EQ(c.mismatches[0].name, gate);
  EXPECT_EQ(c.mismatches[0].row, 0);
  EXPECT_EQ(c.mismatches[0].col, 0);
}

// One scale changed: every non-zero weight of its group / block is off, no other.
TEST_P(ProducerFixtureTest, OneScaleChangedIsCaught) {
  const Fixture& fx = GetParam();
  auto producer = Producer();
  ASSERT_NE(producer, nullptr);
  ::hmoe::testing::TempDir dir;
  const std::string down = "model.layers.0.mlp.experts.1.down_proj.weight";
  // The first scale's lowest exponent bit (bf16: bit 7; f32: bit 23 in its
  // third byte; e8m0: bit 0); changing the exponent by one keeps it finite.
  const int64_t byte = fx.format == WeightFormat::kFp8 ? 2 : 0;
  CopyWithEdit(fx, dir.path(), NativeTensorName(down, LayoutOf(fx).scales), byte, [&](uint8_t* b) {
    *b ^= fx.format == WeightFormat::kInt4Bf16 ? 0x80
          : fx.format == WeightFormat::kFp8    ? 0x80
                                               : 0x01;
  });
  const Comparison c = CompareWithProducer(dir.path(), fx, *producer);
  ASSERT_FALSE(c.mismatches.empty());
  const int64_t block_rows = fx.format == WeightFormat::kFp8 ? fx.group : 1;
  for (const Mismatch& m : c.mismatches) {
    EXPECT_EQ(m.name, down);
    EXPECT_LT(m.row, block_rows);
    EXPECT_LT(m.col, fx.group);
    EXPECT_NE(m.producer, 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Producers, ProducerFixtureTest,
                         ::testing::ValuesIn(::hmoe::testing::ProducerFixtures()),
                         [](const auto& info) { return std::string(info.param.dir); });

}  // namespace
}  // namespace hmoe
