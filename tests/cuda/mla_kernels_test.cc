// The MLA kernels (gpu_worker/cuda/mla_kernels.h): latent cache write, query absorption and output
// expansion, against a plain CPU reference (hmoe::cpu ops where one exists, a scalar loop here
// otherwise), on many shapes, odd ones included. Skips without a usable CUDA device.
#include "gpu_worker/cuda/mla_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_worker/cpu/ops.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

TEST(GpuKernelTest, WriteMlaCache) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  struct Case {
    int64_t T, r, rope;
  };
  for (const Case& c : std::vector<Case>{
           {1, 512, 64}, {3, 33, 8}, {17, 7, 6}, {64, 512, 64}, {300, 129, 2}, {5, 1000, 0}}) {
    for (bool inter : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.T << " r " << c.r << " rope " << c.rope);
      const int64_t row = c.r + c.rope, slots = c.T * 2 + 3;
      const std::vector<float> kva = Random(c.T * row, rng, -3.0f, 3.0f);
      const std::vector<float> nw = Random(c.r, rng, 0.5f, 1.5f);
      std::vector<int64_t> pos(c.T);
      for (auto& p : pos) p = static_cast<int64_t>(rng() % 3000);
      const std::vector<float> cs = CosSinRows(pos, c.rope, 1.1f);
      std::vector<int32_t> perm(slots);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int32_t> slot(perm.begin(), perm.begin() + c.T);
      if (c.T > 2) slot[1] = -1;  // skipped
      std::vector<float> cache = Random(slots * row, rng);
      DeviceBuffer<float> dkva(kva), dnw(nw), dcs(cs), dcache(cache);
      DeviceBuffer<int32_t> dslot(slot);
      Check(WriteMlaCache(dkva.get(), c.T, c.r, c.rope, dnw.get(), 1e-6f, dcs.get(), inter,
                          dslot.get(), dcache.get(), nullptr));
      for (int64_t t = 0; t < c.T; ++t) {
        if (slot[t] < 0) continue;
        float* dst = cache.data() + slot[t] * row;
        cpu::RmsNorm(kva.data() + t * row, 1, c.r, nw.data(), 1e-6f, dst);
        std::copy(kva.begin() + t * row + c.r, kva.begin() + (t + 1) * row, dst + c.r);
        if (c.rope > 0)
          cpu::ApplyRope(dst + c.r, c.rope, cs.data() + t * c.rope,
                         inter ? RopeLayout::kInterleaved : RopeLayout::kHalves);
      }
      EXPECT_LE(Nmse(dcache.Download(), cache), kNmse);
    }
  }
}

struct MlaShape {
  int64_t T, nh, nope, rope, vd, r;
};

const std::vector<MlaShape>& MlaShapes() {
  static const std::vector<MlaShape> shapes = {
      {1, 128, 128, 64, 128, 512},  // ds-v3 decode
      {3, 16, 128, 64, 128, 512},  {8, 4, 128, 64, 128, 512}, {17, 3, 33, 7, 20, 40},
      {32, 2, 128, 64, 128, 512},  {33, 5, 24, 0, 8, 37},     {64, 2, 16, 8, 16, 72},
      {300, 2, 64, 16, 32, 128},   {129, 1, 7, 2, 1, 1},      {1, 1, 1, 1, 1, 1000},
  };
  return shapes;
}

TEST(GpuKernelTest, MlaAbsorbQuery) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  for (const MlaShape& s : MlaShapes()) {
    SCOPED_TRACE(::testing::Message() << "T " << s.T << " nh " << s.nh << " nope " << s.nope
                                      << " rope " << s.rope << " vd " << s.vd << " r " << s.r);
    const int64_t qk = s.nope + s.rope, orow = s.r + s.rope;
    const std::vector<float> q = Random(s.T * s.nh * qk, rng);
    const std::vector<uint16_t> w = RandomBf16(s.nh * (s.nope + s.vd) * s.r, rng);
    DeviceBuffer<float> dq(q), dout(s.T * s.nh * orow);
    DeviceBuffer<uint16_t> dw(w);
    Check(MlaAbsorbQuery(dq.get(), dw.get(), s.T, s.nh, s.nope, s.rope, s.vd, s.r, dout.get(),
                         nullptr));
    std::vector<float> want(s.T * s.nh * orow, 0.0f);
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.nh; ++h) {
        const float* qh = q.data() + t * s.nh * qk + h * qk;
        float* o = want.data() + t * s.nh * orow + h * orow;
        for (int64_t j = 0; j < s.nope; ++j) {
          const uint16_t* wr = w.data() + (h * (s.nope + s.vd) + j) * s.r;
          for (int64_t c = 0; c < s.r; ++c) o[c] += qh[j] * HostBf16ToF(wr[c]);
        }
        for (int64_t i = 0; i < s.rope; ++i) o[s.r + i] = qh[s.nope + i];
      }
    EXPECT_LE(Nmse(dout.Download(), want), kNmse);
  }
}

TEST(GpuKernelTest, MlaExpandOutput) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(14);
  for (const MlaShape& s : MlaShapes()) {
    const std::vector<float> olat = Random(s.T * s.nh * s.r, rng);
    const std::vector<uint16_t> w = RandomBf16(s.nh * (s.nope + s.vd) * s.r, rng);
    std::vector<float> want(s.T * s.nh * s.vd);
    double ss = 0;
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.nh; ++h)
        for (int64_t d = 0; d < s.vd; ++d) {
          const uint16_t* wr = w.data() + (h * (s.nope + s.vd) + s.nope + d) * s.r;
          const float* l = olat.data() + t * s.nh * s.r + h * s.r;
          double acc = 0;
          for (int64_t c = 0; c < s.r; ++c) acc += double{HostBf16ToF(wr[c])} * l[c];
          want[t * s.nh * s.vd + h * s.vd + d] = static_cast<float>(acc);
          ss += acc * acc;
        }
    // Outputs that cancel to near zero carry the f32 sum's absolute error,
    // which can exceed their bf16 step.
    const double atol = 1e-5 * std::sqrt(ss / static_cast<double>(want.size()));
    DeviceBuffer<float> dl(olat);
    DeviceBuffer<uint16_t> dw(w);
    for (int mode = 0; mode < 3; ++mode) {  // f32, f32 + bf16, bf16 only
      SCOPED_TRACE(::testing::Message() << "T " << s.T << " nh " << s.nh << " vd " << s.vd << " r "
                                        << s.r << " mode " << mode);
      DeviceBuffer<float> dout(s.T * s.nh * s.vd);
      DeviceBuffer<uint16_t> dout16(s.T * s.nh * s.vd);
      Check(MlaExpandOutput(dl.get(), dw.get(), s.T, s.nh, s.nope, s.vd, s.r,
                            mode == 2 ? nullptr : dout.get(), mode == 0 ? nullptr : dout16.get(),
                            nullptr));
      if (mode != 2) {
        EXPECT_LE(Nmse(dout.Download(), want), kNmse);
      }
      if (mode != 0) ExpectBf16Near(dout16.Download(), want, "out_bf16", atol);
      if (mode == 1) {  // the bf16 copy is exactly the f32 output rounded
        const std::vector<float> f = dout.Download();
        const std::vector<uint16_t> b = dout16.Download();
        for (size_t i = 0; i < f.size(); ++i) {
          ASSERT_EQ(b[i], HostBf16(f[i])) << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace hmoe::cuda
