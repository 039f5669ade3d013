// The attention kinds' rows, one file each. Internal to gpu_worker/driver/:
// the attention table (attention.cc) lists them.
#pragma once

#include "common/model_config.h"
#include "gpu_worker/driver/attention.h"

namespace hmoe {

// mla_layout.cc: AttentionKind::kMla. Cache: the normed latent
// (kv_lora_rank), then the roped shared key (qk_rope_head_dim); one kv head
// whose key is the whole row and whose value is the latent.
AttentionSpec MlaSpec(const ModelConfig& config, const LayerSpec& layer);

// mla_dsa_layout.cc: AttentionKind::kMlaDsa. Cache: MLA's row, then the
// lightning indexer's roped, normed key (dsa.head_dim); heads, dk, dv and
// geometry as MLA (the selected keys are read from the row's first dk).
AttentionSpec MlaDsaSpec(const ModelConfig& config, const LayerSpec& layer);

// gqa_layout.cc: AttentionKind::kGqa. Cache: num_kv_heads keys of head_dim,
// and as many values; RoPE over the first int(head_dim *
// partial_rotary_factor) dims of each head; q/k norm as the config says.
AttentionSpec GqaSpec(const ModelConfig& config, const LayerSpec& layer);

}  // namespace hmoe
