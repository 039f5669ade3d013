// ModelConfig: a Hugging Face config.json parsed into the fields that change
// the math, for deepseek_v3, deepseek_v32, glm_moe_dsa, deepseek_v4, deepseek_v2, qwen3_moe,
// mixtral and glm4_moe.
//
// Accepts both the published checkpoints' spelling (rope_theta + rope_scaling
// {"type": "yarn", ...}, Qwen3's num_experts) and what transformers 5 writes
// (rope_parameters {"rope_type", "rope_theta", ...}, rope_interleave,
// num_local_experts). Errors: unknown model_type -> UNIMPLEMENTED naming it;
// missing, mistyped or inconsistent fields -> INVALID_ARGUMENT naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe {

enum class Architecture {
  kDeepseekV3,
  kDeepseekV2,
  kQwen3Moe,
  kMixtral,
  kGlm4Moe,
  kDeepseekV32,
  kGlmMoeDsa,
  kDeepseekV4
};
// sqrtsoftplus (DeepSeek-V4): sqrt(softplus(logit)).
enum class ScoringFunc { kSoftmax, kSigmoid, kSqrtSoftplus };
// greedy: plain top-k; group_limited_greedy (V2): groups ranked by their max
// score; noaux_tc (V3): groups ranked by the sum of their top-2 biased scores.
enum class TopkMethod { kGreedy, kGroupLimitedGreedy, kNoauxTc };
enum class RopeType { kDefault, kLinear, kYarn };
// Per-layer kinds: which attention and which router a layer runs, and how
// its sublayers join the residual. The model driver and the backends keep one
// implementation per kind in tables keyed by these (gpu_worker/driver/).
//   mla: DeepSeek's multi-head latent attention (cache: latent + rope key);
//   gqa: grouped-query attention (cache: K and V per kv head), with or
//        without a sliding window (LayerSpec::sliding_window);
//   mla_dsa: MLA over the index_topk keys a lightning indexer selects per
//        query (DeepSeek sparse attention; cache: MLA's row + the indexer key);
//   v4_sliding / v4_csa / v4_hca (DeepSeek-V4's layer_types sliding_attention,
//        compressed_sparse_attention, heavily_compressed_attention): one
//        shared K=V head over a sliding window, plus (csa) entries compressed
//        LayerSpec::compress_rate:1 of which a lightning indexer picks the
//        top index_topk per query, or (hca) all entries compressed
//        compress_rate:1.
enum class AttentionKind { kMla, kGqa, kMlaDsa, kV4Sliding, kV4Csa, kV4Hca };
//   softmax_topk: softmax scores, plain or group-limited (groups by max) top-k;
//   sigmoid_grouped_topk: sigmoid scores, selection on scores + correction
//        bias within the best groups (groups by their top-2 sum; noaux_tc).
//   sqrtsoftplus_topk: sqrt(softplus) scores, top-k on scores + correction
//        bias, the chosen scores normalized (DeepSeek-V4's moe layers);
//   hash: the experts a frozen per-token-id table (tid2eid) names, weighted
//        by their normalized sqrt(softplus) scores (DeepSeek-V4's hash_moe).
enum class RouterKind { kSoftmaxTopk, kSigmoidGroupedTopk, kSqrtSoftplusTopk, kHash };
//   plain: one residual stream, x += sublayer(norm(x));
//   mhc: hc_mult residual streams, collapsed into each sublayer's input and
//        mixed by a Sinkhorn-normalized matrix (DeepSeek-V4's hyper-connections).
enum class ResidualKind { kPlain, kHyperConnection };

const char* ArchitectureName(Architecture a);  // the model_type string
const char* ScoringFuncName(ScoringFunc s);
const char* TopkMethodName(TopkMethod t);
const char* RopeTypeName(RopeType r);
const char* AttentionKindName(AttentionKind k);  // "mla", "gqa", "mla_dsa", "v4_csa", ...
const char* RouterKindName(RouterKind k);        // "softmax_topk", "hash", ...
const char* ResidualKindName(ResidualKind k);    // "plain", "mhc"
// The kinds an architecture's layers run (ParseModelConfig gives each layer
// these; the one place they are chosen).
struct ArchitectureKinds {
  AttentionKind attention = AttentionKind::kGqa;
  RouterKind router = RouterKind::kSoftmaxTopk;
  ResidualKind residual = ResidualKind::kPlain;
};
ArchitectureKinds KindsOf(Architecture a);

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;  // linear / yarn scaling factor
  // YaRN (DeepSeek): frequency blend between beta_fast and beta_slow, and
  // attention magnitude scaling from mscale / mscale_all_dim.
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;          // 0: absent (transformers then uses get_mscale(factor) alone)
  double mscale_all_dim = 0.0;  // 0: absent
  bool truncate = true;         // floor/ceil the YaRN correction range
  std::optional<double> attention_factor;  // overrides the mscale-derived factor when set
  // DeepSeek MLA checkpoints store rope dims interleaved (pairs 2i, 2i+1)
  // rather than halves; transformers 5 exposes it as rope_interleave.
  bool interleave = false;
  // The share of each head's dims rotated (GLM-4.5: 0.5, the first
  // int(head_dim * factor) dims); the rest pass through.
  double partial_rotary_factor = 1.0;
};

struct MlaConfig {
  std::optional<int64_t> q_lora_rank;  // null: q_proj straight from hidden
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// DeepSeek sparse attention's lightning indexer (index_* fields): per query,
// index_n_heads heads of index_head_dim score every visible key; MLA attends
// over the index_topk best.
struct DsaConfig {
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  int64_t topk = 0;
  bool rope_interleave = false;  // the indexer's rope pairs (V3.2: halves; GLM: interleaved)
};

// DeepSeek-V4's fields beside head_dim / num_key_value_heads (one shared K=V
// head) and dsa (its lightning indexer): q LoRA, the grouped low-rank output
// projection, the compressed branches' RoPE, mHC and the routed experts' clamp.
struct V4Config {
  int64_t q_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;  // the trailing dims of each head that are roped
  int64_t o_groups = 0;
  int64_t o_lora_rank = 0;
  int64_t sliding_window = 0;
  int64_t csa_compress_rate = 0;  // compress_rates.compressed_sparse_attention
  int64_t hca_compress_rate = 0;  // compress_rates.heavily_compressed_attention
  RopeConfig compress_rope;       // csa / hca layers (ModelConfig::rope: sliding layers)
  int64_t hc_mult = 0;
  int64_t hc_sinkhorn_iters = 0;
  double hc_eps = 0.0;
  double swiglu_limit = 0.0;  // routed and shared experts: gate <= limit, |up| <= limit
};

struct MoeConfig {
  int64_t num_experts = 0;         // routed experts
  int64_t experts_per_token = 0;   // top-k
  int64_t intermediate_size = 0;   // per routed expert
  int64_t num_shared_experts = 0;  // DeepSeek: one fused shared MLP of width n * intermediate
  ScoringFunc scoring = ScoringFunc::kSoftmax;
  TopkMethod topk_method = TopkMethod::kGreedy;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  bool score_correction_bias = false;  // V3 noaux_tc: e_score_correction_bias, selection only
};

// config.json's quantization_config, for the methods read:
//   "fp8": e4m3 weights, `weight_block` (e.g. {128, 128}) f32 scale_inv blocks;
//   "compressed-tensors": a `format` of common/native_layout.h's rows
//     ("pack-quantized": int4 symmetric per group of `group_size`;
//     "mxfp4-pack-quantized", "mxfp8-quantized": OCP MX, group 32);
//   "mxfp4": OCP MXFP4 (weight_blocks / weight_scales, an e8m0 scale per 32);
//   "mxfp8": OCP MXFP8 (e4m3 weight, an e8m0 weight_scale per 32).
// Any other method or compressed-tensors format is UNIMPLEMENTED naming it.
struct QuantizationConfig {
  std::string method;                 // "" (none) or one of the above
  std::string format;                 // compressed-tensors: its config groups' format; else ""
  std::vector<int64_t> weight_block;  // fp8: {128, 128}
  int64_t group_size = 0;             // compressed-tensors: the group along K
};

struct LayerSpec {
  bool moe = false;            // routed experts (else dense MLP)
  int64_t sliding_window = 0;  // 0: full attention
  AttentionKind attention = AttentionKind::kGqa;
  RouterKind router = RouterKind::kSoftmaxTopk;  // MoE layers' router (dense layers: unused)
  int64_t compress_rate = 0;  // v4_csa / v4_hca: source tokens per compressed entry
};

struct ModelConfig {
  Architecture arch = Architecture::kDeepseekV3;
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP layers
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // GQA
  int64_t head_dim = 0;      // GQA head size (MLA uses mla.*)
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool qk_norm = false;  // GQA: RMSNorm over each q and k head before RoPE (q_norm / k_norm)
  RopeConfig rope;
  MlaConfig mla;  // DeepSeek only
  DsaConfig dsa;  // mla_dsa and v4_csa layers only
  V4Config v4;    // deepseek_v4 only
  MoeConfig moe;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t num_nextn_predict_layers = 0;  // DeepSeek-V3/V4 MTP layers (loaded and not run)
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;
  QuantizationConfig quantization;
  ResidualKind residual = ResidualKind::kPlain;
  std::vector<LayerSpec> layers;  // derived, one per hidden layer (ParseModelConfig)

  bool is_mla() const {
    return arch == Architecture::kDeepseekV3 || arch == Architecture::kDeepseekV2 ||
           arch == Architecture::kDeepseekV32 || arch == Architecture::kGlmMoeDsa;
  }
  int64_t num_moe_layers() const;
  std::vector<int32_t> moe_layer_indices() const;  // the MoE layers' decoder indices, ascending
};

// Parses config.json text; `source` (usually the path) prefixes every error.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);
// Reads MODEL_DIR/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace hmoe
