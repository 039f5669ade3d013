#include "common/experts/synthetic_source.h"

#include <gtest/gtest.h>

#include <cstring>

namespace hmoe {
namespace {

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.nbytes())) == 0;
}

bool SameExpert(const ExpertWeights& a, const ExpertWeights& b) {
  return SameBytes(a.gate, b.gate) && SameBytes(a.up, b.up) && SameBytes(a.down, b.down);
}

ExpertWeights Get(const MoeWeightsSource& src, int64_t e) {
  absl::StatusOr<ExpertWeights> w = src.expert(e);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : ExpertWeights{};
}

// alias=N: expert e of layer l holds set (l * E + e) % N, set k being the
// unaliased model's expert k % E of layer k / E.
TEST(SyntheticExperts, AliasedExpertsAreTheBaseSets) {
  const SyntheticExperts plain{32, 16, 6, 7};
  SyntheticExperts aliased = plain;
  aliased.alias = 9;  // more than a layer's experts: sets from layers 0 and 1
  const MoeWeightsSource base = SyntheticAliasSet(aliased);
  ASSERT_EQ(base.num_experts, 9);
  for (int64_t k = 0; k < 9; ++k)
    EXPECT_TRUE(
        SameExpert(Get(base, k), Get(SyntheticExpertSource(plain, static_cast<int>(k / 6)), k % 6)))
        << k;
  for (int layer : {0, 1, 3, 60}) {
    const MoeWeightsSource src = SyntheticExpertSource(aliased, layer);
    EXPECT_EQ(src.num_experts, 6);
    for (int64_t e = 0; e < 6; ++e) {
      const int64_t k = SyntheticAliasIndex(aliased, layer, e);
      EXPECT_EQ(k, (layer * 6 + e) % 9);
      EXPECT_TRUE(SameExpert(Get(src, e), Get(base, k))) << layer << " " << e;
    }
  }
  // Same alias index, identical bytes: (0, 0) and (1, 3) are both set 0;
  // another index differs.
  EXPECT_TRUE(SameExpert(Get(SyntheticExpertSource(aliased, 0), 0),
                         Get(SyntheticExpertSource(aliased, 1), 3)));
  EXPECT_FALSE(SameExpert(Get(SyntheticExpertSource(aliased, 0), 0),
                          Get(SyntheticExpertSource(aliased, 0), 1)));
}

// Unaliased, every (layer, expert) its own weights; alias=0 is unaliased.
TEST(SyntheticExperts, UnaliasedExpertsDiffer) {
  const SyntheticExperts plain{32, 16, 4, 7};
  EXPECT_FALSE(
      SameExpert(Get(SyntheticExpertSource(plain, 0), 0), Get(SyntheticExpertSource(plain, 1), 0)));
  EXPECT_FALSE(
      SameExpert(Get(SyntheticExpertSource(plain, 0), 0), Get(SyntheticExpertSource(plain, 0), 1)));
  // alias >= layers * experts: the unaliased model itself.
  SyntheticExperts wide = plain;
  wide.alias = 3 * 4;
  for (int layer = 0; layer < 3; ++layer)
    for (int64_t e = 0; e < 4; ++e)
      EXPECT_TRUE(SameExpert(Get(SyntheticExpertSource(wide, layer), e),
                             Get(SyntheticExpertSource(plain, layer), e)));
}

}  // namespace
}  // namespace hmoe
