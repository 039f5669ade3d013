#include "common/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/native_layout.h"
#include "common/small_file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hmoe {

namespace {

// The architectures: config.json's model_type, and the kinds their layers
// run (ResolveLayerKinds). A new architecture or a new kind for one is a row.
struct ArchRow {
  Architecture arch;
  const char* model_type;
  AttentionKind attention;
  RouterKind router;
  ResidualKind residual;
};
constexpr ArchRow kArchitectures[] = {
    {Architecture::kDeepseekV3, "deepseek_v3", AttentionKind::kMla, RouterKind::kSigmoidGroupedTopk,
     ResidualKind::kPlain},
    {Architecture::kDeepseekV2, "deepseek_v2", AttentionKind::kMla, RouterKind::kSoftmaxTopk,
     ResidualKind::kPlain},
    {Architecture::kQwen3Moe, "qwen3_moe", AttentionKind::kGqa, RouterKind::kSoftmaxTopk,
     ResidualKind::kPlain},
    {Architecture::kMixtral, "mixtral", AttentionKind::kGqa, RouterKind::kSoftmaxTopk,
     ResidualKind::kPlain},
    // Kimi-K2's checkpoints: DeepSeek-V3 under their own model_type.
    {Architecture::kDeepseekV3, "kimi_k2", AttentionKind::kMla, RouterKind::kSigmoidGroupedTopk,
     ResidualKind::kPlain},
    {Architecture::kGlm4Moe, "glm4_moe", AttentionKind::kGqa, RouterKind::kSigmoidGroupedTopk,
     ResidualKind::kPlain},
    {Architecture::kDeepseekV32, "deepseek_v32", AttentionKind::kMlaDsa,
     RouterKind::kSigmoidGroupedTopk, ResidualKind::kPlain},
    {Architecture::kGlmMoeDsa, "glm_moe_dsa", AttentionKind::kMlaDsa,
     RouterKind::kSigmoidGroupedTopk, ResidualKind::kPlain},
    // Per layer: layer_types picks the attention kind, mlp_layer_types the
    // router (kV4LayerTypes, hash_moe / moe).
    {Architecture::kDeepseekV4, "deepseek_v4", AttentionKind::kV4Sliding,
     RouterKind::kSqrtSoftplusTopk, ResidualKind::kHyperConnection},
};

const ArchRow* ArchRowFor(Architecture a) {
  for (const ArchRow& r : kArchitectures)
    if (r.arch == a) return &r;
  return nullptr;
}

// layer_types entries (transformers' per-layer attention types) and what
// each means for the layer's attention.
struct LayerTypeRow {
  const char* name;
  bool sliding;  // takes the config's sliding_window
  bool indexed;  // DSA (the architecture's attention kind is mla_dsa)
};
constexpr LayerTypeRow kLayerTypes[] = {{"full_attention", false, false},
                                        {"sliding_attention", true, false},
                                        {"indexed_attention", false, true}};

// DeepSeek-V4's layer_types: each names the layer's attention kind, and the
// compress_rates key its compressed branch reads ("": none).
struct V4LayerTypeRow {
  const char* name;
  AttentionKind kind;
  const char* compress_key;
};
constexpr V4LayerTypeRow kV4LayerTypes[] = {
    {"sliding_attention", AttentionKind::kV4Sliding, ""},
    {"compressed_sparse_attention", AttentionKind::kV4Csa, "compressed_sparse_attention"},
    {"heavily_compressed_attention", AttentionKind::kV4Hca, "heavily_compressed_attention"}};
// The published checkpoints' compress_ratios (one per layer) spell the kind
// as its rate: 0 sliding, 4 csa, 128 hca (DeepseekV4Config's table).
constexpr struct {
  int64_t rate;
  const char* layer_type;
} kV4CompressRatios[] = {{0, "sliding_attention"},
                         {4, "compressed_sparse_attention"},
                         {128, "heavily_compressed_attention"}};

}  // namespace

const char* ArchitectureName(Architecture a) {
  const ArchRow* r = ArchRowFor(a);
  return r != nullptr ? r->model_type : "?";
}
ArchitectureKinds KindsOf(Architecture a) {
  const ArchRow* r = ArchRowFor(a);
  if (r == nullptr) return {};
  return {r->attention, r->router, r->residual};
}
const char* ScoringFuncName(ScoringFunc s) {
  switch (s) {
    case ScoringFunc::kSoftmax:
      return "softmax";
    case ScoringFunc::kSigmoid:
      return "sigmoid";
    case ScoringFunc::kSqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}
const char* TopkMethodName(TopkMethod t) {
  switch (t) {
    case TopkMethod::kGreedy:
      return "greedy";
    case TopkMethod::kGroupLimitedGreedy:
      return "group_limited_greedy";
    case TopkMethod::kNoauxTc:
      return "noaux_tc";
  }
  return "?";
}
const char* AttentionKindName(AttentionKind k) {
  switch (k) {
    case AttentionKind::kMla:
      return "mla";
    case AttentionKind::kGqa:
      return "gqa";
    case AttentionKind::kMlaDsa:
      return "mla_dsa";
    case AttentionKind::kV4Sliding:
      return "v4_sliding";
    case AttentionKind::kV4Csa:
      return "v4_csa";
    case AttentionKind::kV4Hca:
      return "v4_hca";
  }
  return "?";
}
const char* RouterKindName(RouterKind k) {
  switch (k) {
    case RouterKind::kSoftmaxTopk:
      return "softmax_topk";
    case RouterKind::kSigmoidGroupedTopk:
      return "sigmoid_grouped_topk";
    case RouterKind::kSqrtSoftplusTopk:
      return "sqrtsoftplus_topk";
    case RouterKind::kHash:
      return "hash";
  }
  return "?";
}
const char* ResidualKindName(ResidualKind k) {
  switch (k) {
    case ResidualKind::kPlain:
      return "plain";
    case ResidualKind::kHyperConnection:
      return "mhc";
  }
  return "?";
}
const char* RopeTypeName(RopeType r) {
  switch (r) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kYarn:
      return "yarn";
  }
  return "?";
}

int64_t ModelConfig::num_moe_layers() const {
  return std::count_if(layers.begin(), layers.end(), [](const LayerSpec& l) { return l.moe; });
}

std::vector<int32_t> ModelConfig::moe_layer_indices() const {
  std::vector<int32_t> out;
  for (size_t l = 0; l < layers.size(); ++l)
    if (layers[l].moe) out.push_back(static_cast<int32_t>(l));
  return out;
}

namespace {

using json = nlohmann::json;

// Typed field access that records the first error, naming the field.
class Reader {
 public:
  Reader(const json& j, std::string source, std::string prefix = "")
      : j_(j), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool Has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  absl::Status status() const { return status_; }
  void Fail(const std::string& field, const std::string& what) {
    if (status_.ok())
      status_ = absl::InvalidArgumentError(
          absl::StrCat(source_, ": field \"", prefix_, field, "\" ", what));
  }

  int64_t Int(const char* key) {
    if (!Has(key)) {
      Fail(key, "is required");
      return 0;
    }
    return IntOr(key, 0);
  }
  int64_t IntOr(const char* key, int64_t def) {
    if (!Has(key)) return def;
    const json& v = j_[key];
    if (v.is_number_integer()) return v.get<int64_t>();
    // A float that is a whole number inside int64 (casting one outside it
    // is undefined).
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (d >= -9.0e18 && d <= 9.0e18 && d == static_cast<double>(static_cast<int64_t>(d)))
        return static_cast<int64_t>(d);
    }
    Fail(key, absl::StrCat("must be an integer, got ", v.dump()));
    return def;
  }
  std::optional<int64_t> OptInt(const char* key) {
    if (!Has(key)) return std::nullopt;
    return IntOr(key, 0);
  }
  double DoubleOr(const char* key, double def) {
    if (!Has(key)) return def;
    const json& v = j_[key];
    if (v.is_number()) return v.get<double>();
    Fail(key, absl::StrCat("must be a number, got ", v.dump()));
    return def;
  }
  std::optional<double> OptDouble(const char* key) {
    if (!Has(key)) return std::nullopt;
    return DoubleOr(key, 0.0);
  }
  bool BoolOr(const char* key, bool def) {
    if (!Has(key)) return def;
    const json& v = j_[key];
    if (v.is_boolean()) return v.get<bool>();
    Fail(key, absl::StrCat("must be true or false, got ", v.dump()));
    return def;
  }
  std::string StringOr(const char* key, const std::string& def) {
    if (!Has(key)) return def;
    const json& v = j_[key];
    if (v.is_string()) return v.get<std::string>();
    Fail(key, absl::StrCat("must be a string, got ", v.dump()));
    return def;
  }
  std::vector<int64_t> IntList(const char* key) {
    std::vector<int64_t> out;
    if (!Has(key)) return out;
    const json& v = j_[key];
    if (v.is_number_integer()) return {v.get<int64_t>()};
    if (!v.is_array()) {
      Fail(key, absl::StrCat("must be an integer or a list of integers, got ", v.dump()));
      return out;
    }
    for (const auto& x : v) {
      if (!x.is_number_integer()) {
        Fail(key, absl::StrCat("must hold integers, got ", x.dump()));
        return {};
      }
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
  const json& raw() const { return j_; }

 private:
  const json& j_;
  std::string source_;
  std::string prefix_;
  absl::Status status_;
};

absl::Status ParseRopeObject(const json& rp, const std::string& key, const std::string& source,
                             int64_t max_position_embeddings, RopeConfig& rope);

absl::Status ParseRope(const json& root, Reader& top, const std::string& source, ModelConfig& c) {
  // transformers 5: rope_parameters {rope_type, rope_theta, ...}; published
  // checkpoints: rope_theta at top level plus rope_scaling {type | rope_type, ...}.
  const char* key = nullptr;
  if (root.contains("rope_parameters") && !root["rope_parameters"].is_null())
    key = "rope_parameters";
  else if (root.contains("rope_scaling") && !root["rope_scaling"].is_null())
    key = "rope_scaling";
  c.rope.theta = top.DoubleOr("rope_theta", c.rope.theta);
  c.rope.interleave = top.BoolOr("rope_interleave", c.is_mla());
  // transformers' DeepseekV32 and GlmMoeDsa MLA always rotate interleaved
  // pairs; they read no rope_interleave.
  if (KindsOf(c.arch).attention == AttentionKind::kMlaDsa) c.rope.interleave = true;
  if (key == nullptr) return top.status();
  RETURN_IF_ERROR(ParseRopeObject(root[key], key, source, c.max_position_embeddings, c.rope));
  return top.status();
}

absl::Status ParseRopeObject(const json& rp, const std::string& key, const std::string& source,
                             int64_t max_position_embeddings, RopeConfig& rope) {
  if (!rp.is_object())
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, "\" must be an object"));
  Reader r(rp, source, std::string(key) + ".");
  rope.theta = r.DoubleOr("rope_theta", rope.theta);
  std::string type = r.StringOr("rope_type", r.StringOr("type", "default"));
  if (type == "default") {
    rope.type = RopeType::kDefault;
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
  } else if (type == "yarn" || type == "deepseek_yarn") {
    rope.type = RopeType::kYarn;
  } else {
    return absl::UnimplementedError(absl::StrCat(source, ": field \"", key, ".rope_type\" is \"",
                                                 type, "\"; supported: default, linear, yarn"));
  }
  rope.original_max_position_embeddings =
      r.IntOr("original_max_position_embeddings", max_position_embeddings);
  // As transformers: a yarn config without `factor` stretches the original
  // context to max_position_embeddings.
  const double implied_factor =
      rope.type == RopeType::kYarn && rope.original_max_position_embeddings > 0
          ? static_cast<double>(max_position_embeddings) /
                static_cast<double>(rope.original_max_position_embeddings)
          : 1.0;
  rope.factor = r.DoubleOr("factor", implied_factor);
  rope.beta_fast = r.DoubleOr("beta_fast", 32.0);
  rope.beta_slow = r.DoubleOr("beta_slow", 1.0);
  rope.mscale = r.DoubleOr("mscale", 0.0);
  rope.mscale_all_dim = r.DoubleOr("mscale_all_dim", 0.0);
  rope.attention_factor = r.OptDouble("attention_factor");
  rope.truncate = r.BoolOr("truncate", true);
  RETURN_IF_ERROR(r.status());
  if (rope.type != RopeType::kDefault && !(rope.factor >= 1.0))
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key, ".factor\" must be >= 1, got ", rope.factor));
  if (rope.type == RopeType::kYarn && rope.original_max_position_embeddings <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field \"", key,
                     ".original_max_position_embeddings\" must be positive for yarn"));
  return absl::OkStatus();
}

absl::Status Invalid(const std::string& source, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": field \"", field, "\" ", what));
}

// compressed-tensors' quantization_config: every config group quantizing
// weights must be one row of common/native_layout.h (its format, num_bits,
// type and a group size it takes; symmetric, strategy group), all groups of
// one format and group; UNIMPLEMENTED naming the field otherwise.
absl::Status ParseCompressedTensors(const json& q, const std::string& source,
                                    QuantizationConfig* out) {
  std::string read;  // the rows, for the messages
  for (const NativeLayout& l : kNativeLayouts) {
    if (l.method != "compressed-tensors") continue;
    absl::StrAppend(&read, read.empty() ? "" : "; ", std::string(l.ct_format), " ",
                    std::string(l.ct_type), " ", l.ct_bits, "-bit symmetric, group ");
    for (int i = 0; i < 3 && l.ct_groups[i] != 0; ++i)
      absl::StrAppend(&read, i == 0 ? "" : "/", l.ct_groups[i]);
  }
  auto unimplemented = [&](const std::string& field, const std::string& what) {
    return absl::UnimplementedError(absl::StrCat(source, ": quantization_config.", field, " ", what,
                                                 " (compressed-tensors read: ", read, ")"));
  };
  const std::string format = q.contains("format") && q["format"].is_string()
                                 ? q["format"].get<std::string>()
                                 : std::string();
  if (!q.contains("config_groups") || !q["config_groups"].is_object() || q["config_groups"].empty())
    return Invalid(source, "quantization_config.config_groups", "must be a non-empty object");
  for (const auto& [name, g] : q["config_groups"].items()) {
    const std::string at = absl::StrCat("config_groups.", name);
    if (!g.is_object()) return Invalid(source, "quantization_config." + at, "must be an object");
    const std::string gformat =
        g.contains("format") && g["format"].is_string() ? g["format"].get<std::string>() : format;
    const NativeLayout* layout = FindCompressedTensorsLayout(gformat);
    if (layout == nullptr) return unimplemented(at + ".format", absl::StrCat("\"", gformat, "\""));
    if (!out->format.empty() && out->format != gformat)
      return unimplemented(
          at + ".format",
          absl::StrCat("\"", gformat, "\" beside another group's \"", out->format, "\""));
    if (!g.contains("weights") || !g["weights"].is_object())
      return Invalid(source, "quantization_config." + at + ".weights", "must be an object");
    Reader w(g["weights"], source, absl::StrCat("quantization_config.", at, ".weights."));
    const int64_t bits = w.Int("num_bits");
    const std::string type = w.StringOr("type", "int");
    const bool symmetric = w.BoolOr("symmetric", true);
    const std::string strategy = w.StringOr("strategy", "group");
    const int64_t group = w.IntOr("group_size", 0);
    RETURN_IF_ERROR(w.status());
    if (bits != layout->ct_bits) return unimplemented(at + ".weights.num_bits", absl::StrCat(bits));
    if (type != layout->ct_type)
      return unimplemented(at + ".weights.type", absl::StrCat("\"", type, "\""));
    if (!symmetric) return unimplemented(at + ".weights.symmetric", "false (zero points)");
    if (strategy != "group")
      return unimplemented(at + ".weights.strategy", absl::StrCat("\"", strategy, "\""));
    if (group <= 0 || (group != layout->ct_groups[0] && group != layout->ct_groups[1] &&
                       group != layout->ct_groups[2]))
      return unimplemented(at + ".weights.group_size", absl::StrCat(group));
    if (out->group_size != 0 && out->group_size != group)
      return unimplemented(at + ".weights.group_size",
                           absl::StrCat(group, " beside another group's ", out->group_size));
    out->group_size = group;
    out->format = gformat;
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// DeepSeek-V4's fields; absent ones take DeepseekV4Config's defaults (V4-Flash).
// Legacy spellings the published checkpoints ship fold in as transformers
// folds them: qk_rope_head_dim (when partial_rotary_factor is absent),
// compress_rate_csa / compress_rate_hca over compress_rates.
absl::Status ParseDeepseekV4Fields(const json& root, Reader& r, const std::string& source,
                                   ModelConfig& c) {
  MoeConfig& m = c.moe;
  V4Config& v = c.v4;
  c.head_dim = r.IntOr("head_dim", 512);
  v.q_lora_rank = r.IntOr("q_lora_rank", 1024);
  v.o_groups = r.IntOr("o_groups", 8);
  v.o_lora_rank = r.IntOr("o_lora_rank", 1024);
  v.sliding_window = r.IntOr("sliding_window", 128);
  v.hc_mult = r.IntOr("hc_mult", 4);
  v.hc_sinkhorn_iters = r.IntOr("hc_sinkhorn_iters", 20);
  v.hc_eps = r.DoubleOr("hc_eps", 1e-6);
  v.swiglu_limit = r.DoubleOr("swiglu_limit", 10.0);
  c.dsa.n_heads = r.IntOr("index_n_heads", 64);
  c.dsa.head_dim = r.IntOr("index_head_dim", 128);
  c.dsa.topk = r.IntOr("index_topk", 512);
  c.dsa.rope_interleave = true;
  m.num_experts = r.IntOr("n_routed_experts", 256);
  m.experts_per_token = r.IntOr("num_experts_per_tok", 6);
  m.intermediate_size = r.IntOr("moe_intermediate_size", 2048);
  m.num_shared_experts = r.IntOr("n_shared_experts", 1);
  c.intermediate_size = m.intermediate_size;  // transformers maps intermediate_size onto it
  m.norm_topk_prob = true;                    // both V4 routers always normalize the chosen scores
  m.routed_scaling_factor = r.DoubleOr("routed_scaling_factor", 1.5);
  m.score_correction_bias = true;  // top-k (moe) layers; hash layers have none
  c.num_nextn_predict_layers = r.IntOr("num_nextn_predict_layers", 1);
  const std::string scoring = r.StringOr("scoring_func", "sqrtsoftplus");
  if (r.Has("partial_rotary_factor")) {
    const double f = r.DoubleOr("partial_rotary_factor", 0.125);
    if (!(f > 0 && f <= 1))
      return Invalid(source, "partial_rotary_factor", absl::StrCat(f, " is outside (0, 1]"));
    v.qk_rope_head_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * f);
  } else if (r.Has("qk_rope_head_dim")) {
    v.qk_rope_head_dim = r.IntOr("qk_rope_head_dim", 64);
  } else {
    v.qk_rope_head_dim = c.head_dim * 64 / 512;
  }
  RETURN_IF_ERROR(r.status());
  if (scoring != "sqrtsoftplus")
    return absl::UnimplementedError(absl::StrCat(source, ": field \"scoring_func\" is \"", scoring,
                                                 "\"; deepseek_v4 runs sqrtsoftplus"));
  m.scoring = ScoringFunc::kSqrtSoftplus;

  v.csa_compress_rate = 4;
  v.hca_compress_rate = 128;
  if (root.contains("compress_rates") && !root["compress_rates"].is_null()) {
    const json& cr = root["compress_rates"];
    if (!cr.is_object()) return Invalid(source, "compress_rates", "must be an object");
    Reader rr(cr, source, "compress_rates.");
    for (const auto& [key, value] : cr.items()) {
      (void)value;
      if (key != "compressed_sparse_attention" && key != "heavily_compressed_attention")
        return Invalid(source, "compress_rates." + key,
                       "is not a layer type with a compressed branch "
                       "(compressed_sparse_attention, heavily_compressed_attention)");
    }
    v.csa_compress_rate = rr.IntOr("compressed_sparse_attention", v.csa_compress_rate);
    v.hca_compress_rate = rr.IntOr("heavily_compressed_attention", v.hca_compress_rate);
    RETURN_IF_ERROR(rr.status());
  }
  v.csa_compress_rate = r.IntOr("compress_rate_csa", v.csa_compress_rate);
  v.hca_compress_rate = r.IntOr("compress_rate_hca", v.hca_compress_rate);
  return r.status();
}

// Sliding layers rotate with rope_theta and no scaling ("main"); compressed
// layers with compress_rope_theta and the config's scaling ("compress",
// YaRN's attention factor 1 unless given). Either rope_parameters {"main",
// "compress"} as transformers writes it, or a flat rope_parameters /
// rope_scaling that only the compressed branch takes.
absl::Status ParseDeepseekV4Rope(const json& root, Reader& r, const std::string& source,
                                 ModelConfig& c) {
  const double main_theta = r.DoubleOr("rope_theta", 10000.0);
  const double compress_theta = r.DoubleOr("compress_rope_theta", 160000.0);
  RETURN_IF_ERROR(r.status());
  const double partial =
      c.head_dim > 0 ? static_cast<double>(c.v4.qk_rope_head_dim) / static_cast<double>(c.head_dim)
                     : 1.0;
  c.rope = RopeConfig{};
  c.rope.theta = main_theta;
  RopeConfig& cr = c.v4.compress_rope;
  cr = RopeConfig{};
  cr.theta = compress_theta;
  const char* key = nullptr;
  if (root.contains("rope_parameters") && !root["rope_parameters"].is_null())
    key = "rope_parameters";
  else if (root.contains("rope_scaling") && !root["rope_scaling"].is_null())
    key = "rope_scaling";
  if (key != nullptr) {
    const json& rp = root[key];
    if (!rp.is_object()) return Invalid(source, key, "must be an object");
    if (rp.contains("main") && rp["main"].is_object() && rp.contains("compress") &&
        rp["compress"].is_object()) {
      RETURN_IF_ERROR(ParseRopeObject(rp["main"], std::string(key) + ".main", source,
                                      c.max_position_embeddings, c.rope));
      RETURN_IF_ERROR(ParseRopeObject(rp["compress"], std::string(key) + ".compress", source,
                                      c.max_position_embeddings, cr));
    } else {
      json flat = json::object();
      for (const auto& [k, x] : rp.items())
        if (k != "main" && k != "compress") flat[k] = x;
      RETURN_IF_ERROR(ParseRopeObject(flat, key, source, c.max_position_embeddings, cr));
      cr.theta = compress_theta;
      if (cr.type == RopeType::kYarn && !cr.attention_factor) cr.attention_factor = 1.0;
    }
  }
  for (RopeConfig* p : {&c.rope, &cr}) {
    p->interleave = true;
    p->partial_rotary_factor = partial;
  }
  if (!(c.rope.theta > 0)) return Invalid(source, "rope_theta", "must be positive");
  if (!(cr.theta > 0)) return Invalid(source, "compress_rope_theta", "must be positive");
  return absl::OkStatus();
}

// The shape fields DeepSeek-V4's layers need, beyond those every family's.
absl::Status CheckDeepseekV4(const std::string& source, const ModelConfig& c) {
  const V4Config& v = c.v4;
  auto positive = [&](const char* field, int64_t x) -> absl::Status {
    if (x <= 0) return Invalid(source, field, absl::StrCat("must be positive, got ", x));
    if (x > (int64_t{1} << 20))
      return Invalid(source, field,
                     absl::StrCat("is ", x, ", over the ", int64_t{1} << 20, " taken"));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  RETURN_IF_ERROR(positive("q_lora_rank", v.q_lora_rank));
  RETURN_IF_ERROR(positive("o_groups", v.o_groups));
  RETURN_IF_ERROR(positive("o_lora_rank", v.o_lora_rank));
  RETURN_IF_ERROR(positive("sliding_window", v.sliding_window));
  RETURN_IF_ERROR(positive("hc_mult", v.hc_mult));
  RETURN_IF_ERROR(positive("hc_sinkhorn_iters", v.hc_sinkhorn_iters));
  RETURN_IF_ERROR(positive("index_n_heads", c.dsa.n_heads));
  RETURN_IF_ERROR(positive("index_head_dim", c.dsa.head_dim));
  RETURN_IF_ERROR(positive("index_topk", c.dsa.topk));
  RETURN_IF_ERROR(positive("n_routed_experts", c.moe.num_experts));
  if (c.num_kv_heads != 1)
    return Invalid(source, "num_key_value_heads",
                   absl::StrCat("is ", c.num_kv_heads, "; deepseek_v4 shares one K=V head"));
  if (!(v.hc_eps > 0)) return Invalid(source, "hc_eps", "must be positive");
  if (!(v.swiglu_limit > 0)) return Invalid(source, "swiglu_limit", "must be positive");
  if (v.qk_rope_head_dim <= 0 || v.qk_rope_head_dim % 2 != 0 || v.qk_rope_head_dim > c.head_dim)
    return Invalid(source, "partial_rotary_factor",
                   absl::StrCat("rotates ", v.qk_rope_head_dim, " of head_dim ", c.head_dim,
                                " dims; must be a positive even count"));
  if (c.dsa.head_dim < v.qk_rope_head_dim)
    return Invalid(source, "index_head_dim",
                   absl::StrCat(c.dsa.head_dim, " is below the ", v.qk_rope_head_dim,
                                " roped dims (the indexer ropes that many)"));
  if (c.num_heads % v.o_groups != 0)
    return Invalid(source, "o_groups",
                   absl::StrCat(v.o_groups, " does not divide num_attention_heads ", c.num_heads));
  return absl::OkStatus();
}

// Each layer's attention kind (layer_types, else the published
// compress_ratios, else DeepseekV4Config's schedule: two hca then csa / hca
// alternating) and router (mlp_layer_types, else num_hash_layers hash_moe
// layers, 3 absent, then moe). Every layer is MoE.
absl::Status DeepseekV4Layers(const json& root, const std::string& source, ModelConfig& c) {
  const size_t n = static_cast<size_t>(c.num_layers);
  std::vector<std::string> types;
  std::string from = "layer_types";
  if (root.contains("layer_types") && !root["layer_types"].is_null()) {
    const json& t = root["layer_types"];
    if (!t.is_array()) return Invalid(source, "layer_types", "must be a list");
    if (t.size() != n)
      return Invalid(source, "layer_types",
                     absl::StrCat("has ", t.size(), " entries for ", n, " layers"));
    for (const auto& x : t) types.push_back(x.is_string() ? x.get<std::string>() : x.dump());
  } else if (root.contains("compress_ratios") && !root["compress_ratios"].is_null()) {
    from = "compress_ratios";
    const json& t = root["compress_ratios"];
    // The published list may go on past the main stack (the MTP layer's); transformers
    // keeps the first num_hidden_layers.
    if (!t.is_array() || t.size() < n)
      return Invalid(source, from, absl::StrCat("must list a rate per layer (", n, ")"));
    for (size_t i = 0; i < n; ++i) {
      const char* type = nullptr;
      for (const auto& row : kV4CompressRatios)
        if (t[i].is_number_integer() && t[i].get<int64_t>() == row.rate) type = row.layer_type;
      if (type == nullptr)
        return Invalid(source, absl::StrCat(from, "[", i, "]"),
                       absl::StrCat("is ", t[i].dump(), "; expected 0, 4 or 128"));
      types.push_back(type);
    }
  } else {
    for (size_t i = 0; i < n; ++i)
      types.push_back(i < 2 || i % 2 == 0 ? "heavily_compressed_attention"
                                          : "compressed_sparse_attention");
  }
  std::vector<bool> hash(n, false);
  if (root.contains("mlp_layer_types") && !root["mlp_layer_types"].is_null()) {
    const json& t = root["mlp_layer_types"];
    if (!t.is_array() || t.size() != n)
      return Invalid(source, "mlp_layer_types",
                     absl::StrCat("must list one of \"hash_moe\" / \"moe\" per layer (", n, ")"));
    for (size_t i = 0; i < n; ++i) {
      if (!t[i].is_string() || (t[i] != "hash_moe" && t[i] != "moe"))
        return Invalid(source, absl::StrCat("mlp_layer_types[", i, "]"),
                       absl::StrCat("is ", t[i].dump(), "; expected \"hash_moe\" or \"moe\""));
      hash[i] = t[i] == "hash_moe";
    }
  } else {
    Reader r(root, source);
    const int64_t n_hash = r.IntOr("num_hash_layers", 3);
    RETURN_IF_ERROR(r.status());
    if (n_hash < 0) return Invalid(source, "num_hash_layers", "must not be negative");
    for (size_t i = 0; i < n && static_cast<int64_t>(i) < n_hash; ++i) hash[i] = true;
  }
  const V4Config& v = c.v4;
  c.layers.assign(n, LayerSpec{});
  for (size_t i = 0; i < n; ++i) {
    const V4LayerTypeRow* row = nullptr;
    for (const V4LayerTypeRow& x : kV4LayerTypes)
      if (types[i] == x.name) row = &x;
    if (row == nullptr) {
      std::string known;
      for (const V4LayerTypeRow& x : kV4LayerTypes)
        absl::StrAppend(&known, known.empty() ? "" : ", ", x.name);
      return Invalid(source, absl::StrCat(from, "[", i, "]"),
                     absl::StrCat("is \"", types[i], "\"; deepseek_v4 layers run ", known));
    }
    LayerSpec& l = c.layers[i];
    l.moe = true;
    l.attention = row->kind;
    l.sliding_window = v.sliding_window;
    l.router = hash[i] ? RouterKind::kHash : RouterKind::kSqrtSoftplusTopk;
    if (*row->compress_key == '\0') continue;
    const bool csa = row->kind == AttentionKind::kV4Csa;
    l.compress_rate = csa ? v.csa_compress_rate : v.hca_compress_rate;
    const std::string field = absl::StrCat("compress_rates.", row->compress_key);
    // A compressed entry covers whole blocks of the window: the window's
    // ring and the compressor's open block end on the same boundary.
    if (l.compress_rate <= 0)
      return Invalid(source, field,
                     absl::StrCat("must be positive, got ", l.compress_rate, " (layer ", i, ")"));
    if (v.sliding_window % l.compress_rate != 0)
      return Invalid(source, field,
                     absl::StrCat(l.compress_rate, " does not divide the sliding_window block of ",
                                  v.sliding_window, " tokens (layer ", i, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

// The text as a JSON object; INVALID_ARGUMENT naming `source` otherwise.
absl::StatusOr<json> ParseJsonObject(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  if (!root.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": JSON is not an object"));
  return root;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  ASSIGN_OR_RETURN(const json root, ParseJsonObject(json_text, source));
  Reader r(root, source);
  ModelConfig c;
  c.model_type = r.StringOr("model_type", "");
  const ArchRow* arch = nullptr;
  for (const ArchRow& row : kArchitectures)
    if (c.model_type == row.model_type) arch = &row;
  if (arch == nullptr) {
    if (c.model_type.empty()) return Invalid(source, "model_type", "is required");
    std::string known;
    for (const ArchRow& row : kArchitectures)
      absl::StrAppend(&known, known.empty() ? "" : ", ", row.model_type);
    return absl::UnimplementedError(
        absl::StrCat(source, ": model_type \"", c.model_type, "\" is not supported (", known, ")"));
  }
  c.arch = arch->arch;
  c.residual = arch->residual;

  c.vocab_size = r.Int("vocab_size");
  c.hidden_size = r.Int("hidden_size");
  c.num_layers = r.Int("num_hidden_layers");
  c.num_heads = r.Int("num_attention_heads");
  const bool v4 = c.arch == Architecture::kDeepseekV4;
  c.num_kv_heads = r.IntOr("num_key_value_heads", v4 ? 1 : c.num_heads);
  // The fields that shape no weight (routing, RoPE, norms, context) take,
  // when a config.json leaves them out, their transformers config class's
  // default (DeepseekV3Config, DeepseekV2Config, Qwen3MoeConfig,
  // MixtralConfig, Glm4MoeConfig), as transformers would run it; nothing else could notice
  // them missing. Shape fields a config leaves out are checked against the
  // checkpoint's tensors (CheckWeights) instead.
  const bool mixtral = c.arch == Architecture::kMixtral;
  const bool glm4 = c.arch == Architecture::kGlm4Moe;
  const bool glm_dsa = c.arch == Architecture::kGlmMoeDsa;
  const bool dsa = arch->attention == AttentionKind::kMlaDsa;
  c.max_position_embeddings =
      r.IntOr("max_position_embeddings", mixtral || glm4                        ? 4096 * 32
                                         : c.arch == Architecture::kQwen3Moe    ? 32768
                                         : c.arch == Architecture::kDeepseekV2  ? 2048
                                         : c.arch == Architecture::kDeepseekV32 ? 163840
                                         : glm_dsa                              ? 202752
                                         : v4                                   ? 1048576
                                                                                : 4096);
  c.rms_norm_eps = r.DoubleOr("rms_norm_eps", mixtral || glm4 || glm_dsa ? 1e-5 : 1e-6);
  if (mixtral) c.rope.theta = 1e6;
  c.tie_word_embeddings = r.BoolOr("tie_word_embeddings", false);
  c.attention_bias = r.BoolOr("attention_bias", false);
  c.bos_token_id = r.OptInt("bos_token_id");
  c.eos_token_ids = r.IntList("eos_token_id");
  const std::string act = r.StringOr("hidden_act", "silu");
  RETURN_IF_ERROR(r.status());
  if (act != "silu")
    return absl::UnimplementedError(absl::StrCat(source, ": hidden_act \"", act, "\" (only silu)"));

  auto& m = c.moe;
  switch (c.arch) {
    case Architecture::kDeepseekV3:
    case Architecture::kDeepseekV32:
    case Architecture::kGlmMoeDsa:
    case Architecture::kDeepseekV2: {
      const bool v3 = c.arch != Architecture::kDeepseekV2;
      c.intermediate_size = r.Int("intermediate_size");
      c.mla.q_lora_rank = r.OptInt("q_lora_rank");
      c.mla.kv_lora_rank = r.Int("kv_lora_rank");
      c.mla.qk_nope_head_dim = r.Int("qk_nope_head_dim");
      c.mla.qk_rope_head_dim = r.Int("qk_rope_head_dim");
      c.mla.v_head_dim = r.Int("v_head_dim");
      m.num_experts = r.IntOr("n_routed_experts", 0);
      m.experts_per_token = r.IntOr("num_experts_per_tok", 0);
      m.intermediate_size = r.IntOr("moe_intermediate_size", 0);
      m.num_shared_experts = r.IntOr("n_shared_experts", 0);
      const std::string scoring = r.StringOr("scoring_func", v3 ? "sigmoid" : "softmax");
      const std::string method = r.StringOr("topk_method", v3 ? "noaux_tc" : "greedy");
      m.n_group = r.IntOr("n_group", v3 && !glm_dsa ? 8 : 1);
      m.topk_group = r.IntOr("topk_group", v3 && !glm_dsa ? 4 : m.n_group);
      m.norm_topk_prob = r.BoolOr("norm_topk_prob", v3);
      m.routed_scaling_factor = r.DoubleOr("routed_scaling_factor", v3 ? 2.5 : 1.0);
      c.first_k_dense_replace = r.IntOr("first_k_dense_replace", dsa ? 3 : 0);
      c.moe_layer_freq = r.IntOr("moe_layer_freq", 1);
      c.num_nextn_predict_layers = r.IntOr("num_nextn_predict_layers", 0);
      if (dsa) {  // DeepseekV32Config's / GlmMoeDsaConfig's defaults
        c.dsa.n_heads = r.IntOr("index_n_heads", glm_dsa ? 32 : 64);
        c.dsa.head_dim = r.IntOr("index_head_dim", 128);
        c.dsa.topk = r.IntOr("index_topk", 2048);
        c.dsa.rope_interleave = glm_dsa;
      }
      RETURN_IF_ERROR(r.status());
      if (scoring == "softmax")
        m.scoring = ScoringFunc::kSoftmax;
      else if (scoring == "sigmoid")
        m.scoring = ScoringFunc::kSigmoid;
      else
        return Invalid(source, "scoring_func",
                       absl::StrCat("is \"", scoring, "\"; expected softmax or sigmoid"));
      if (method == "greedy")
        m.topk_method = TopkMethod::kGreedy;
      else if (method == "group_limited_greedy")
        m.topk_method = TopkMethod::kGroupLimitedGreedy;
      else if (method == "noaux_tc")
        m.topk_method = TopkMethod::kNoauxTc;
      else
        return Invalid(
            source, "topk_method",
            absl::StrCat("is \"", method, "\"; expected greedy, group_limited_greedy or noaux_tc"));
      // transformers' DeepseekV3, V3.2 and GlmMoeDsa always route with the bias and groups
      // (noaux_tc).
      if (v3 && m.topk_method != TopkMethod::kNoauxTc)
        return Invalid(
            source, "topk_method",
            absl::StrCat("is \"", method, "\"; ", c.model_type, " routes with noaux_tc"));
      m.score_correction_bias = m.topk_method == TopkMethod::kNoauxTc;
      if (m.topk_method == TopkMethod::kGreedy) m.n_group = m.topk_group = 1;
      break;
    }
    case Architecture::kQwen3Moe: {
      c.intermediate_size = r.IntOr("intermediate_size", 0);
      c.head_dim = r.IntOr("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
      m.num_experts = r.Has("num_experts") ? r.Int("num_experts") : r.IntOr("num_local_experts", 0);
      m.experts_per_token = r.Int("num_experts_per_tok");
      m.intermediate_size = r.Int("moe_intermediate_size");
      m.norm_topk_prob = r.BoolOr("norm_topk_prob", false);
      c.decoder_sparse_step = r.IntOr("decoder_sparse_step", 1);
      c.mlp_only_layers = r.IntList("mlp_only_layers");
      m.scoring = ScoringFunc::kSoftmax;
      c.qk_norm = true;
      break;
    }
    case Architecture::kGlm4Moe: {
      // Glm4MoeConfig's defaults; routing is always sigmoid + correction
      // bias within the best groups (Glm4MoeTopkRouter).
      c.intermediate_size = r.IntOr("intermediate_size", 10944);
      c.head_dim = r.IntOr("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
      c.qk_norm = r.BoolOr("use_qk_norm", false);
      m.num_experts = r.IntOr("n_routed_experts", 128);
      m.experts_per_token = r.IntOr("num_experts_per_tok", 8);
      m.intermediate_size = r.IntOr("moe_intermediate_size", 1408);
      m.num_shared_experts = r.IntOr("n_shared_experts", 1);
      m.n_group = r.IntOr("n_group", 1);
      m.topk_group = r.IntOr("topk_group", 1);
      m.norm_topk_prob = r.BoolOr("norm_topk_prob", true);
      m.routed_scaling_factor = r.DoubleOr("routed_scaling_factor", 1.0);
      m.scoring = ScoringFunc::kSigmoid;
      m.topk_method = TopkMethod::kNoauxTc;
      m.score_correction_bias = true;
      c.first_k_dense_replace = r.IntOr("first_k_dense_replace", 1);
      c.num_nextn_predict_layers = r.IntOr("num_nextn_predict_layers", 0);
      // transformers 5 keeps it in rope_parameters, published configs at the
      // top level; absent, Glm4MoeConfig's 0.5.
      c.rope.partial_rotary_factor = r.DoubleOr("partial_rotary_factor", 0.5);
      const char* rope_key = root.contains("rope_parameters") ? "rope_parameters" : "rope_scaling";
      if (root.contains(rope_key) && root[rope_key].is_object()) {
        Reader rr(root[rope_key], source, std::string(rope_key) + ".");
        c.rope.partial_rotary_factor =
            rr.DoubleOr("partial_rotary_factor", c.rope.partial_rotary_factor);
        RETURN_IF_ERROR(rr.status());
      }
      break;
    }
    case Architecture::kDeepseekV4:
      RETURN_IF_ERROR(ParseDeepseekV4Fields(root, r, source, c));
      break;
    case Architecture::kMixtral: {
      c.head_dim = r.IntOr("head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
      m.num_experts = r.Int("num_local_experts");
      m.experts_per_token = r.Int("num_experts_per_tok");
      m.intermediate_size = r.Int("intermediate_size");
      m.norm_topk_prob = true;  // Mixtral renormalizes the top-k softmax
      m.scoring = ScoringFunc::kSoftmax;
      RETURN_IF_ERROR(r.status());
      // Every Mixtral layer is a MoE layer: it needs experts.
      if (m.num_experts <= 0)
        return Invalid(
            source, "num_local_experts",
            absl::StrCat("must be positive (every mixtral layer routes), got ", m.num_experts));
      break;
    }
  }
  RETURN_IF_ERROR(r.status());
  if (v4)
    RETURN_IF_ERROR(ParseDeepseekV4Rope(root, r, source, c));
  else
    RETURN_IF_ERROR(ParseRope(root, r, source, c));

  if (root.contains("quantization_config") && !root["quantization_config"].is_null()) {
    const json& q = root["quantization_config"];
    if (!q.is_object()) return Invalid(source, "quantization_config", "must be an object");
    Reader qr(q, source, "quantization_config.");
    c.quantization.method = qr.StringOr("quant_method", "");
    RETURN_IF_ERROR(qr.status());
    const std::string& method = c.quantization.method;
    if (method == "fp8") {
      c.quantization.weight_block = qr.IntList("weight_block_size");
      RETURN_IF_ERROR(qr.status());
      if (c.quantization.weight_block.size() != 2 || c.quantization.weight_block[0] <= 0 ||
          c.quantization.weight_block[1] <= 0)
        return Invalid(source, "quantization_config.weight_block_size",
                       "must be two positive integers");
    } else if (method == "compressed-tensors") {
      RETURN_IF_ERROR(ParseCompressedTensors(q, source, &c.quantization));
    } else if (method != "mxfp4" && method != "mxfp8") {
      return absl::UnimplementedError(
          absl::StrCat(source, ": quantization_config.quant_method \"", method,
                       "\" (read: fp8, compressed-tensors, mxfp4, mxfp8)"));
    }
  }

  // ---- consistency --------------------------------------------------------------
  // Sizes are positive and below bounds no real model nears (far above
  // DeepSeek-V3's), so that nothing sized from them overflows or asks for
  // terabytes: `hmoe inspect` multiplies them, layers are allocated per
  // num_hidden_layers.
  auto positive = [&](const char* field, int64_t v) -> absl::Status {
    if (v <= 0) return Invalid(source, field, absl::StrCat("must be positive, got ", v));
    const int64_t max = std::string_view(field) == "max_position_embeddings" ? (int64_t{1} << 30)
                        : std::string_view(field) == "vocab_size"            ? (int64_t{1} << 24)
                        : std::string_view(field) == "num_hidden_layers"     ? 4096
                                                                             : (int64_t{1} << 20);
    if (v > max)
      return Invalid(source, field, absl::StrCat("is ", v, ", over the ", max, " taken"));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", c.num_layers));
  RETURN_IF_ERROR(positive("num_attention_heads", c.num_heads));
  RETURN_IF_ERROR(positive("num_key_value_heads", c.num_kv_heads));
  RETURN_IF_ERROR(positive("max_position_embeddings", c.max_position_embeddings));
  if (!(c.rms_norm_eps > 0)) return Invalid(source, "rms_norm_eps", "must be positive");
  if (!(c.rope.theta > 0)) return Invalid(source, "rope_theta", "must be positive");
  if (c.num_heads % c.num_kv_heads != 0)
    return Invalid(
        source, "num_key_value_heads",
        absl::StrCat(c.num_kv_heads, " does not divide num_attention_heads ", c.num_heads));
  if (c.is_mla()) {
    RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
    if (c.mla.q_lora_rank) RETURN_IF_ERROR(positive("q_lora_rank", *c.mla.q_lora_rank));
    RETURN_IF_ERROR(positive("kv_lora_rank", c.mla.kv_lora_rank));
    RETURN_IF_ERROR(positive("qk_nope_head_dim", c.mla.qk_nope_head_dim));
    RETURN_IF_ERROR(positive("qk_rope_head_dim", c.mla.qk_rope_head_dim));
    RETURN_IF_ERROR(positive("v_head_dim", c.mla.v_head_dim));
    if (c.mla.qk_rope_head_dim % 2 != 0) return Invalid(source, "qk_rope_head_dim", "must be even");
    if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_layers)
      return Invalid(source, "first_k_dense_replace",
                     absl::StrCat(c.first_k_dense_replace, " is outside [0, num_hidden_layers]"));
    RETURN_IF_ERROR(positive("moe_layer_freq", c.moe_layer_freq));
  } else if (v4) {
    RETURN_IF_ERROR(CheckDeepseekV4(source, c));
  } else {
    RETURN_IF_ERROR(positive("head_dim", c.head_dim));
    if (c.head_dim % 2 != 0) return Invalid(source, "head_dim", "must be even");
    if (!(c.rope.partial_rotary_factor > 0 && c.rope.partial_rotary_factor <= 1))
      return Invalid(source, "partial_rotary_factor",
                     absl::StrCat(c.rope.partial_rotary_factor, " is outside (0, 1]"));
    const int64_t rotary = static_cast<int64_t>(c.head_dim * c.rope.partial_rotary_factor);
    if (rotary <= 0 || rotary % 2 != 0)
      return Invalid(source, "partial_rotary_factor",
                     absl::StrCat("rotates ", rotary, " of head_dim ", c.head_dim,
                                  " dims; must be a positive even count"));
    if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_layers)
      return Invalid(source, "first_k_dense_replace",
                     absl::StrCat(c.first_k_dense_replace, " is outside [0, num_hidden_layers]"));
    RETURN_IF_ERROR(positive("decoder_sparse_step", c.decoder_sparse_step));
    for (int64_t l : c.mlp_only_layers)
      if (l < 0 || l >= c.num_layers)
        return Invalid(source, "mlp_only_layers",
                       absl::StrCat("names layer ", l, " outside [0, ", c.num_layers, ")"));
  }
  if (arch->attention == AttentionKind::kMlaDsa) {
    if (!c.mla.q_lora_rank)
      return Invalid(source, "q_lora_rank",
                     "is required: the DSA indexer's queries read the q LoRA");
    RETURN_IF_ERROR(positive("index_n_heads", c.dsa.n_heads));
    RETURN_IF_ERROR(positive("index_head_dim", c.dsa.head_dim));
    RETURN_IF_ERROR(positive("index_topk", c.dsa.topk));
    if (c.dsa.head_dim < c.mla.qk_rope_head_dim)
      return Invalid(source, "index_head_dim",
                     absl::StrCat(c.dsa.head_dim, " is below qk_rope_head_dim ",
                                  c.mla.qk_rope_head_dim, " (the indexer ropes that many dims)"));
    if (c.dsa.topk > c.max_position_embeddings)
      return Invalid(
          source, "index_topk",
          absl::StrCat(c.dsa.topk, " exceeds the context limit (max_position_embeddings ",
                       c.max_position_embeddings, ")"));
  }
  // The routed-expert count's field, as this family spells it.
  const char* experts_field = c.is_mla() || glm4 || v4       ? "n_routed_experts"
                              : root.contains("num_experts") ? "num_experts"
                                                             : "num_local_experts";
  if (m.num_experts < 0) return Invalid(source, experts_field, "must not be negative");
  if (m.num_experts > 65536) return Invalid(source, experts_field, "is over the 65536 taken");
  if (m.num_experts > 0) {
    const char* k_field = "num_experts_per_tok";
    RETURN_IF_ERROR(positive(k_field, m.experts_per_token));
    RETURN_IF_ERROR(positive("moe_intermediate_size", m.intermediate_size));
    if (m.experts_per_token > m.num_experts)
      return Invalid(
          source, k_field,
          absl::StrCat(m.experts_per_token, " exceeds the ", m.num_experts, " routed experts"));
    if (m.num_shared_experts < 0)
      return Invalid(source, "n_shared_experts", "must not be negative");
    RETURN_IF_ERROR(positive("n_group", m.n_group));
    if (m.num_experts % m.n_group != 0)
      return Invalid(
          source, "n_group",
          absl::StrCat(m.n_group, " does not divide the ", m.num_experts, " routed experts"));
    if (m.topk_group <= 0 || m.topk_group > m.n_group)
      return Invalid(source, "topk_group",
                     absl::StrCat(m.topk_group, " is outside [1, n_group=", m.n_group, "]"));
    if (m.experts_per_token > m.topk_group * (m.num_experts / m.n_group))
      return Invalid(source, "num_experts_per_tok",
                     absl::StrCat(m.experts_per_token, " exceeds the ",
                                  m.topk_group * (m.num_experts / m.n_group),
                                  " experts in the top ", m.topk_group, " groups"));
    if (m.topk_method == TopkMethod::kNoauxTc && m.num_experts / m.n_group < 2)
      return Invalid(source, "n_group",
                     "noaux_tc ranks groups by their top-2 scores; each group needs >= 2 experts");
    if (!(m.routed_scaling_factor > 0))
      return Invalid(source, "routed_scaling_factor", "must be positive");
  }
  for (int64_t id : c.eos_token_ids)
    if (id < 0 || id >= c.vocab_size)
      return Invalid(source, "eos_token_id", absl::StrCat(id, " is outside the vocabulary"));

  // ---- per-layer kinds ------------------------------------------------------------
  if (v4) {
    RETURN_IF_ERROR(DeepseekV4Layers(root, source, c));
    return c;
  }
  int64_t window = 0;
  if (root.contains("sliding_window") && !root["sliding_window"].is_null()) {
    window = r.IntOr("sliding_window", 0);
    RETURN_IF_ERROR(r.status());
    if (window < 0) return Invalid(source, "sliding_window", "must not be negative");
  }
  const bool qwen_window =
      c.arch == Architecture::kQwen3Moe && r.BoolOr("use_sliding_window", false);
  // Layers >= max_window_layers use the window. Without the key (transformers 5
  // writes none for qwen3_moe) every layer does, as transformers 5 runs it.
  const int64_t max_window_layers = r.IntOr("max_window_layers", 0);
  std::vector<std::string> layer_types;
  if (root.contains("layer_types") && root["layer_types"].is_array()) {
    for (const auto& t : root["layer_types"]) {
      if (!t.is_string()) return Invalid(source, "layer_types", "must hold strings");
      layer_types.push_back(t.get<std::string>());
    }
    if (static_cast<int64_t>(layer_types.size()) != c.num_layers)
      return Invalid(
          source, "layer_types",
          absl::StrCat("has ", layer_types.size(), " entries for ", c.num_layers, " layers"));
  }
  RETURN_IF_ERROR(r.status());
  // Each layer_types entry names a row of kLayerTypes.
  std::vector<const LayerTypeRow*> layer_type_rows(layer_types.size(), nullptr);
  for (size_t i = 0; i < layer_types.size(); ++i) {
    for (const LayerTypeRow& row : kLayerTypes)
      if (layer_types[i] == row.name) layer_type_rows[i] = &row;
    if (layer_type_rows[i] == nullptr) {
      std::string known;
      for (const LayerTypeRow& row : kLayerTypes)
        absl::StrAppend(&known, known.empty() ? "" : ", ", row.name);
      return absl::UnimplementedError(absl::StrCat(source, ": field \"layer_types[", i, "]\" is \"",
                                                   layer_types[i], "\"; supported: ", known));
    }
    // Indexed (DSA) layers are exactly those of an mla_dsa architecture.
    if (layer_type_rows[i]->indexed != (arch->attention == AttentionKind::kMlaDsa))
      return Invalid(
          source, absl::StrCat("layer_types[", i, "]"),
          absl::StrCat("is \"", layer_types[i], "\", which ", c.model_type, " layers do not run"));
  }
  // DeepSeek-V3.2, GLM-MoE-DSA: mlp_layer_types ("dense" / "sparse" per
  // layer) when given, else first_k_dense_replace dense layers, as their
  // transformers configs.
  std::vector<bool> sparse_mlp;
  if (dsa && root.contains("mlp_layer_types") && !root["mlp_layer_types"].is_null()) {
    const json& t = root["mlp_layer_types"];
    if (!t.is_array() || static_cast<int64_t>(t.size()) != c.num_layers)
      return Invalid(
          source, "mlp_layer_types",
          absl::StrCat("must list one of \"dense\" / \"sparse\" per layer (", c.num_layers, ")"));
    for (size_t i = 0; i < t.size(); ++i) {
      if (!t[i].is_string() || (t[i] != "dense" && t[i] != "sparse"))
        return Invalid(source, absl::StrCat("mlp_layer_types[", i, "]"),
                       absl::StrCat("is ", t[i].dump(), "; expected \"dense\" or \"sparse\""));
      sparse_mlp.push_back(t[i] == "sparse");
    }
  }
  // GLM-MoE-DSA: per layer "full" (its own indexer) or "shared" (the previous
  // full layer's selection): indexer_types, else as GlmMoeDsaConfig derives it
  // from index_topk_pattern ("F"/"S" per layer) or index_topk_freq /
  // index_skip_topk_offset. Shared layers are not implemented here.
  if (glm_dsa) {
    std::vector<std::string> types;
    std::string from = "indexer_types";
    if (root.contains("indexer_types") && !root["indexer_types"].is_null()) {
      const json& t = root["indexer_types"];
      if (!t.is_array()) return Invalid(source, from, "must be a list");
      for (const auto& x : t) types.push_back(x.is_string() ? x.get<std::string>() : x.dump());
    } else if (root.contains("index_topk_pattern") && root["index_topk_pattern"].is_string()) {
      from = "index_topk_pattern";
      for (char ch : root["index_topk_pattern"].get<std::string>())
        types.push_back(ch == 'F' ? "full" : ch == 'S' ? "shared" : std::string(1, ch));
    } else {
      from = "index_topk_freq";
      const int64_t freq = std::max<int64_t>(r.IntOr("index_topk_freq", 1), 1);
      const int64_t offset = r.IntOr("index_skip_topk_offset", 2);
      RETURN_IF_ERROR(r.status());
      for (int64_t i = 0; i < c.num_layers; ++i)
        types.push_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared");
    }
    if (static_cast<int64_t>(types.size()) != c.num_layers)
      return Invalid(source, from,
                     absl::StrCat("has ", types.size(), " entries for ", c.num_layers, " layers"));
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] == "shared")
        return absl::UnimplementedError(absl::StrCat(source, ": field \"", from, "\" makes layer ",
                                                     i,
                                                     " \"shared\" (it reuses the previous layer's "
                                                     "DSA selection), which is not implemented"));
      if (types[i] != "full")
        return Invalid(source, absl::StrCat(from, "[", i, "]"),
                       absl::StrCat("is \"", types[i], "\"; expected full or shared"));
    }
  }
  c.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerSpec& l = c.layers[static_cast<size_t>(i)];
    // The layer's attention and router kinds: its architecture's.
    l.attention = arch->attention;
    l.router = arch->router;
    switch (c.arch) {
      case Architecture::kDeepseekV3:
      case Architecture::kDeepseekV2:
        l.moe = m.num_experts > 0 && i >= c.first_k_dense_replace && i % c.moe_layer_freq == 0;
        break;
      case Architecture::kDeepseekV32:
      case Architecture::kGlmMoeDsa:
        l.moe = m.num_experts > 0 && (sparse_mlp.empty() ? i >= c.first_k_dense_replace
                                                         : sparse_mlp[static_cast<size_t>(i)]);
        break;
      case Architecture::kQwen3Moe:
        l.moe = m.num_experts > 0 &&
                std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), i) ==
                    c.mlp_only_layers.end() &&
                (i + 1) % c.decoder_sparse_step == 0;
        if (!layer_types.empty()) {
          l.sliding_window = layer_type_rows[static_cast<size_t>(i)]->sliding ? window : 0;
        } else {
          l.sliding_window = qwen_window && i >= max_window_layers ? window : 0;
        }
        break;
      case Architecture::kMixtral:
        l.moe = true;
        l.sliding_window = window;
        break;
      case Architecture::kGlm4Moe:
        l.moe = m.num_experts > 0 && i >= c.first_k_dense_replace;
        break;
      case Architecture::kDeepseekV4:  // DeepseekV4Layers made its layers
        break;
    }
    if (!l.moe && c.intermediate_size <= 0)
      return Invalid(source, "intermediate_size",
                     absl::StrCat("must be positive: layer ", i, " is a dense MLP"));
  }
  return c;
}

absl::Status MergeGenerationConfig(const std::string& json_text, const std::string& source,
                                   ModelConfig& c) {
  ASSIGN_OR_RETURN(const json root, ParseJsonObject(json_text, source));
  Reader r(root, source);
  const std::vector<int64_t> eos = r.IntList("eos_token_id");
  RETURN_IF_ERROR(r.status());
  for (int64_t id : eos) {
    if (id < 0 || id >= c.vocab_size)
      return Invalid(source, "eos_token_id", absl::StrCat(id, " is outside the vocabulary"));
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
      c.eos_token_ids.push_back(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxConfigJsonBytes));
  ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(text, path));
  const std::string gen = (std::filesystem::path(model_dir) / "generation_config.json").string();
  absl::StatusOr<std::string> gtext = ReadSmallFile(gen, kMaxConfigJsonBytes);
  if (gtext.ok()) {
    RETURN_IF_ERROR(MergeGenerationConfig(*gtext, gen, c));
  } else if (!absl::IsNotFound(gtext.status())) {
    return gtext.status();
  }
  return c;
}

}  // namespace hmoe
