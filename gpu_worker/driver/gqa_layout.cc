// AttentionKind::kGqa: grouped-query attention (with or without a window).
#include <cmath>

#include "gpu_worker/driver/attention_kinds.h"

namespace hmoe {

AttentionSpec GqaSpec(const ModelConfig& config, const LayerSpec& layer) {
  const int64_t hd = config.head_dim;
  AttentionSpec s;
  s.kind = AttentionKind::kGqa;
  s.cache.k_row = s.cache.v_row = config.num_kv_heads * hd;
  s.num_heads = config.num_heads;
  s.num_kv_heads = config.num_kv_heads;
  s.dk = s.dv = hd;
  s.k_head_offset = s.v_head_offset = hd;
  // The first int(head_dim * partial_rotary_factor) dims of each head.
  s.geometry.rope_dim =
      static_cast<int64_t>(static_cast<double>(hd) * config.rope.partial_rotary_factor);
  s.geometry.rope_layout = RopeLayout::kHalves;
  s.geometry.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  s.window = layer.sliding_window;
  s.qk_norm = config.qk_norm;
  return s;
}

}  // namespace hmoe
