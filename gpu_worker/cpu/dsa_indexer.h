// DeepSeek sparse attention's lightning indexer on the reference backend
// (AttentionKind::kMlaDsa's piece beside MLA): each token's indexer key
// lives in its cache row after MLA's; per query it scores every visible key
// and keeps the config's dsa.topk best for MLA to attend over.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "gpu_worker/cpu/attention.h"
#include "gpu_worker/driver/weight_names.h"

namespace hmoe::cpu {

class DsaIndexer {
 public:
  // `key_offset`: where the indexer key starts in a cache row of `row` floats.
  DsaIndexer(const ModelConfig& config, int64_t key_offset, int64_t row);

  // Loads wq_b, wk, k_norm (LayerNorm weight and bias), weights_proj.
  absl::Status Load(const Checkpoint& ckpt, const LayerNames& names, int64_t fp8_block);

  // Writes each token's key, rope(LayerNorm(wk h)) on its first
  // qk_rope_head_dim dims, into its cache row at its position; then, per
  // token t, sets (*selected)[t] to the positions its query attends over:
  // empty (every position in [0, pos]) when there are at most dsa.topk, else
  // the dsa.topk of highest index score, ascending,
  //   sum_h w_h relu(q_h . k_s / sqrt(head_dim)),  w = weights_proj(h) / sqrt(n_heads),
  // q = rope(wq_b(q_lora)) per head; of equal scores the earlier position.
  // h: [T, hidden]; q_lora: [T, q_lora_rank], the normed q LoRA.
  void Select(const AttentionPass& p, const float* h, const float* q_lora,
              std::vector<std::vector<int64_t>>* selected) const;

 private:
  ModelConfig c_;
  int64_t key_offset_ = 0, row_ = 0;
  Lin wq_, wk_, weights_;
  std::vector<float> norm_w_, norm_b_;
};

}  // namespace hmoe::cpu
