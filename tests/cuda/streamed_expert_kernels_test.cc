// The streamed-expert kernels (gpu_worker/cuda/streamed_expert_kernels.h): dequantization to bf16
// and the row gathers / scatters around cuBLAS, against a plain CPU reference (hmoe::cpu ops where
// one exists, a scalar loop here otherwise), on many shapes, odd ones included. Skips without a
// usable CUDA device.
#include "gpu_worker/cuda/streamed_expert_kernels.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "expert_service/kernels/moe.h"
#include "gpu_worker/hot_weights.h"
#include "tests/cuda/kernel_test_util.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe::cuda {
namespace {

// and int4 (groups 32 and 64, the even column in the low nibble), odd shapes.
TEST(GpuKernelTest, DequantToBf16) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{3, 37}, {5, 64}, {7, 130}, {1, 1}}) {
    for (const auto& [format, group] : {std::pair<WeightFormat, int>{WeightFormat::kBf16, 0},
                                        {WeightFormat::kInt8, 0},
                                        {WeightFormat::kInt4, 32},
                                        {WeightFormat::kInt4, 64}}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " format "
                                        << WeightFormatName(format) << " group " << group);
      std::vector<uint8_t> w;
      std::vector<float> scale;
      std::vector<uint16_t> want(static_cast<size_t>(rows * cols));
      const int64_t half = (cols + 1) / 2, ng = group > 0 ? (cols + group - 1) / group : 0;
      if (format == WeightFormat::kBf16) {
        const std::vector<uint16_t> b = RandomBf16(want.size(), rng);
        w.resize(b.size() * 2);
        std::memcpy(w.data(), b.data(), w.size());
        want = b;
      } else if (format == WeightFormat::kInt8) {
        w.resize(want.size());
        scale = Random(static_cast<size_t>(rows), rng, 0.001f, 0.1f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int q = static_cast<int>(rng() % 255) - 127;
            w[static_cast<size_t>(r * cols + c)] = static_cast<uint8_t>(static_cast<int8_t>(q));
            want[static_cast<size_t>(r * cols + c)] =
                HostBf16(static_cast<float>(q) * scale[static_cast<size_t>(r)]);
          }
      } else {
        w.assign(static_cast<size_t>(rows * half), 0);
        scale = Random(static_cast<size_t>(rows * ng), rng, 0.001f, 0.1f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int q = static_cast<int>(rng() % 16) - 8;
            w[static_cast<size_t>(r * half + c / 2)] |=
                static_cast<uint8_t>((q & 0xF) << (4 * (c % 2)));
            want[static_cast<size_t>(r * cols + c)] =
                HostBf16(static_cast<float>(q) * scale[static_cast<size_t>(r * ng + c / group)]);
          }
      }
      DeviceBuffer<uint8_t> dw(w);
      DeviceBuffer<float> ds(scale);
      DeviceBuffer<uint16_t> out(want.size());
      DevQuantMatrix m;
      m.format = format;
      m.group = group;
      m.rows = rows;
      m.cols = cols;
      m.w = dw.get();
      m.scale = format == WeightFormat::kBf16 ? nullptr : ds.get();
      Check(DequantToBf16(m, out.get(), nullptr));
      EXPECT_EQ(out.Download(), want);
    }
  }
}

// DequantToBf16 on the native formats (the worker's kernel layout of
// QuantizeExpert's matrices) against bf16(QuantMatrix::At), bit for bit:
// odd shapes, group tails, fp8 blocks cut at both edges.
TEST(GpuKernelTest, DequantToBf16NativeFormats) {
  SKIP_WITHOUT_GPU();
  for (const auto& [format, group] : {std::pair<WeightFormat, int>{WeightFormat::kMxfp4, 32},
                                      {WeightFormat::kInt4Bf16, 32},
                                      {WeightFormat::kInt4Bf16, 128},
                                      {WeightFormat::kFp8, 128},
                                      {WeightFormat::kMxfp8, 32}}) {
    for (const auto& [H, I] : {std::pair<int64_t, int64_t>{37, 5}, {130, 200}, {300, 64}}) {
      SCOPED_TRACE(::testing::Message()
                   << WeightFormatName(format, group) << " H " << H << " I " << I);
      const MoeWeightsSource src = testing::RandomSource(H, I, 1, 5);
      PackOptions po;
      po.format = format;
      po.group = group;
      auto q = QuantizeExpert(*src.expert(0), src, po);
      ASSERT_TRUE(q.ok()) << q.status();
      for (const QuantMatrix* m : {&q->gate, &q->down}) {
        const HostQuantMatrix h = ToKernelLayout(*m);
        std::vector<uint16_t> want(static_cast<size_t>(m->rows * m->cols));
        for (int64_t r = 0; r < m->rows; ++r)
          for (int64_t c = 0; c < m->cols; ++c)
            want[static_cast<size_t>(r * m->cols + c)] = HostBf16(m->At(r, c));
        DeviceBuffer<uint8_t> dw(h.w);
        DeviceBuffer<float> ds(h.scale);
        DeviceBuffer<uint16_t> out(want.size());
        DevQuantMatrix d;
        d.format = h.format;
        d.group = h.group;
        d.rows = h.rows;
        d.cols = h.cols;
        d.w = dw.get();
        d.scale = ds.get();
        Check(DequantToBf16(d, out.get(), nullptr));
        EXPECT_EQ(out.Download(), want);
      }
    }
  }
}

// The streamed experts' data movers: gather rows, weighted scatter into
// slots, the marked slots' sum per token in slot order.
TEST(GpuKernelTest, StreamedExpertsGatherScatterSum) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  const int64_t T = 5, K = 3, H = 19;  // H odd: the unvectorized paths
  for (int64_t cols : {H, int64_t{24}}) {
    const std::vector<uint16_t> x = RandomBf16(static_cast<size_t>(T * cols), rng);
    const std::vector<int32_t> rows = {4, 0, 0, 3, 2};
    DeviceBuffer<uint16_t> dx(x), g(rows.size() * static_cast<size_t>(cols));
    DeviceBuffer<int32_t> dr(rows);
    Check(GatherBf16Rows(dx.get(), cols, dr.get(), static_cast<int64_t>(rows.size()), g.get(),
                         nullptr));
    const std::vector<uint16_t> got = g.Download();
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t c = 0; c < cols; ++c)
        EXPECT_EQ(got[i * static_cast<size_t>(cols) + static_cast<size_t>(c)],
                  x[static_cast<size_t>(rows[i] * cols + c)]);
  }
  // Slots 1, 5, 6, 14 computed (marked); z rows in that order.
  const std::vector<int32_t> slots = {6, 1, 14, 5};
  const std::vector<float> z = Random(slots.size() * H, rng);
  const std::vector<float> w = Random(static_cast<size_t>(T * K), rng, 0.1f, 1.0f);
  DeviceBuffer<float> dz(z), dw(w), ys(static_cast<size_t>(T * K * H)),
      out(static_cast<size_t>(T * H));
  DeviceBuffer<int32_t> ds(slots);
  Check(ScatterWeightedRows(dz.get(), H, ds.get(), static_cast<int64_t>(slots.size()), dw.get(),
                            ys.get(), nullptr));
  std::vector<uint8_t> marks(static_cast<size_t>(T * K), 0);
  for (int32_t s : slots) marks[static_cast<size_t>(s)] = 1;
  DeviceBuffer<uint8_t> dm(marks);
  Check(SumMarkedSlots(ys.get(), dm.get(), T, K, H, out.get(), nullptr));
  std::vector<float> yw(static_cast<size_t>(T * K * H), 0.0f);
  for (size_t i = 0; i < slots.size(); ++i)
    for (int64_t c = 0; c < H; ++c)
      yw[static_cast<size_t>(slots[i] * H + c)] =
          w[static_cast<size_t>(slots[i])] * z[i * static_cast<size_t>(H) + static_cast<size_t>(c)];
  const std::vector<float> got = out.Download();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float want = 0.0f;
      for (int64_t j = 0; j < K; ++j)
        if (marks[static_cast<size_t>(t * K + j)])
          want += yw[static_cast<size_t>((t * K + j) * H + c)];
      EXPECT_EQ(Bits(got[static_cast<size_t>(t * H + c)]), Bits(want)) << t << "," << c;
    }
}

}  // namespace
}  // namespace hmoe::cuda
