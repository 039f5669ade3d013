// common/kv_quant.h: the KV cache's encodings against plain references (a
// nearest-code search over every e4m3fn value; dtype.h's conversions).
#include "common/kv_quant.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

// e4m3fn by search: the finite code nearest to f (ties: the even code, i.e.
// the one with an even mantissa), saturating to +-448.
uint8_t NearestE4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(f));
  uint8_t best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const double v = Fp8E4M3ToF32(static_cast<uint8_t>(c));
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(KvQuant, E4m3DecodesEveryCodeAsDtype) {
  for (int c = 0; c < 256; ++c) {
    const float want = Fp8E4M3ToF32(static_cast<uint8_t>(c));
    const float got = KvFromE4m3(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(F32Bits(got), F32Bits(want)) << c;
    }
  }
}

TEST(KvQuant, E4m3EncodesAsTheNearestCode) {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           448.0f,
                           -448.0f,
                           447.9f,
                           464.0f,
                           1e30f,
                           -1e30f,
                           INFINITY,
                           -INFINITY,
                           1e-40f,
                           -1e-40f,
                           0.0009765625f /* 2^-10: tie 0 / 2^-9 */,
                           0.0029296875f /* 1.5 * 2^-9 */,
                           0.015625f /* 2^-6 */,
                           0.0146484375f /* 7.5 * 2^-9: tie 7 / 8 */,
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min()};
  // Every code's value, the midpoints between neighbours and a step either side.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = Fp8E4M3ToF32(static_cast<uint8_t>(c));
    const float hi = Fp8E4M3ToF32(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  // A sweep over the f32 bit patterns of the e4m3 range and beyond.
  for (uint32_t u = 0x30000000u; u < 0x44000000u; u += 0x1357u) xs.push_back(BitsF32(u));
  for (float x : xs) {
    EXPECT_EQ(KvToE4m3(x), NearestE4m3(x)) << x;
    EXPECT_EQ(KvToE4m3(x), F32ToFp8E4M3(x)) << x;
  }
  EXPECT_EQ(KvToE4m3(NAN) & 0x7f, 0x7f);
}

TEST(KvQuant, Bf16AsDtype) {
  for (uint32_t u = 0; u < 0xfff00000u; u += 0x00012345u) {
    const float x = BitsF32(u);
    EXPECT_EQ(KvToBf16(x), F32ToBf16(x)) << u;
    EXPECT_EQ(F32Bits(KvFromBf16(KvToBf16(x))), F32Bits(Bf16ToF32(F32ToBf16(x)))) << u;
  }
  EXPECT_EQ(KvToBf16(1.0f + 1.0f / 256), 0x3f80);  // tie: to even (down)
  EXPECT_EQ(KvToBf16(1.0f + 3.0f / 256), 0x3f82);  // tie: to even (up)
}

TEST(KvQuant, Fp8PartScalesByItsLargestMagnitude) {
  // amax 448: scale 1, values stored as their own codes.
  std::vector<float> x = {448.0f, -448.0f, 1.0f, -0.5f, 3.0f, 0.0f};
  std::vector<uint8_t> q(x.size());
  EXPECT_EQ(KvEncodeFp8Part(x.data(), static_cast<int64_t>(x.size()), q.data()), 1.0f);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(q[i], NearestE4m3(x[i])) << i;
  EXPECT_EQ(q[0], 0x7e);
  EXPECT_EQ(q[1], 0xfe);

  // A general part: scale amax / 448; the amax element reads back exactly
  // (448 * scale), the others within half a step of e4m3 (2^-4 relative).
  std::vector<float> y = {0.3f, -1.7f, 2.25f, 1e-6f, -0.01f, 0.9f};
  std::vector<uint8_t> qy(y.size());
  const float s = KvEncodeFp8Part(y.data(), static_cast<int64_t>(y.size()), qy.data());
  EXPECT_EQ(s, 2.25f / 448.0f);
  for (size_t i = 0; i < y.size(); ++i) {
    EXPECT_EQ(qy[i], NearestE4m3(y[i] / s)) << i;
    EXPECT_LE(std::fabs(KvFp8Value(qy[i], s) - y[i]),
              std::max(std::fabs(y[i]) / 16, s * 0.001953125f / 2) * 1.0001f)
        << i;
  }
  EXPECT_EQ(KvFp8Value(qy[2], s), 2.25f);

  // Zero rows and an amax whose scale underflows store zeros (scale 0).
  std::vector<float> z = {0.0f, -0.0f, 0.0f};
  std::vector<uint8_t> qz(z.size(), 0xaa);
  EXPECT_EQ(KvEncodeFp8Part(z.data(), 3, qz.data()), 0.0f);
  for (uint8_t c : qz) EXPECT_EQ(c, 0);
  const float tiny = std::numeric_limits<float>::denorm_min();
  std::vector<float> d = {tiny, -tiny};
  std::vector<uint8_t> qd(2, 0xaa);
  EXPECT_EQ(KvEncodeFp8Part(d.data(), 2, qd.data()), 0.0f);
  EXPECT_EQ(qd[0], 0);
  EXPECT_EQ(qd[1], 0);
  // Denormal inputs with a normal amax: below the part's smallest step, zero.
  std::vector<float> m = {1.0f, 1e-40f, -1e-39f};
  std::vector<uint8_t> qm(3);
  KvEncodeFp8Part(m.data(), 3, qm.data());
  EXPECT_EQ(qm[1] & 0x7f, 0);
  EXPECT_EQ(qm[2] & 0x7f, 0);
}

TEST(KvQuant, RoundPartIsEncodeThenDecode) {
  std::vector<float> x;
  for (int i = 0; i < 100; ++i) x.push_back(std::sin(0.37f * i) * (1 + i));
  std::vector<float> f32 = x, bf = x, f8 = x;
  KvRoundPart(KvElem::kF32, f32.data(), 100);
  KvRoundPart(KvElem::kBf16, bf.data(), 100);
  KvRoundPart(KvElem::kFp8, f8.data(), 100);
  std::vector<uint8_t> q(100);
  const float s = KvEncodeFp8Part(x.data(), 100, q.data());
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(f32[i], x[i]);
    EXPECT_EQ(bf[i], Bf16ToF32(F32ToBf16(x[i])));
    EXPECT_EQ(f8[i], Fp8E4M3ToF32(q[i]) * s);
  }
}

}  // namespace
}  // namespace hmoe
