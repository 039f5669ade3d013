#include "common/dtype.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hmoe {
namespace {

// Independent bf16 reference: round f32 to 8 significant bits (ties to even)
// through double arithmetic, not bit tricks.
float RoundToBf16Reference(float x) {
  if (std::isnan(x) || std::isinf(x) || x == 0.0f) return x;
  int e;
  std::frexp(static_cast<double>(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  const double step =
      std::ldexp(1.0, std::max(e - 8, -133));  // 8 significant bits; subnormal step 2^-133
  double q = std::nearbyint(static_cast<double>(x) / step) * step;
  if (std::fabs(q) > static_cast<double>(std::numeric_limits<float>::max()))
    return std::copysign(INFINITY, x);
  return static_cast<float>(q);
}

TEST(DType, NamesRoundTrip) {
  for (auto t : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
                 DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16, DType::kI8, DType::kU8,
                 DType::kBool, DType::kU16, DType::kU32, DType::kU64}) {
    auto parsed = ParseDType(DTypeName(t));
    ASSERT_TRUE(parsed.has_value()) << DTypeName(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_FALSE(ParseDType("F4").has_value());
  EXPECT_FALSE(ParseDType("I4").has_value());  // ours, not a safetensors dtype
  EXPECT_EQ(DTypeBytes(DType::kI4, 7), 4);
  EXPECT_EQ(DTypeBytes(DType::kBF16, 7), 14);
  // The unsigned safetensors dtypes (a tokenizer's or a buffer's tensor in a
  // checkpoint must not make the file unreadable).
  EXPECT_EQ(ParseDType("U32"), DType::kU32);
  EXPECT_EQ(DTypeBytes(DType::kU64, 3), 24);
  EXPECT_EQ(DTypeBytes(DType::kU16, 3), 6);
}

TEST(DType, Bf16RoundToNearestEven) {
  // Exact ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 -> even (1.0).
  EXPECT_EQ(F32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 lies halfway between 1+2^-7 (odd) and 1+2^-6 (even) -> up.
  EXPECT_EQ(F32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(F32ToBf16(INFINITY), 0x7f80);
  EXPECT_EQ(F32ToBf16(-INFINITY), 0xff80);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::nanf("")))));
  // Largest finite f32 rounds up to inf.
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    float x = BitsF32(bits(rng));
    if (std::isnan(x)) continue;
    float want = RoundToBf16Reference(x);
    ASSERT_EQ(F32Bits(Bf16ToF32(F32ToBf16(x))), F32Bits(want)) << x;
  }
  // Every bf16 value round-trips.
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = Bf16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToBf16(f), h);
  }
}

TEST(DType, F16AllCodesRoundTripAndRounding) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(f))));
      continue;
    }
    ASSERT_EQ(F32ToF16(f), h) << std::hex << h;
  }
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);                          // rounds to inf
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);             // tie between 0 and min subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);
}

// All 256 e4m3fn codes against the format definition.
TEST(DType, Fp8E4M3AllCodes) {
  int nan_count = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = Fp8E4M3ToF32(static_cast<uint8_t>(c));
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v)) << c;
      ++nan_count;
      continue;
    }
    const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
    EXPECT_EQ(v, static_cast<float>(s ? -mag : mag)) << c;
    // Encoding the decoded value gives the code back (except -0 -> -0 which is 0x80).
    EXPECT_EQ(F32ToFp8E4M3(v), c) << c;
  }
  EXPECT_EQ(nan_count, 2);
  EXPECT_EQ(Fp8E4M3ToF32(0x7e), 448.0f);
  EXPECT_EQ(F32ToFp8E4M3(1e9f), 0x7e);  // saturates
  EXPECT_EQ(F32ToFp8E4M3(-500.0f), 0xfe);
  // Halfway between 1.0 (0x38) and 1.125 (0x39) -> even mantissa (0x38); 1.1875 -> 0x3a.
  EXPECT_EQ(F32ToFp8E4M3(1.0625f), 0x38);
  EXPECT_EQ(F32ToFp8E4M3(1.1875f), 0x3a);
  // Nearest code for arbitrary values: brute force over all codes.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-460.0f, 460.0f);
  for (int i = 0; i < 20000; ++i) {
    float x = u(rng) * (i % 3 == 0 ? 0.001f : 1.0f);
    uint8_t got = F32ToFp8E4M3(x);
    float best = INFINITY;
    for (int c = 0; c < 256; ++c) {
      float v = Fp8E4M3ToF32(static_cast<uint8_t>(c));
      if (!std::isnan(v)) best = std::min(best, std::fabs(v - x));
    }
    ASSERT_LE(std::fabs(Fp8E4M3ToF32(got) - x), std::max(best, std::fabs(x) - 448.0f) + 0.0f) << x;
  }
}

TEST(DType, Fp8BlockDequant) {
  // 130 x 260 weight: scale grid 2 x 3, partial edge blocks.
  const int64_t rows = 130, cols = 260;
  std::vector<uint8_t> w(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = static_cast<uint8_t>((i * 37) % 256 == 0x7f ? 1 : (i * 37) % 126);
  std::vector<float> s = {1, 2, 3, 4, 5, 6};
  std::vector<float> out(w.size());
  DequantFp8BlockToF32(w.data(), rows, cols, s.data(), 128, out.data());
  for (int64_t r : {0L, 127L, 128L, 129L})
    for (int64_t c : {0L, 127L, 128L, 255L, 256L, 259L})
      EXPECT_EQ(out[static_cast<size_t>(r * cols + c)],
                Fp8E4M3ToF32(w[static_cast<size_t>(r * cols + c)]) *
                    s[static_cast<size_t>((r / 128) * 3 + c / 128)]);
}

TEST(DType, Int4PackAndQuantize) {
  std::vector<uint8_t> p(4, 0);
  for (int i = 0; i < 8; ++i) PackI4(p.data(), i, i - 4);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(UnpackI4(p.data(), i), i - 4);
  EXPECT_EQ(p[0], 0xdc);  // element0 = -4 (0xc) low, element1 = -3 (0xd) high

  const int64_t rows = 3, cols = 128, group = 64;
  std::vector<float> w(rows * cols);
  std::mt19937 rng(1);
  std::normal_distribution<float> n;
  for (auto& x : w) x = n(rng);
  std::vector<uint8_t> q(rows * cols / 2);
  std::vector<float> sc(rows * cols / group);
  QuantizeI4PerGroup(w.data(), rows, cols, group, q.data(), sc.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    float deq = UnpackI4(q.data(), i) * sc[static_cast<size_t>(i / group)];
    EXPECT_LE(std::fabs(deq - w[static_cast<size_t>(i)]),
              sc[static_cast<size_t>(i / group)] * 0.5f + 1e-6f);
  }
  std::vector<int8_t> q8(rows * cols);
  std::vector<float> s8(rows);
  QuantizeI8PerRow(w.data(), rows, cols, q8.data(), s8.data());
  for (int64_t i = 0; i < rows * cols; ++i)
    EXPECT_LE(std::fabs(q8[static_cast<size_t>(i)] * s8[static_cast<size_t>(i / cols)] -
                        w[static_cast<size_t>(i)]),
              s8[static_cast<size_t>(i / cols)] * 0.5f + 1e-6f);
}

// Rows and groups so small that 1/scale overflows quantize to zeros with
// scale 0 (before: inf inverse scales, 2x errors and NaN casts); a normal
// row beside them is untouched.
TEST(Quantize, TinyRowsAndGroupsGiveZerosNotOverflow) {
  const int64_t cols = 64;
  std::vector<float> w(2 * cols, 0.0f);
  w[0] = 1e-38f;
  w[2] = 5e-39f;
  w[3] = -3e-39f;
  for (int64_t c = 0; c < cols; ++c) w[static_cast<size_t>(cols + c)] = 0.01f * (c - 32);
  std::vector<int8_t> q8(w.size());
  std::vector<float> s8(2);
  QuantizeI8PerRow(w.data(), 2, cols, q8.data(), s8.data());
  EXPECT_EQ(s8[0], 0.0f);
  for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(q8[static_cast<size_t>(c)], 0) << c;
  EXPECT_FLOAT_EQ(s8[1], 0.32f / 127.0f);
  EXPECT_EQ(q8[static_cast<size_t>(cols)], -127);
  std::vector<uint8_t> q4(w.size() / 2);
  std::vector<float> s4(4);
  QuantizeI4PerGroup(w.data(), 2, cols, 32, q4.data(), s4.data());
  EXPECT_EQ(s4[0], 0.0f);
  for (int64_t c = 0; c < 32; ++c) EXPECT_EQ(UnpackI4(q4.data(), c), 0) << c;
  EXPECT_FLOAT_EQ(s4[2], 0.32f / 7.0f);
  EXPECT_EQ(UnpackI4(q4.data(), cols), -7);
}

}  // namespace
}  // namespace hmoe
