// KernelSet::weighted_sum (the MoE reduce) in every ISA this CPU runs, against
// a plain double-precision sum: odd lengths (masked / scalar tails), 0 to 40
// rows, unaligned and aligned outputs, streaming and plain stores.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/isa.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe {
namespace {

using testing::SetsOnThisCpu;

TEST(WeightedSumTest, MatchesPlainSumOnOddShapes) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const auto& ks : SetsOnThisCpu()) {
    ASSERT_NE(ks.set->weighted_sum, nullptr) << ks.name;
    for (int64_t len : {1, 7, 15, 16, 17, 31, 32, 33, 100, 256, 1000, 7168}) {
      for (int n : {0, 1, 2, 3, 8, 9, 40}) {
        for (int misalign : {0, 1}) {
          for (bool stream : {false, true}) {
            SCOPED_TRACE(absl::StrCat(ks.name, " len ", len, " rows ", n, " misalign ", misalign,
                                      " stream ", stream));
            std::vector<std::vector<float>> rows(static_cast<size_t>(n));
            std::vector<const float*> ptrs;
            std::vector<float> w(static_cast<size_t>(n));
            for (int j = 0; j < n; ++j) {
              rows[static_cast<size_t>(j)].resize(static_cast<size_t>(len) + 1);
              for (auto& v : rows[static_cast<size_t>(j)]) v = nd(rng);
              ptrs.push_back(rows[static_cast<size_t>(j)].data() + (j % 2));  // odd rows unaligned
              w[static_cast<size_t>(j)] = nd(rng);
            }
            // 64-byte aligned buffer; out starts `misalign` floats in.
            std::vector<float> buf(static_cast<size_t>(len) + 32, -1.0f);
            float* base = buf.data();
            while (reinterpret_cast<uintptr_t>(base) % 64 != 0) ++base;
            float* out = base + misalign;
            const float guard = out[len];
            ks.set->weighted_sum(ptrs.data(), w.data(), n, len, out, stream);
            double max_err = 0, max_ref = 0;
            int64_t non_finite = 0;
            for (int64_t i = 0; i < len; ++i) {
              non_finite += std::isfinite(out[i]) ? 0 : 1;
              double ref = 0;
              for (int j = 0; j < n; ++j)
                ref += static_cast<double>(w[static_cast<size_t>(j)]) *
                       ptrs[static_cast<size_t>(j)][i];
              max_err = std::max(max_err, std::abs(ref - out[i]));
              max_ref = std::max(max_ref, std::abs(ref));
            }
            // fp32 sums of n products: a few ulps of the largest term per row.
            EXPECT_EQ(non_finite, 0) << "NaN or inf in the output";
            EXPECT_LE(max_err, 1e-5 * (max_ref + 1.0) * (n + 1));
            EXPECT_EQ(out[len], guard) << "wrote past len";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace hmoe
