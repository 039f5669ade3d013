#include "gpu_worker/driver/weight_names.h"

#include "absl/strings/str_cat.h"

namespace hmoe {

LayerNames NamesForLayer(const ModelConfig& c, int layer) {
  LayerNames n;
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const std::string a = p + "self_attn.";
  n.input_norm = p + "input_layernorm.weight";
  n.post_norm = p + "post_attention_layernorm.weight";
  n.q = a + "q_proj";
  n.q_a = a + "q_a_proj";
  n.q_a_norm = a + "q_a_layernorm.weight";
  n.q_b = a + "q_b_proj";
  n.kv_a = a + "kv_a_proj_with_mqa";
  n.kv_a_norm = a + "kv_a_layernorm.weight";
  n.kv_b = a + "kv_b_proj";
  n.k = a + "k_proj";
  n.v = a + "v_proj";
  n.o = a + "o_proj";
  n.q_norm = a + "q_norm.weight";
  n.k_norm = a + "k_norm.weight";
  n.idx_q = a + "indexer.wq_b";
  n.idx_k = a + "indexer.wk";
  n.idx_k_norm = a + "indexer.k_norm";
  n.idx_weights = a + "indexer.weights_proj";
  auto mlp = [](const std::string& prefix) {
    return MlpNames{prefix + "gate_proj", prefix + "up_proj", prefix + "down_proj"};
  };
  n.dense = mlp(p + "mlp.");
  const std::string block = c.arch == Architecture::kMixtral ? p + "block_sparse_moe." : p + "mlp.";
  n.router = block + "gate.weight";
  n.router_bias = block + "gate.e_score_correction_bias";
  n.shared = mlp(block + "shared_experts.");
  return n;
}

}  // namespace hmoe
