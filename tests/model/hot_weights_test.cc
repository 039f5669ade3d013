// The hot experts' GPU weights (gpu_worker/hot_weights.h): the kernel
// layout keeps every value (int4 nibbles unpack to the quantized values),
// and the loaded experts are the checkpoint's, quantized within their
// format's error; placements of another model are refused.
#include "gpu_worker/hot_weights.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "common/weight_map.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

using testing::ModelFixturesRoot;

TEST(HotWeights, KernelLayoutKeepsEveryValue) {
  QuantMatrix m;
  m.format = WeightFormat::kInt4;
  m.group = 32;
  m.rows = 3;
  m.cols = 7;  // odd: the last byte of a row holds one value
  for (int64_t i = 0; i < m.rows * m.cols; ++i) m.q.push_back(static_cast<int8_t>(i % 16 - 8));
  m.scale = {0.5f, 0.25f, 2.0f};
  const HostQuantMatrix h = ToKernelLayout(m);
  EXPECT_EQ(h.format, WeightFormat::kInt4);
  ASSERT_EQ(h.w.size(), 3u * 4u);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const int b = h.w[static_cast<size_t>(r * 4 + c / 2)];
      int v = c % 2 == 0 ? (b & 0xF) : (b >> 4);
      v = v >= 8 ? v - 16 : v;
      EXPECT_EQ(v, m.q[static_cast<size_t>(r * m.cols + c)]) << r << "," << c;
    }
  EXPECT_EQ(h.w[3] >> 4, 0) << "the pad nibble is zero";
  EXPECT_EQ(h.scale, m.scale);
  QuantMatrix i8 = m;
  i8.format = WeightFormat::kInt8;
  const HostQuantMatrix h8 = ToKernelLayout(i8);
  EXPECT_EQ(h8.format, WeightFormat::kInt8);
  ASSERT_EQ(h8.w.size(), i8.q.size());
  EXPECT_EQ(std::memcmp(h8.w.data(), i8.q.data(), i8.q.size()), 0);
  QuantMatrix b16;
  b16.format = WeightFormat::kBf16;
  b16.rows = 1;
  b16.cols = 3;
  b16.bf16 = {0x3f80, 0x4000, 0xbf80};
  const HostQuantMatrix hb = ToKernelLayout(b16);
  EXPECT_EQ(hb.format, WeightFormat::kBf16);
  ASSERT_EQ(hb.w.size(), 6u);
  EXPECT_EQ(std::memcmp(hb.w.data(), b16.bf16.data(), 6), 0);
}

TEST(HotWeights, LoadedExpertsAreTheCheckpointsWithinTheirFormatsError) {
  const std::string dir = ModelFixturesRoot() + "/qwen3_moe_tiny";
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  int layer = 0;
  while (!config->layers[static_cast<size_t>(layer)].moe) ++layer;
  Placement p;
  p.model_type = config->model_type;
  p.num_experts = config->moe.num_experts;
  p.hot[layer] = {0, 3};
  const int64_t H = config->hidden_size, I = config->moe.intermediate_size;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kInt8, WeightFormat::kInt4}) {
    SCOPED_TRACE(std::string(WeightFormatName(f)));
    auto hot = LoadHotExperts(**ckpt, *config, p, f, 32);
    ASSERT_TRUE(hot.ok()) << hot.status();
    ASSERT_EQ(hot->size(), 2u);
    for (const HotExpertWeights& h : *hot) {
      EXPECT_EQ(h.layer, layer);
      EXPECT_EQ(h.gate.rows, I);
      EXPECT_EQ(h.gate.cols, H);
      EXPECT_EQ(h.down.rows, H);
      EXPECT_EQ(h.down.cols, I);
      EXPECT_GT(h.bytes(), 0);
      EXPECT_EQ(h.bytes(), HotExpertBytes(*config, f, 32));
      // gate against the checkpoint's tensor, value by value.
      auto t = (*ckpt)->Get(ExpertWeightName(*config, layer, h.expert, ExpertProj::kGate));
      ASSERT_TRUE(t.ok()) << t.status();
      const std::vector<float> w = t->ToF32();
      for (int64_t r = 0; r < I; ++r)
        for (int64_t c = 0; c < H; ++c) {
          const float want = w[static_cast<size_t>(r * H + c)];
          float got = 0, tol = 0;
          if (h.gate.format == WeightFormat::kBf16) {
            uint16_t b;
            std::memcpy(&b, h.gate.w.data() + (r * H + c) * 2, 2);
            got = Bf16ToF32(b);
            tol = std::fabs(want) * 1e-2f;  // bf16 of the checkpoint's value
          } else if (h.gate.format == WeightFormat::kInt8) {
            const float s = h.gate.scale[static_cast<size_t>(r)];
            got =
                static_cast<float>(static_cast<int8_t>(h.gate.w[static_cast<size_t>(r * H + c)])) *
                s;
            tol = s * 0.5f + 1e-7f;
          } else {
            const int64_t ng = (H + 31) / 32;
            const float s = h.gate.scale[static_cast<size_t>(r * ng + c / 32)];
            const int b = h.gate.w[static_cast<size_t>(r * ((H + 1) / 2) + c / 2)];
            int v = c % 2 == 0 ? (b & 0xF) : (b >> 4);
            v = v >= 8 ? v - 16 : v;
            got = static_cast<float>(v) * s;
            tol = s * 0.5f + 1e-7f;
          }
          ASSERT_LE(std::fabs(got - want), tol)
              << "expert " << h.expert << " [" << r << "," << c << "]";
        }
    }
  }
  Placement other = p;
  other.model_type = "deepseek_v3";
  EXPECT_EQ(LoadHotExperts(**ckpt, *config, other, WeightFormat::kInt8, 32).status().code(),
            absl::StatusCode::kFailedPrecondition);
  other = p;
  other.hot[config->num_layers + 1] = {0};
  EXPECT_EQ(LoadHotExperts(**ckpt, *config, other, WeightFormat::kInt8, 32).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace hmoe
