// KernelSet activation quantization (quant_bf16 / quant_f32, moe.h numerics)
// in every ISA this CPU runs: equal to the scalar twin on odd lengths, and a
// row of zeros and subnormals (amax / 127 below FLT_MIN) quantizes to zeros
// with zero group sums, never inf / NaN products.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/packed.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe {
namespace {

using testing::SetsOnThisCpu;

TEST(QuantTest, MatchesScalarOnOddLengths) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const auto& ks : SetsOnThisCpu())
    for (int64_t n : {1, 15, 16, 17, 63, 64, 65, 200}) {
      const int64_t kp = RoundUp(n, 64);
      std::vector<uint16_t> x(static_cast<size_t>(n));
      for (auto& v : x) v = F32ToBf16(nd(rng));
      std::vector<int8_t> q(static_cast<size_t>(kp), 99), want(q.size(), 99);
      std::vector<int32_t> gs(static_cast<size_t>(kp / 32), -1), want_gs(gs.size(), -1);
      float s = -1, want_s = -1;
      ks.set->quant_bf16(x.data(), n, kp, q.data(), &s, gs.data(), 32);
      kern::QuantBf16Scalar(x.data(), n, kp, want.data(), &want_s, want_gs.data(), 32);
      EXPECT_EQ(s, want_s) << ks.name << " n=" << n;
      EXPECT_EQ(q, want) << ks.name << " n=" << n;
      EXPECT_EQ(gs, want_gs) << ks.name << " n=" << n;
    }
}

TEST(QuantTest, SubnormalRowQuantizesToZeros) {
  constexpr int64_t n = 37, kp = 64;
  std::vector<uint16_t> x(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < n; i += 3)
    x[static_cast<size_t>(i)] = i % 2 ? 0x8001 : 0x0001;  // +-9e-41
  for (const auto& ks : SetsOnThisCpu()) {
    std::vector<int8_t> q(static_cast<size_t>(kp), 99);
    std::vector<int32_t> gs(2, -1);
    float s = -1;
    ks.set->quant_bf16(x.data(), n, kp, q.data(), &s, gs.data(), 32);
    EXPECT_TRUE(std::isfinite(s) && s >= 0) << ks.name << ": scale " << s;
    EXPECT_EQ(q, std::vector<int8_t>(q.size(), 0)) << ks.name;
    EXPECT_EQ(gs, std::vector<int32_t>(gs.size(), 0)) << ks.name;
    // The f32 path (h rows) with the same rule for its inverse scale.
    std::vector<float> xf(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      xf[static_cast<size_t>(i)] = Bf16ToF32(x[static_cast<size_t>(i)]);
    const float amax = ks.set->amax_f32(xf.data(), n);
    EXPECT_EQ(Int8InvScale(amax / 127.0f), 0.0f) << ks.name;
    std::vector<int8_t> qf(static_cast<size_t>(kp), 99);
    ks.set->quant_f32(xf.data(), n, kp, Int8InvScale(amax / 127.0f), qf.data(), nullptr, 32);
    EXPECT_EQ(qf, std::vector<int8_t>(qf.size(), 0)) << ks.name;
  }
  EXPECT_GT(Int8InvScale(std::numeric_limits<float>::min()), 0.0f);
  EXPECT_EQ(Int8InvScale(0.0f), 0.0f);
  EXPECT_EQ(Int8InvScale(2.0f), 0.5f);
}

}  // namespace
}  // namespace hmoe
