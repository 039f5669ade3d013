// Attention kinds: what a layer's attention keeps per token in the paged KV
// cache, and the geometry its ops and the paged-attention kernels read it
// with. One row per AttentionKind (ModelConfig::layers) in the attention
// table (attention.cc); each backend keeps its ops per kind (cpu:
// cpu/attention.h's table; cuda: CudaBackend's layer ops, chosen by the
// spec's kind). A new kind is one file defining its row (attention_kinds.h)
// and that row in the table, plus its ops in each backend.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "gpu_worker/driver/rope.h"

namespace hmoe {

// The rotary dimension, pair layout and softmax scale of an attention kind.
struct AttentionGeometry {
  int64_t rope_dim = 0;
  RopeLayout rope_layout = RopeLayout::kHalves;
  float softmax_scale = 1.0f;
};

// What one layer keeps per token in its KV cache: f32 rows of k_row floats
// in the key cache and v_row in the value cache (0: no value cache; the
// values are read from the key rows).
struct KvLayout {
  int64_t k_row = 0;
  int64_t v_row = 0;
  int64_t floats_per_token() const { return k_row + v_row; }
  int64_t bytes_per_token() const { return 4 * floats_per_token(); }
};

// One layer's attention: its kind, its cache rows and how attention reads
// them. Query head h (dk floats) attends over kv head h / (num_heads /
// num_kv_heads), whose key is dk floats at k_head_offset * kv head in the
// key row and whose value is dv floats at v_head_offset * kv head in the
// value row (the key row when cache.v_row is 0).
struct AttentionSpec {
  AttentionKind kind = AttentionKind::kGqa;
  KvLayout cache;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t dk = 0;
  int64_t dv = 0;
  int64_t k_head_offset = 0;
  int64_t v_head_offset = 0;
  // RoPE rotates the first geometry.rope_dim dims of each query and key head
  // (all dk of them, or a part: partial rotary); the rest pass through.
  AttentionGeometry geometry;
  int64_t window = 0;    // sliding window (LayerSpec::sliding_window; 0: all keys)
  bool qk_norm = false;  // GQA: RMSNorm over each q and k head before RoPE
};

// An attention kind's row of the attention table.
struct AttentionKindOps {
  AttentionKind kind;
  // The spec of `layer`, a layer of `config` of this kind.
  AttentionSpec (*spec)(const ModelConfig& config, const LayerSpec& layer);
};
// The table's row for `kind`; UNIMPLEMENTED naming the kind when it has none.
absl::StatusOr<const AttentionKindOps*> AttentionKindOpsFor(AttentionKind kind);
// The spec of `config`'s layer `layer` (its AttentionKind's row); errors as
// AttentionKindOpsFor, INVALID_ARGUMENT for a layer outside the config.
absl::StatusOr<AttentionSpec> AttentionSpecFor(const ModelConfig& config, int layer);

// The geometry of `config`'s attention, which every layer shares (the
// driver's rope rows are computed once per pass with it): MLA:
// qk_rope_head_dim, interleaved for V2 and rope_interleave, YaRN mscale^2
// folded into the scale; GQA: int(head_dim * partial_rotary_factor), halves.
AttentionGeometry AttentionGeometryFor(const ModelConfig& config);

// transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with the
// RMSNorm default eps, not config.rms_norm_eps.
inline constexpr float kMlaNormEps = 1e-6f;

}  // namespace hmoe
