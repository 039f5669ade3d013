// The checkpoint tensor names of the model's non-expert weights, per layer,
// as Hugging Face checkpoints of deepseek_v3 / deepseek_v32 / deepseek_v2 / qwen3_moe /
// mixtral / glm4_moe spell them. Every backend loads by these names. A linear layer is
// named by its prefix: PREFIX.weight and, when present, PREFIX.bias.
#pragma once

#include <string>

#include "common/model_config.h"

namespace hmoe {

struct MlpNames {
  std::string gate, up, down;  // linear prefixes
};

struct LayerNames {
  std::string input_norm, post_norm;  // full tensor names
  // MLA (q_lora_rank set: q_a, q_a_norm, q_b; else q), kv_a, kv_a_norm,
  // kv_b; GQA: q, k, v, and (ModelConfig::qk_norm) q_norm, k_norm; both: o.
  std::string q, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, k, v, o, q_norm, k_norm;
  // MLA-DSA's lightning indexer: linear prefixes idx_q (wq_b), idx_k (wk),
  // idx_weights (weights_proj); idx_k_norm the LayerNorm's prefix (.weight, .bias).
  std::string idx_q, idx_k, idx_k_norm, idx_weights;
  MlpNames dense;           // dense layers
  std::string router;       // MoE layers: the gate's weight (full name)
  std::string router_bias;  // e_score_correction_bias (full name)
  MlpNames shared;          // DeepSeek's shared experts
};

struct ModelNames {
  std::string embed = "model.embed_tokens.weight";
  std::string final_norm = "model.norm.weight";
  std::string lm_head = "lm_head.weight";  // tie_word_embeddings: the embedding instead
};

LayerNames NamesForLayer(const ModelConfig& config, int layer);

}  // namespace hmoe
