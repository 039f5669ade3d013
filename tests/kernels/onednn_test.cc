// oneDNN as a second opinion: the same MoE through oneDNN matmuls agrees with
// the reference (and so with every kernel). Same bounds as moe_test.cc: the
// paths differ only in fp32 summation order and the resulting rare rounding
// flips of bf16 / int8 intermediates.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/kernels/onednn_moe.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe {
namespace {

class OnednnMoeTest : public ::testing::TestWithParam<WeightFormat> {};

// Both I < H and I > H (the int8 path reuses its activation buffer for h).
TEST_P(OnednnMoeTest, AgreesWithReferenceAndKernels) {
  const WeightFormat f = GetParam();
  // Without VNNI oneDNN's int8 matmul multiplies with vpmaddubsw, whose s16
  // pair sums saturate (oneDNN's "Nuances of int8 computations"): 10-25%
  // error seen on an AVX2-only CPU, so no second opinion there.
  if (f == WeightFormat::kInt8 && DetectedIsa() < Isa::kAvx512)
    GTEST_SKIP() << "oneDNN int8 without AVX-512 VNNI saturates its s16 intermediates (ISA "
                 << IsaName(DetectedIsa()) << ")";
  for (auto [H, I] : {std::pair<int64_t, int64_t>{197, 75}, {70, 203}}) {
    auto src = testing::RandomSource(H, I, 5, 41);
    {
      PackOptions o;
      o.format = f;
      std::vector<QuantExpert> q;
      for (int64_t e = 0; e < 5; ++e) q.push_back(QuantizeExpert(*src.expert(e), src, o).value());
      auto dnn = OnednnMoe::FromQuant(q, 0);
      // oneDNN's bf16 matmul exists only from AVX-512 up; anywhere else it must work.
      if (!dnn.ok() && dnn.status().code() == absl::StatusCode::kUnimplemented &&
          f == WeightFormat::kBf16 && DetectedIsa() < Isa::kAvx512)
        GTEST_SKIP() << "oneDNN has no bf16 matmul below AVX-512: " << dnn.status();
      ASSERT_TRUE(dnn.ok()) << dnn.status();
      auto L = Pack(src, o, testing::SharedPool()).value();
      for (int T : {1, 3, 40}) {
        const std::string what =
            absl::StrCat(std::string(WeightFormatName(f)), " H=", H, " I=", I, " T=", T);
        auto b = testing::RandomBatch(T, 2, H, 5, 60 + static_cast<uint64_t>(T));
        std::vector<float> got(static_cast<size_t>(T * H)), ref(got.size()), ours(got.size());
        ASSERT_TRUE((*dnn)->Run(b.input(), got.data()).ok()) << what;
        RunOptions ro;
        ro.many_threshold = 1 << 30;  // int8 numerics are regime-independent; bf16 too
        ASSERT_TRUE(RunMoeReference(q, H, 0, b.input(), ref.data(), ro).ok());
        const double bound = f == WeightFormat::kBf16 ? 3e-3 : 1.5e-2;
        EXPECT_LE(testing::RelErr(got, ref), bound) << what;
        auto ws = MoeWorkspace::Create(L, T, 2, testing::SharedPool()).value();
        ASSERT_TRUE(RunMoe(L, b.input(), ours.data(), testing::SharedPool(), *ws).ok());
        EXPECT_LE(testing::RelErr(ours, got), bound) << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, OnednnMoeTest,
                         ::testing::Values(WeightFormat::kBf16, WeightFormat::kInt8),
                         [](const ::testing::TestParamInfo<WeightFormat>& p) {
                           return std::string(WeightFormatName(p.param));
                         });

TEST(OnednnMoe, Int4IsUnimplemented) {
  auto s = OnednnMoe::Create(WeightFormat::kInt4, 64, 32, 1, 0,
                             [](int64_t, void*, float*, void*, float*) {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace hmoe
