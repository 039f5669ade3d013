// Rotary position embeddings as transformers computes them: the inverse
// frequencies (default, linear, YaRN), the attention factor and the per
// position cos/sin rows every backend's rope op consumes. Written once here;
// the backends' ApplyRope ops take these rows.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model_config.h"

namespace hmoe {

// Inverse frequencies (dim / 2 of them) and the attention factor transformers
// multiplies cos and sin by, for `rope` over a rotary dimension `dim`:
//   default: theta^(-2i/dim);  linear: that / factor;
//   yarn: blend of extrapolation theta^(-2i/dim) and interpolation
//   /factor with a linear ramp between the correction dims of beta_fast and
//   beta_slow (floor/ceil truncated unless rope.truncate is false), attention factor
//   get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both
//   are nonzero, else get_mscale(factor) (or the configured attention_factor).
// Values are rounded to f32 the way transformers computes them.
struct RopeTables {
  std::vector<float> inv_freq;
  float attention_factor = 1.0f;
};
RopeTables ComputeRope(const RopeConfig& rope, int64_t dim);
double YarnGetMscale(double scale, double mscale);

// Pair layout of the rotary dimensions.
enum class RopeLayout {
  kHalves,       // (x[i], x[i + d/2]) rotated by inv_freq[i] (rotate_half)
  kInterleaved,  // (x[2i], x[2i + 1]) rotated by inv_freq[i] (DeepSeek)
};
// cos/sin for one position: cs[2i] = cos(pos * f_i) * af, cs[2i+1] = sin(..) * af.
void RopeCosSin(const RopeTables& t, int64_t pos, float* cs);

}  // namespace hmoe
