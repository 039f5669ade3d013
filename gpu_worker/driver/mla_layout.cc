// AttentionKind::kMla: DeepSeek's multi-head latent attention.
#include <cmath>

#include "gpu_worker/driver/attention_kinds.h"

namespace hmoe {

AttentionSpec MlaSpec(const ModelConfig& config, const LayerSpec& layer) {
  const MlaConfig& m = config.mla;
  AttentionSpec s;
  s.kind = AttentionKind::kMla;
  s.cache.k_row = m.kv_lora_rank + m.qk_rope_head_dim;
  s.cache.v_row = 0;
  s.num_heads = config.num_heads;
  s.num_kv_heads = 1;
  s.dk = s.cache.k_row;
  s.dv = m.kv_lora_rank;
  AttentionGeometry& g = s.geometry;
  g.rope_dim = m.qk_rope_head_dim;
  // V2 always rotates interleaved pairs (complex form); V3 per rope_interleave.
  g.rope_layout = config.arch == Architecture::kDeepseekV2 || config.rope.interleave
                      ? RopeLayout::kInterleaved
                      : RopeLayout::kHalves;
  double scale = 1.0 / std::sqrt(static_cast<double>(m.qk_head_dim()));
  if (config.rope.type != RopeType::kDefault && config.rope.mscale_all_dim != 0.0) {
    const double ms = YarnGetMscale(config.rope.factor, config.rope.mscale_all_dim);
    scale *= ms * ms;
  }
  g.softmax_scale = static_cast<float>(scale);
  s.window = layer.sliding_window;
  return s;
}

}  // namespace hmoe
