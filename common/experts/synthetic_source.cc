#include "common/experts/synthetic_source.h"

#include <cmath>

#include "common/dtype.h"

namespace hmoe {
namespace {

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Expert e of `layer`, unaliased.
ExpertWeights Generate(uint64_t seed, int64_t layer, int64_t e, int64_t I, int64_t H) {
  auto make = [&](int mat, int64_t rows, int64_t cols) {
    Tensor t = Tensor::Empty(DType::kBF16, {rows, cols});
    const uint64_t base = Mix(seed * 0x9e3779b97f4a7c15ull ^ Mix(static_cast<uint64_t>(layer)) ^
                              Mix(static_cast<uint64_t>(e) << 8 | static_cast<uint64_t>(mat)));
    const float scale = 1.f / std::sqrt(static_cast<float>(cols));
    uint16_t* p = t.data<uint16_t>();
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float u =
          static_cast<float>(Mix(base + static_cast<uint64_t>(i)) >> 40) / float(1 << 23) - 1.f;
      p[i] = F32ToBf16(u * scale);
    }
    return t;
  };
  ExpertWeights w;
  w.gate = make(0, I, H);
  w.up = make(1, I, H);
  w.down = make(2, H, I);
  return w;
}

}  // namespace

int64_t SyntheticAliasIndex(const SyntheticExperts& spec, int layer, int64_t e) {
  return (static_cast<int64_t>(layer) * spec.experts + e) % spec.alias;
}

MoeWeightsSource SyntheticExpertSource(const SyntheticExperts& spec, int layer) {
  MoeWeightsSource src;
  src.hidden = spec.hidden;
  src.intermediate = spec.intermediate;
  src.num_experts = spec.experts;
  src.expert = [spec, layer](int64_t e) {
    int64_t l = layer;
    if (spec.alias > 0) {
      const int64_t k = SyntheticAliasIndex(spec, layer, e);
      l = k / spec.experts;
      e = k % spec.experts;
    }
    return absl::StatusOr<ExpertWeights>(Generate(spec.seed, l, e, spec.intermediate, spec.hidden));
  };
  return src;
}

MoeWeightsSource SyntheticAliasSet(const SyntheticExperts& spec) {
  MoeWeightsSource src;
  src.hidden = spec.hidden;
  src.intermediate = spec.intermediate;
  src.num_experts = spec.alias;
  src.expert = [spec](int64_t k) {
    return absl::StatusOr<ExpertWeights>(
        Generate(spec.seed, k / spec.experts, k % spec.experts, spec.intermediate, spec.hidden));
  };
  return src;
}

}  // namespace hmoe
