#include "gpu_worker/driver/rope.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace hmoe {

// ---- rope ------------------------------------------------------------------------

double YarnGetMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

RopeTables ComputeRope(const RopeConfig& rope, int64_t dim) {
  RopeTables t;
  const int64_t half = dim / 2;
  t.inv_freq.resize(static_cast<size_t>(half));
  const float base = static_cast<float>(rope.theta);
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    pos_freqs[i] = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(dim));
  switch (rope.type) {
    case RopeType::kDefault:
      for (int64_t i = 0; i < half; ++i) t.inv_freq[i] = 1.0f / pos_freqs[i];
      break;
    case RopeType::kLinear:
      for (int64_t i = 0; i < half; ++i)
        t.inv_freq[i] = (1.0f / pos_freqs[i]) / static_cast<float>(rope.factor);
      break;
    case RopeType::kYarn: {
      const double factor = rope.factor;
      if (rope.attention_factor) {
        t.attention_factor = static_cast<float>(*rope.attention_factor);
      } else if (rope.mscale != 0.0 && rope.mscale_all_dim != 0.0) {
        t.attention_factor = static_cast<float>(YarnGetMscale(factor, rope.mscale) /
                                                YarnGetMscale(factor, rope.mscale_all_dim));
      } else {
        t.attention_factor = static_cast<float>(YarnGetMscale(factor, 1.0));
      }
      const double pi = 3.14159265358979323846;
      const double orig = static_cast<double>(rope.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return (static_cast<double>(dim) * std::log(orig / (rotations * 2 * pi))) /
               (2 * std::log(rope.theta));
      };
      double low = correction_dim(rope.beta_fast);
      double high = correction_dim(rope.beta_slow);
      if (rope.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;
      const float lowf = static_cast<float>(low), spanf = static_cast<float>(high - low);
      for (int64_t i = 0; i < half; ++i) {
        float ramp = (static_cast<float>(i) - lowf) / spanf;
        ramp = std::clamp(ramp, 0.0f, 1.0f);
        const float extrap = 1.0f - ramp;
        const float f_extra = 1.0f / pos_freqs[i];
        const float f_inter = 1.0f / (static_cast<float>(factor) * pos_freqs[i]);
        t.inv_freq[i] = f_inter * (1.0f - extrap) + f_extra * extrap;
      }
      break;
    }
  }
  return t;
}

void RopeCosSin(const RopeTables& t, int64_t pos, float* cs) {
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < t.inv_freq.size(); ++i) {
    const float a = p * t.inv_freq[i];
    cs[2 * i] = std::cos(a) * t.attention_factor;
    cs[2 * i + 1] = std::sin(a) * t.attention_factor;
  }
}

}  // namespace hmoe
