// The hot-expert kernels (gpu_worker/cuda/hot_expert_kernels.h): the hot / cold split and the
// experts against the expert service's reference, against a plain CPU reference (hmoe::cpu ops
// where one exists, a scalar loop here otherwise), on many shapes, odd ones included. Skips without
// a usable CUDA device.
#include "gpu_worker/cuda/hot_expert_kernels.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/transport/moe_call.h"
#include "expert_service/kernels/moe.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/hot_weights.h"
#include "tests/cuda/kernel_test_util.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe::cuda {
namespace {

// The device split against hmoe::SplitHot, empty and foreign ids included.
TEST(GpuKernelTest, SplitHotIds) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  for (int64_t n : {1, 7, 256, 1000}) {
    for (int64_t E : {8, 256}) {
      std::vector<int32_t> ids(static_cast<size_t>(n));
      for (auto& v : ids) v = static_cast<int32_t>(rng() % (E + 3)) - 1;  // -1 .. E + 1
      std::vector<uint8_t> mask(static_cast<size_t>(E));
      for (auto& m : mask) m = rng() % 3 == 0;
      std::vector<int32_t> wc(ids.size()), wh(ids.size());
      hmoe::SplitHot(ids.data(), n, mask.data(), E, wc.data(), wh.data());
      DeviceBuffer<int32_t> di(ids), dc(ids.size()), dh(ids.size());
      DeviceBuffer<uint8_t> dm(mask);
      Check(SplitHotIds(di.get(), n, dm.get(), E, dc.get(), dh.get(), nullptr));
      EXPECT_EQ(dc.Download(), wc) << n << " " << E;
      EXPECT_EQ(dh.Download(), wh) << n << " " << E;
    }
  }
  EXPECT_EQ(SplitHotIds(nullptr, 4, nullptr, 8, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

// Hot experts on the GPU against the expert service's scalar reference
// (RunMoeReference, "few tokens" regime) over the same quantized weights
// (QuantizeExpert), every format, odd shapes (partial int4 groups), some
// experts not hot, empty and foreign slots.
TEST(GpuKernelTest, HotExpertsMatchTheServiceReference) {
  SKIP_WITHOUT_GPU();
  struct Fmt {
    WeightFormat f;
    int group;
  };
  const Fmt fmts[] = {
      {WeightFormat::kBf16, 128},    {WeightFormat::kInt8, 128}, {WeightFormat::kInt4, 32},
      {WeightFormat::kInt4, 64},     {WeightFormat::kInt4, 128}, {WeightFormat::kMxfp4, 32},
      {WeightFormat::kInt4Bf16, 32}, {WeightFormat::kFp8, 128},  {WeightFormat::kMxfp8, 32}};
  const std::pair<int64_t, int64_t> shapes[] = {{96, 40}, {200, 64}, {2048, 96}};
  constexpr int64_t E = 6;
  const bool hot_e[E] = {true, false, true, true, false, true};
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> keep;
  // The backend's layout (gpu_worker/hot_weights.h), uploaded.
  auto upload = [&](const QuantMatrix& m, WeightFormat f) {
    const HostQuantMatrix h = ToKernelLayout(m);
    EXPECT_EQ(h.format, f);
    DevQuantMatrix d;
    d.format = h.format;
    d.group = h.group;
    d.rows = h.rows;
    d.cols = h.cols;
    keep.push_back(std::make_unique<DeviceBuffer<uint8_t>>(h.w));
    d.w = keep.back()->get();
    if (!h.scale.empty()) {
      std::vector<uint8_t> sb(h.scale.size() * 4);
      std::memcpy(sb.data(), h.scale.data(), sb.size());
      keep.push_back(std::make_unique<DeviceBuffer<uint8_t>>(sb));
      d.scale = reinterpret_cast<const float*>(keep.back()->get());
    }
    return d;
  };
  for (const Fmt& fm : fmts) {
    for (const auto& [H, I] : shapes) {
      SCOPED_TRACE(::testing::Message()
                   << WeightFormatName(fm.f) << " g" << fm.group << " H " << H << " I " << I);
      const MoeWeightsSource src = testing::RandomSource(H, I, E, 17 + static_cast<uint64_t>(H));
      PackOptions po;
      po.format = fm.f;
      po.group = fm.group;
      std::vector<QuantExpert> q;
      std::vector<DevExpert> dev(E);
      for (int64_t e = 0; e < E; ++e) {
        auto w = src.expert(e);
        ASSERT_TRUE(w.ok()) << w.status();
        auto qe = QuantizeExpert(*w, src, po);
        ASSERT_TRUE(qe.ok()) << qe.status();
        q.push_back(std::move(*qe));
        if (hot_e[e])
          dev[static_cast<size_t>(e)] = DevExpert{
              upload(q.back().gate, fm.f), upload(q.back().up, fm.f), upload(q.back().down, fm.f)};
      }
      std::vector<uint8_t> dev_bytes(sizeof(DevExpert) * E);
      std::memcpy(dev_bytes.data(), dev.data(), dev_bytes.size());
      DeviceBuffer<uint8_t> dexperts(dev_bytes);
      for (int64_t T : {1, 3, 9}) {
        for (int K : {2, 4}) {
          SCOPED_TRACE(::testing::Message() << "T " << T << " K " << K);
          testing::Batch b = testing::RandomBatch(T, K, H, E, 100 + static_cast<uint64_t>(T * K),
                                                  true, -1, /*foreign=*/true);
          std::vector<int32_t> ref_ids = b.ids;  // only the hot experts' slots
          for (int32_t& id : ref_ids)
            if (id >= 0 && id < E && !hot_e[id]) id = hmoe::kNoExpert;
          RunOptions ro;
          ro.many_threshold = ro.many_threshold_int4 = 1 << 20;  // the "few tokens" regime
          std::vector<float> want(static_cast<size_t>(T * H));
          const MoeInput in{T, K, b.x.data(), ref_ids.data(), b.w.data()};
          ASSERT_TRUE(RunMoeReference(q, H, 0, in, want.data(), ro).ok());
          DeviceBuffer<uint16_t> dx(b.x);
          DeviceBuffer<int32_t> di(b.ids);
          DeviceBuffer<float> dw(b.w), dout(static_cast<size_t>(T * H));
          const int64_t sb = HotExpertsScratchBytes(T, H, I, K);
          DeviceBuffer<uint8_t> scratch(static_cast<size_t>(sb));
          HotExpertsArgs a;
          a.x = dx.get();
          a.T = T;
          a.H = H;
          a.I = I;
          a.ids = di.get();
          a.weights = dw.get();
          a.K = K;
          a.experts = reinterpret_cast<const DevExpert*>(dexperts.get());
          a.E = E;
          a.out = dout.get();
          a.scratch = scratch.get();
          a.scratch_bytes = sb;
          Check(HotExperts(a, nullptr));
          const std::vector<float> got = dout.Download();
          EXPECT_LE(testing::RelErr(got, want), 1e-3);
          a.scratch_bytes = sb - 1;
          EXPECT_EQ(HotExperts(a, nullptr), cudaErrorInvalidValue);
        }
      }
    }
  }
}

// DequantToBf16 against the host's bf16(q * scale), bit for bit: bf16, int8

}  // namespace
}  // namespace hmoe::cuda
