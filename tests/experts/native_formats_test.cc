// The formats checkpoints ship (mxfp4, int4bf16, fp8 128x128 blocks, mxfp8):
// their element and scale codes decode per the OCP Microscaling spec and
// e4m3fn, QuantMatrix::At / DequantizeRow read hand-packed matrices as the
// layouts say, and the quantizers pick the nearest code of the grid.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "common/experts/format_codes.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "tests/testing/random_experts.h"

namespace hmoe {
namespace {

TEST(NativeFormats, E2M1CodesAreTheSpecValues) {
  const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(E2M1ToF32(static_cast<uint8_t>(c)), want[c]) << c;
    EXPECT_EQ(std::signbit(E2M1ToF32(static_cast<uint8_t>(c))), c >= 8) << c;
    EXPECT_EQ(F32ToE2M1(want[c]), c) << c;  // every code round-trips
    EXPECT_EQ(kE2M1Magnitude[c & 7], std::fabs(want[c]));
  }
  // Nearest, ties to the even code; saturating at 6.
  const std::pair<float, float> cases[] = {
      {0.25f, 0.0f},  {0.26f, 0.5f},
      {0.75f, 1.0f},  {1.25f, 1.0f},
      {1.75f, 2.0f},  {2.5f, 2.0f},
      {3.5f, 4.0f},   {5.0f, 4.0f},
      {5.01f, 6.0f},  {7.0f, 6.0f},
      {1e30f, 6.0f},  {-5.0f, -4.0f},
      {-0.3f, -0.5f}, {std::numeric_limits<float>::infinity(), 6.0f}};
  for (auto [in, out] : cases) EXPECT_EQ(E2M1ToF32(F32ToE2M1(in)), out) << in;
}

TEST(NativeFormats, E8M0IsAPowerOfTwoAndFFIsNaN) {
  EXPECT_EQ(E8M0ToF32(127), 1.0f);
  EXPECT_EQ(E8M0ToF32(128), 2.0f);
  EXPECT_EQ(E8M0ToF32(120), 1.0f / 128.0f);
  EXPECT_EQ(E8M0ToF32(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(E8M0ToF32(0), std::ldexp(1.0f, -127));  // an f32 subnormal, not zero
  EXPECT_GT(E8M0ToF32(0), 0.0f);
  EXPECT_TRUE(std::isnan(E8M0ToF32(kE8M0NaN)));
  for (int e = 0; e < 255; ++e) EXPECT_TRUE(std::isfinite(E8M0ToF32(static_cast<uint8_t>(e))));
}

TEST(NativeFormats, E4M3fnHasNoInfinityAndTwoNaNs) {
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToF32(0xFF)));
  EXPECT_EQ(Fp8E4M3ToF32(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0xFE), -448.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x78), 256.0f);  // S.1111.000: a number, not infinity
  EXPECT_EQ(Fp8E4M3ToF32(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToF32(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(Fp8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToF32(0x07), 7.0f * std::ldexp(1.0f, -9));
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = Fp8E4M3ToF32(static_cast<uint8_t>(c));
    EXPECT_FALSE(std::isinf(v)) << c;
    nans += std::isnan(v);
  }
  EXPECT_EQ(nans, 2);
}

QuantMatrix Blank(WeightFormat f, int group, int64_t rows, int64_t cols) {
  QuantMatrix m;
  m.format = f;
  m.group = group;
  m.rows = rows;
  m.cols = cols;
  m.packed.assign(static_cast<size_t>(rows * RowBytes(f, cols)), 0);
  const size_t ns = static_cast<size_t>(ScaleCount(f, group, rows, cols));
  switch (Traits(f).scale_type) {
    case ScaleType::kF32:
      m.scale.assign(ns, 1.0f);
      break;
    case ScaleType::kBf16:
      m.scale_bf16.assign(ns, 0x3F80);  // 1.0
      break;
    case ScaleType::kE8M0:
      m.scale_e8m0.assign(ns, 127);  // 1.0
      break;
    case ScaleType::kNone:
      break;
  }
  return m;
}

void ExpectRowsMatchAt(const QuantMatrix& m) {
  std::vector<float> row(static_cast<size_t>(m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    m.DequantizeRow(r, row.data());
    for (int64_t c = 0; c < m.cols; ++c) ASSERT_EQ(row[static_cast<size_t>(c)], m.At(r, c));
  }
}

TEST(NativeFormats, Mxfp4ReadsNibblesLowFirstTimesTheBlockScale) {
  QuantMatrix m = Blank(WeightFormat::kMxfp4, 32, 2, 64);
  m.packed[0] = 0x7A;        // col 0: 0xA = -1; col 1: 0x7 = 6
  m.packed[16] = 0x03;       // col 32: 1.5; col 33: 0
  m.packed[32 + 31] = 0xD1;  // row 1, col 62: 0.5; col 63: 0xD = -3
  m.scale_e8m0 = {127, 130, 120, 0};
  EXPECT_EQ(m.At(0, 0), -1.0f);
  EXPECT_EQ(m.At(0, 1), 6.0f);
  EXPECT_EQ(m.At(0, 2), 0.0f);
  EXPECT_EQ(m.At(0, 32), 1.5f * 8.0f);
  EXPECT_EQ(m.At(0, 33), 0.0f);
  EXPECT_EQ(m.At(1, 62), 0.5f * std::ldexp(1.0f, -127));
  EXPECT_EQ(m.At(1, 63), -3.0f * std::ldexp(1.0f, -127));
  m.scale_e8m0[3] = 150;
  EXPECT_EQ(m.At(1, 63), -3.0f * std::ldexp(1.0f, 23));
  EXPECT_EQ(m.ScaleAt(0, 40), 8.0f);
  ExpectRowsMatchAt(m);
}

TEST(NativeFormats, Int4Bf16ReadsTwosComplementNibblesTimesBf16Scales) {
  QuantMatrix m = Blank(WeightFormat::kInt4Bf16, 32, 3, 70);  // a tail group of 6
  ASSERT_EQ(m.packed.size(), 3u * 35u);
  ASSERT_EQ(m.scale_bf16.size(), 9u);
  m.packed[0] = 0x8F;            // col 0: -1; col 1: -8
  m.packed[35 + 34] = 0x70;      // row 1, col 68: 0; col 69: 7
  m.scale_bf16[0] = 0x3F00;      // 0.5
  m.scale_bf16[3 + 2] = 0xC040;  // -3 (a negative scale decodes as stored)
  EXPECT_EQ(m.At(0, 0), -0.5f);
  EXPECT_EQ(m.At(0, 1), -4.0f);
  EXPECT_EQ(m.At(1, 69), -21.0f);
  EXPECT_EQ(m.At(1, 68), -0.0f);
  EXPECT_EQ(m.ScaleAt(1, 64), -3.0f);
  ExpectRowsMatchAt(m);
}

TEST(NativeFormats, Fp8ReadsBytesTimesThe2DBlockScale) {
  QuantMatrix m = Blank(WeightFormat::kFp8, 128, 130, 129);
  ASSERT_EQ(m.scale.size(), 4u);  // [2][2]
  m.scale = {1.0f, 2.0f, 0.25f, 3.0f};
  auto set = [&](int64_t r, int64_t c, uint8_t v) {
    m.packed[static_cast<size_t>(r * 129 + c)] = v;
  };
  set(0, 0, 0x38);      // 1.0, block (0, 0)
  set(127, 128, 0xB8);  // -1.0, block (0, 1)
  set(128, 0, 0x7E);    // 448, block (1, 0)
  set(129, 128, 0x01);  // 2^-9, block (1, 1)
  EXPECT_EQ(m.At(0, 0), 1.0f);
  EXPECT_EQ(m.At(127, 128), -2.0f);
  EXPECT_EQ(m.At(128, 0), 112.0f);
  EXPECT_EQ(m.At(129, 128), 3.0f * std::ldexp(1.0f, -9));
  ExpectRowsMatchAt(m);
}

TEST(NativeFormats, Mxfp8ReadsE4M3TimesE8M0PerGroupOf32) {
  QuantMatrix m = Blank(WeightFormat::kMxfp8, 32, 1, 40);
  m.packed[31] = 0x38;  // 1.0, group 0
  m.packed[32] = 0xC0;  // -2.0, group 1
  m.scale_e8m0 = {126, 131};
  EXPECT_EQ(m.At(0, 31), 0.5f);
  EXPECT_EQ(m.At(0, 32), -32.0f);
  ExpectRowsMatchAt(m);
}

// The nearest value of the grid of `f`'s element codes to `v` (ties: either).
float NearestDistance(WeightFormat f, float v) {
  float best = std::numeric_limits<float>::infinity();
  const int codes = Traits(f).value == ValueCode::kE2M1 ? 16 : 256;
  for (int c = 0; c < codes; ++c) {
    const float g = Traits(f).value == ValueCode::kE2M1 ? E2M1ToF32(static_cast<uint8_t>(c))
                                                        : Fp8E4M3ToF32(static_cast<uint8_t>(c));
    if (!std::isnan(g)) best = std::min(best, std::fabs(g - v));
  }
  return best;
}

// Random weights with tails, outliers and an all-zero group: every element is
// the nearest grid value of w / scale (so nothing clips), and the scales are
// as the format's producer sets them.
TEST(NativeFormats, QuantizersPickTheNearestCode) {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 0.05f);
  const int64_t rows = 131, cols = 150;
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (float& x : w) x = d(rng);
  w[5 * cols + 17] = 3.0f;  // an outlier in a group
  for (int64_t c = 32; c < 64; ++c) w[static_cast<size_t>(2 * cols + c)] = 0.0f;
  Tensor t = Tensor::Empty(DType::kF32, {rows, cols});
  for (size_t i = 0; i < w.size(); ++i) t.data<float>()[i] = w[i];
  for (WeightFormat f :
       {WeightFormat::kMxfp4, WeightFormat::kMxfp8, WeightFormat::kFp8, WeightFormat::kInt4Bf16}) {
    SCOPED_TRACE(WeightFormatName(f));
    ExpertWeights ew;
    ew.gate = t;
    ew.up = t;
    Tensor down = Tensor::Empty(DType::kF32, {cols, rows});
    for (int64_t r = 0; r < cols; ++r)
      for (int64_t c = 0; c < rows; ++c) down.data<float>()[r * rows + c] = w[c * cols + r];
    ew.down = down;
    MoeWeightsSource src;
    src.hidden = cols;
    src.intermediate = rows;
    src.num_experts = 1;
    QuantOptions o;
    o.format = f;
    o.group = Traits(f).default_group;
    const QuantMatrix m = QuantizeExpert(ew, src, o).value().gate;
    ExpectRowsMatchAt(m);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float x = w[static_cast<size_t>(r * cols + c)], s = m.ScaleAt(r, c);
        if (f == WeightFormat::kInt4Bf16) {
          if (s == 0.0f) {
            ASSERT_EQ(m.At(r, c), 0.0f);
            continue;
          }
          const float q = m.At(r, c) / s;
          ASSERT_EQ(q, std::nearbyint(q));
          // 0.5, or up to 7.5 * (1 + 2^-8) -> 7 where the bf16 scale rounded down.
          ASSERT_LE(std::fabs(q - x / s), 0.5f + 7.5f / 256.0f) << r << "," << c;
          continue;
        }
        const float v = m.At(r, c) / s;  // exact: s is a power of two or fp8 times f32
        ASSERT_LE(std::fabs(v - x / s) - NearestDistance(f, x / s), 1e-6f * std::fabs(x / s))
            << r << "," << c << " w " << x << " scale " << s;
      }
    // Scales: MX the smallest power of two that clips nothing; fp8 max/448.
    if (f == WeightFormat::kMxfp4 || f == WeightFormat::kMxfp8) {
      const float emax = f == WeightFormat::kMxfp4 ? 6.0f : 448.0f;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g * 32 < cols; ++g) {
          float amax = 0.0f;
          for (int64_t c = g * 32; c < std::min<int64_t>(cols, g * 32 + 32); ++c)
            amax = std::max(amax, std::fabs(w[static_cast<size_t>(r * cols + c)]));
          const float s = m.ScaleAt(r, g * 32);
          if (amax == 0.0f) {
            EXPECT_EQ(m.scale_e8m0[static_cast<size_t>(r * 5 + g)], 0);
            continue;
          }
          EXPECT_LE(amax / s, emax);
          EXPECT_GT(amax / (s / 2.0f), emax);
        }
    }
    if (f == WeightFormat::kFp8) {
      float amax = 0.0f;
      for (int64_t r = 0; r < 128; ++r)
        for (int64_t c = 0; c < 128; ++c)
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(r * cols + c)]));
      EXPECT_EQ(m.scale[0], amax / 448.0f);
      EXPECT_EQ(m.scale.size(), 4u);
    }
  }
}

// Values on the grid come back exactly: what a checkpoint holds survives a
// decode and re-encode.
TEST(NativeFormats, GridValuesRoundTripExactly) {
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kMxfp8}) {
    const int64_t cols = 64;
    std::vector<float> w(static_cast<size_t>(cols));
    const float top = f == WeightFormat::kMxfp4 ? 6.0f : 448.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t code =
          static_cast<uint8_t>(f == WeightFormat::kMxfp4 ? c % 16 : (c * 37) % 256);
      float v = f == WeightFormat::kMxfp4 ? E2M1ToF32(code) : Fp8E4M3ToF32(code);
      if (std::isnan(v)) v = 1.0f;
      w[static_cast<size_t>(c)] = std::ldexp(v, c < 32 ? -3 : 5);
    }
    w[0] = std::ldexp(top, -3);
    w[32] = std::ldexp(-top, 5);
    Tensor t = Tensor::Empty(DType::kF32, {1, cols});
    for (int64_t c = 0; c < cols; ++c) t.data<float>()[c] = w[static_cast<size_t>(c)];
    ExpertWeights ew;
    ew.gate = t;
    ew.up = t;
    ew.down = Tensor::Empty(DType::kF32, {cols, 1});
    for (int64_t c = 0; c < cols; ++c) ew.down.data<float>()[c] = 0.0f;
    MoeWeightsSource src;
    src.hidden = cols;
    src.intermediate = 1;
    src.num_experts = 1;
    QuantOptions o;
    o.format = f;
    o.group = 32;
    const QuantExpert q = QuantizeExpert(ew, src, o).value();
    EXPECT_EQ(q.gate.scale_e8m0, (std::vector<uint8_t>{127 - 3, 127 + 5}));
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(q.gate.At(0, c), w[static_cast<size_t>(c)]) << c;
  }
}

}  // namespace
}  // namespace hmoe
