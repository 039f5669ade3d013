// The elementwise kernels (gpu_worker/cuda/elementwise_kernels.h): bf16 conversions, embedding, add
// + RMSNorm, RoPE, SiLU * up, bias, accumulate and row gathers, against a plain CPU reference
// (hmoe::cpu ops where one exists, a scalar loop here otherwise), on many shapes, odd ones
// included. Skips without a usable CUDA device.
#include "gpu_worker/cuda/elementwise_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_worker/cpu/ops.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

TEST(GpuKernelTest, Bf16Conversions) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  std::vector<float> special = {0.0f,
                                -0.0f,
                                1.0f,
                                -1.0f,
                                1.00390625f /* tie to even */,
                                1.01171875f /* tie to odd: rounds up */,
                                1.0f + 1e-7f,
                                3.0e38f,
                                3.4028235e38f,
                                INFINITY,
                                -INFINITY,
                                NAN,
                                -NAN,
                                1e-40f /* subnormal */,
                                -3e-39f,
                                65504.0f,
                                1.17549435e-38f};
  uint32_t snan = 0x7f800001u;  // signalling NaN whose top half would read as inf
  float f;
  std::memcpy(&f, &snan, 4);
  special.push_back(f);
  for (size_t n : {size_t{1}, size_t{7}, size_t{33}, size_t{1000}, size_t{100003}}) {
    std::vector<float> x = Random(n, rng, -100.0f, 100.0f);
    for (size_t i = 0; i < std::min(n, special.size()); ++i) x[i] = special[i];
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint16_t> dy(n);
    Check(ToBf16(dx.get(), static_cast<int64_t>(n), dy.get(), nullptr));
    const std::vector<uint16_t> y = dy.Download();
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(y[i], HostBf16(x[i])) << "n " << n << " i " << i << " x " << x[i];
      if (std::isnan(x[i])) {
        ASSERT_TRUE(std::isnan(HostBf16ToF(y[i])));
      }
    }
  }
  // Every bf16 pattern back to f32.
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), 0);
  for (size_t n : {size_t{1}, size_t{129}, size_t{65536}}) {
    std::vector<uint16_t> x(all.begin(), all.begin() + static_cast<int64_t>(n));
    DeviceBuffer<uint16_t> dx(x);
    DeviceBuffer<float> dy(n);
    Check(Bf16ToF32(dx.get(), static_cast<int64_t>(n), dy.get(), nullptr));
    const std::vector<float> y = dy.Download();
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(y[i]), static_cast<uint32_t>(x[i]) << 16);
    }
  }
}

TEST(GpuKernelTest, EmbedRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(2);
  const int64_t rows = 50;
  for (int64_t cols : {1, 7, 129, 1000}) {
    const std::vector<uint16_t> table = RandomBf16(rows * cols, rng);
    DeviceBuffer<uint16_t> dt(table);
    for (int64_t T : {1, 3, 17, 300}) {
      std::vector<int32_t> ids(T);
      for (auto& id : ids) id = static_cast<int32_t>(rng() % rows);
      DeviceBuffer<int32_t> di(ids);
      DeviceBuffer<float> dout(T * cols);
      Check(EmbedRows(dt.get(), cols, di.get(), T, dout.get(), nullptr));
      const std::vector<float> out = dout.Download();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(out[t * cols + c], HostBf16ToF(table[ids[t] * cols + c]))
              << "cols " << cols << " T " << T;
        }
      }
    }
  }
}

TEST(GpuKernelTest, AddRmsNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {1, 7}, {3, 33}, {17, 129}, {64, 1000}, {300, 7}, {1, 7168}, {5, 5000}, {300, 256}};
  for (auto [rows, n] : shapes) {
    for (int mode = 0; mode < 4; ++mode) {  // 0 plain, 1 add, 2 in place + add, 3 bf16 only
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " n " << n << " mode " << mode);
      const std::vector<float> x0 = Random(rows * n, rng, -3.0f, 3.0f);
      const std::vector<float> add = Random(rows * n, rng);
      const std::vector<float> w = Random(n, rng, 0.5f, 1.5f);
      const float eps = 1e-6f;
      std::vector<float> xs = x0;
      if (mode != 0)
        for (size_t i = 0; i < xs.size(); ++i) xs[i] = x0[i] + add[i];
      std::vector<float> want(rows * n);
      cpu::RmsNorm(xs.data(), rows, n, w.data(), eps, want.data());

      DeviceBuffer<float> dx(x0), dadd(add), dw(w), dh(rows * n);
      DeviceBuffer<uint16_t> dh16(rows * n);
      float* h = mode == 2 ? dx.get() : mode == 3 ? nullptr : dh.get();
      Check(AddRmsNorm(dx.get(), mode == 0 ? nullptr : dadd.get(), rows, n, dw.get(), eps, h,
                       mode == 0 ? nullptr : dh16.get(), nullptr));
      const std::vector<float> x = dx.Download();
      if (mode == 2) {
        EXPECT_LE(Nmse(x, want), kNmse);
      } else {
        EXPECT_EQ(x, xs);  // x + add is one rounded add either way
        if (mode != 3) {
          EXPECT_LE(Nmse(dh.Download(), want), kNmse);
        }
      }
      if (mode != 0) ExpectBf16Near(dh16.Download(), want, "h_bf16");
    }
  }
}

TEST(GpuKernelTest, ApplyRope) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  struct Case {
    int64_t T, heads, dim, offset, pad;
  };
  const std::vector<Case> cases = {{1, 1, 2, 0, 0},   {3, 3, 8, 5, 1},    {17, 8, 64, 128, 0},
                                   {64, 2, 72, 0, 3}, {300, 4, 64, 7, 2}, {1, 128, 64, 128, 0},
                                   {5, 1, 6, 1, 1}};
  for (const Case& c : cases) {
    for (bool inter : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.T << " heads " << c.heads << " dim " << c.dim
                                        << " interleaved " << inter);
      const int64_t head_stride = c.offset + c.dim + c.pad;
      const int64_t tok_stride = c.heads * head_stride + c.pad;
      std::vector<float> x = Random(c.T * tok_stride, rng, -2.0f, 2.0f);
      std::vector<int64_t> pos(c.T);
      for (auto& p : pos) p = static_cast<int64_t>(rng() % 5000);
      const std::vector<float> cs = CosSinRows(pos, c.dim, 0.9f);
      DeviceBuffer<float> dx(x), dcs(cs);
      Check(ApplyRope(dx.get(), c.T, c.heads, tok_stride, head_stride, c.offset, c.dim, dcs.get(),
                      inter, nullptr));
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t i = 0; i < c.heads; ++i)
          cpu::ApplyRope(x.data() + t * tok_stride + i * head_stride + c.offset, c.dim,
                         cs.data() + t * c.dim,
                         inter ? RopeLayout::kInterleaved : RopeLayout::kHalves);
      const std::vector<float> got = dx.Download();
      EXPECT_LE(Nmse(got, x), kNmse);
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i)
        worst = std::max(worst, std::fabs(double{got[i]} - x[i]));
      EXPECT_LE(worst, 1e-5);
    }
  }
}

TEST(GpuKernelTest, SiluMul) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  for (int64_t T : {1, 3, 17, 300}) {
    for (int64_t I : {1, 7, 33, 129, 1000}) {
      const std::vector<float> gu = Random(T * 2 * I, rng, -8.0f, 8.0f);
      DeviceBuffer<float> dgu(gu);
      DeviceBuffer<uint16_t> dout(T * I);
      Check(SiluMul(dgu.get(), T, I, dout.get(), nullptr));
      std::vector<float> want(T * I);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < I; ++i)
          want[t * I + i] = cpu::Silu(gu[t * 2 * I + i]) * gu[t * 2 * I + I + i];
      ExpectBf16Near(dout.Download(), want, "silu_mul T " + std::to_string(T));
    }
  }
}

TEST(GpuKernelTest, AddBiasAccumulateGather) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  for (int64_t T : {1, 3, 17, 300}) {
    for (int64_t N : {1, 7, 33, 129, 1000}) {
      SCOPED_TRACE(::testing::Message() << "T " << T << " N " << N);
      std::vector<float> y = Random(T * N, rng);
      const std::vector<float> b = Random(N, rng);
      DeviceBuffer<float> dy(y), db(b);
      Check(AddBias(dy.get(), T, N, db.get(), nullptr));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) y[t * N + n] += b[n];
      EXPECT_EQ(dy.Download(), y);

      const int64_t n = T * N;
      std::vector<float> x = Random(n, rng);
      const std::vector<float> a1 = Random(n, rng), a2 = Random(n, rng);
      DeviceBuffer<float> dx(x), da1(a1), da2(a2);
      Check(Accumulate(dx.get(), da1.get(), nullptr, n, nullptr));
      for (int64_t i = 0; i < n; ++i) x[i] += a1[i];
      EXPECT_EQ(dx.Download(), x);
      Check(Accumulate(dx.get(), da1.get(), da2.get(), n, nullptr));
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] + a1[i] + a2[i];
      EXPECT_EQ(dx.Download(), x);

      // Gather N-wide rows of a [T, N] matrix.
      std::vector<int32_t> rows(T + 5);
      for (auto& r : rows) r = static_cast<int32_t>(rng() % T);
      DeviceBuffer<int32_t> drows(rows);
      DeviceBuffer<float> dg(rows.size() * N);
      Check(GatherRows(dy.get(), N, drows.get(), static_cast<int64_t>(rows.size()), dg.get(),
                       nullptr));
      std::vector<float> want(rows.size() * N);
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy(y.begin() + rows[i] * N, y.begin() + (rows[i] + 1) * N, want.begin() + i * N);
      EXPECT_EQ(dg.Download(), want);
    }
  }
}

}  // namespace
}  // namespace hmoe::cuda
