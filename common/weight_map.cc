#include "common/weight_map.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/native_layout.h"
#include "common/status.h"

namespace hmoe {
namespace {

std::string L(int layer) { return absl::StrCat("model.layers.", layer, "."); }

const char* ProjName(const ModelConfig& c, ExpertProj p) {
  const bool mixtral = c.arch == Architecture::kMixtral || c.arch == Architecture::kDeepseekV4;
  switch (p) {
    case ExpertProj::kGate:
      return mixtral ? "w1" : "gate_proj";
    case ExpertProj::kUp:
      return mixtral ? "w3" : "up_proj";
    case ExpertProj::kDown:
      return mixtral ? "w2" : "down_proj";
    case ExpertProj::kNone:
      break;
  }
  return "?";
}

void AddMlp(std::vector<WeightSpec>& out, const std::string& prefix, int64_t hidden, int64_t inter,
            WeightRole role, int layer) {
  out.push_back({prefix + "gate_proj.weight", {inter, hidden}, role, layer});
  out.push_back({prefix + "up_proj.weight", {inter, hidden}, role, layer});
  out.push_back({prefix + "down_proj.weight", {hidden, inter}, role, layer});
}

// DeepSeek-V4's tensors, named as its checkpoints (and transformers' save)
// name them. The mHC mixing weights count as norms; tid2eid and the gate's
// bias (the correction bias) are buffers (kRouter, not parameters).
void AddDeepseekV4(const ModelConfig& c, std::vector<WeightSpec>& out) {
  const int64_t H = c.hidden_size, D = c.head_dim, Q = c.v4.q_lora_rank, N = c.num_heads;
  const int64_t G = c.v4.o_groups, R = c.v4.o_lora_rank, M = c.v4.hc_mult;
  const int64_t ID = c.dsa.head_dim, IH = c.dsa.n_heads, E = c.moe.num_experts;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, WeightRole::kEmbedding});
  for (int i = 0; i < static_cast<int>(c.num_layers); ++i) {
    const LayerSpec& l = c.layers[static_cast<size_t>(i)];
    const std::string p = L(i), a = p + "attn.", f = p + "ffn.";
    for (const char* hc : {"hc_attn_", "hc_ffn_"}) {
      out.push_back({p + hc + "fn", {(2 + M) * M, M * H}, WeightRole::kNorm, i});
      out.push_back({p + hc + "base", {(2 + M) * M}, WeightRole::kNorm, i});
      out.push_back({p + hc + "scale", {3}, WeightRole::kNorm, i});
    }
    out.push_back({p + "attn_norm.weight", {H}, WeightRole::kNorm, i});
    out.push_back({a + "wq_a.weight", {Q, H}, WeightRole::kAttention, i});
    out.push_back({a + "q_norm.weight", {Q}, WeightRole::kNorm, i});
    out.push_back({a + "wq_b.weight", {N * D, Q}, WeightRole::kAttention, i});
    out.push_back({a + "wkv.weight", {D, H}, WeightRole::kAttention, i});
    out.push_back({a + "norm.weight", {D}, WeightRole::kNorm, i});
    out.push_back({a + "wo_a.weight", {G * R, N * D / G}, WeightRole::kAttention, i});
    out.push_back({a + "wo_b.weight", {H, G * R}, WeightRole::kAttention, i});
    out.push_back({a + "attn_sink", {N}, WeightRole::kAttention, i});
    // The compressor (csa: two overlapping series, hence 2 * D) and the csa
    // indexer's own compressor, queries and head weights.
    auto compressor = [&](const std::string& x, int64_t d) {
      out.push_back({x + "ape", {l.compress_rate, d}, WeightRole::kAttention, i});
      out.push_back({x + "norm.weight",
                     {d / (l.attention == AttentionKind::kV4Csa ? 2 : 1)},
                     WeightRole::kNorm,
                     i});
      out.push_back({x + "wgate.weight", {d, H}, WeightRole::kAttention, i});
      out.push_back({x + "wkv.weight", {d, H}, WeightRole::kAttention, i});
    };
    if (l.attention == AttentionKind::kV4Hca) compressor(a + "compressor.", D);
    if (l.attention == AttentionKind::kV4Csa) {
      compressor(a + "compressor.", 2 * D);
      compressor(a + "indexer.compressor.", 2 * ID);
      out.push_back({a + "indexer.weights_proj.weight", {IH, H}, WeightRole::kAttention, i});
      out.push_back({a + "indexer.wq_b.weight", {IH * ID, Q}, WeightRole::kAttention, i});
    }
    out.push_back({p + "ffn_norm.weight", {H}, WeightRole::kNorm, i});
    out.push_back({f + "gate.weight", {E, H}, WeightRole::kRouter, i});
    if (l.router == RouterKind::kHash)
      out.push_back(
          {f + "gate.tid2eid", {c.vocab_size, c.moe.experts_per_token}, WeightRole::kRouter, i});
    else
      out.push_back({f + "gate.bias", {E}, WeightRole::kRouter, i});
    for (int e = 0; e < static_cast<int>(E); ++e) {
      const int64_t I = c.moe.intermediate_size;
      for (ExpertProj pr : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown})
        out.push_back({ExpertWeightName(c, i, e, pr),
                       pr == ExpertProj::kDown ? Shape{H, I} : Shape{I, H},
                       WeightRole::kRoutedExpert, i, e, pr});
    }
    const int64_t S = c.moe.intermediate_size * c.moe.num_shared_experts;
    if (S > 0) {
      out.push_back({f + "shared_experts.w1.weight", {S, H}, WeightRole::kSharedExpert, i});
      out.push_back({f + "shared_experts.w2.weight", {H, S}, WeightRole::kSharedExpert, i});
      out.push_back({f + "shared_experts.w3.weight", {S, H}, WeightRole::kSharedExpert, i});
    }
  }
  out.push_back({"model.hc_head.hc_fn", {M, M * H}, WeightRole::kNorm});
  out.push_back({"model.hc_head.hc_base", {M}, WeightRole::kNorm});
  out.push_back({"model.hc_head.hc_scale", {1}, WeightRole::kNorm});
  out.push_back({"model.norm.weight", {H}, WeightRole::kNorm});
  if (!c.tie_word_embeddings)
    out.push_back({"head.weight", {c.vocab_size, H}, WeightRole::kLmHead});
}

// A router buffer, not a parameter: the correction bias (V3's
// e_score_correction_bias, V4's gate.bias) or V4's tid2eid table.
bool IsRouterBuffer(const WeightSpec& w) {
  return w.role == WeightRole::kRouter &&
         (w.shape.size() == 1 || absl::EndsWith(w.name, ".tid2eid"));
}

bool IsHashTable(const WeightSpec& w) {
  return w.role == WeightRole::kRouter && absl::EndsWith(w.name, ".tid2eid");
}

}  // namespace

std::string ExpertWeightName(const ModelConfig& c, int layer, int expert, ExpertProj proj) {
  const char* block = c.arch == Architecture::kMixtral      ? "block_sparse_moe"
                      : c.arch == Architecture::kDeepseekV4 ? "ffn"
                                                            : "mlp";
  return absl::StrCat(L(layer), block, ".experts.", expert, ".", ProjName(c, proj), ".weight");
}

std::string NativeTensorName(const std::string& weight_name, std::string_view suffix) {
  std::string out = weight_name;
  if (absl::EndsWith(out, ".weight")) out.resize(out.size() - 7);
  return out.append(suffix);
}

std::vector<std::string> NativeExpertTensors(const ModelConfig& c, const std::string& weight_name) {
  const NativeLayout* l = FindNativeLayout(c.quantization);
  if (l == nullptr || l->codes == ".weight") return {};
  std::vector<std::string> out = {NativeTensorName(weight_name, l->codes),
                                  NativeTensorName(weight_name, l->scales)};
  if (!l->shape.empty()) out.push_back(NativeTensorName(weight_name, l->shape));
  return out;
}

absl::StatusOr<std::string> RoutedExpertsFingerprint(const Checkpoint& ckpt, const ModelConfig& c) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  auto mix_tensor = [&](const std::string& name) -> absl::Status {
    const TensorEntry* e = ckpt.Find(name);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat(ckpt.dir(), ": no tensor ", name));
    absl::StatusOr<Tensor> t = ckpt.Get(name);
    if (!t.ok()) return t.status();
    const std::string desc =
        absl::StrCat(name, "|", DTypeName(e->dtype), "|", absl::StrJoin(e->shape, ","), "|");
    mix(desc.data(), desc.size());
    const size_t n = static_cast<size_t>(t->nbytes()), k = std::min<size_t>(n, 4096);
    const auto* bytes = static_cast<const uint8_t*>(t->raw());
    mix(bytes, k);
    mix(bytes + (n - k), k);
    return absl::OkStatus();
  };
  const int64_t E = c.moe.num_experts;
  for (size_t l = 0; l < c.layers.size(); ++l) {
    if (!c.layers[l].moe) continue;
    for (int64_t e : {int64_t{0}, E / 2, E - 1}) {
      for (ExpertProj p : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
        const std::string w = ExpertWeightName(c, static_cast<int>(l), static_cast<int>(e), p);
        const std::vector<std::string> native = NativeExpertTensors(c, w);
        if (!ckpt.Has(w) && !native.empty() && ckpt.Has(native[0])) {
          for (const std::string& n : native)
            if (ckpt.Has(n)) RETURN_IF_ERROR(mix_tensor(n));
          continue;
        }
        RETURN_IF_ERROR(mix_tensor(w));
        if (ckpt.Has(ScaleInvName(w))) RETURN_IF_ERROR(mix_tensor(ScaleInvName(w)));
        if (ckpt.Has(w + "_scale")) RETURN_IF_ERROR(mix_tensor(w + "_scale"));
      }
    }
  }
  return absl::StrFormat("%016x", h);
}

std::string ScaleInvName(const std::string& weight_name) { return weight_name + "_scale_inv"; }

std::vector<WeightSpec> ExpectedWeights(const ModelConfig& c) {
  std::vector<WeightSpec> out;
  if (c.arch == Architecture::kDeepseekV4) {
    AddDeepseekV4(c, out);
    return out;
  }
  const int64_t H = c.hidden_size;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, WeightRole::kEmbedding});
  for (int i = 0; i < static_cast<int>(c.num_layers); ++i) {
    const std::string p = L(i);
    out.push_back({p + "input_layernorm.weight", {H}, WeightRole::kNorm, i});
    const std::string a = p + "self_attn.";
    if (c.is_mla()) {
      const auto& m = c.mla;
      const int64_t qk = m.qk_head_dim();
      if (m.q_lora_rank) {
        out.push_back({a + "q_a_proj.weight", {*m.q_lora_rank, H}, WeightRole::kAttention, i});
        out.push_back({a + "q_a_layernorm.weight", {*m.q_lora_rank}, WeightRole::kNorm, i});
        out.push_back(
            {a + "q_b_proj.weight", {c.num_heads * qk, *m.q_lora_rank}, WeightRole::kAttention, i});
      } else {
        out.push_back({a + "q_proj.weight", {c.num_heads * qk, H}, WeightRole::kAttention, i});
      }
      out.push_back({a + "kv_a_proj_with_mqa.weight",
                     {m.kv_lora_rank + m.qk_rope_head_dim, H},
                     WeightRole::kAttention,
                     i});
      out.push_back({a + "kv_a_layernorm.weight", {m.kv_lora_rank}, WeightRole::kNorm, i});
      out.push_back({a + "kv_b_proj.weight",
                     {c.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank},
                     WeightRole::kAttention,
                     i});
      out.push_back(
          {a + "o_proj.weight", {H, c.num_heads * m.v_head_dim}, WeightRole::kAttention, i});
      if (c.layers[static_cast<size_t>(i)].attention == AttentionKind::kMlaDsa) {
        // The DSA lightning indexer: queries from the q LoRA, one shared key
        // (LayerNorm'd), per-head weights.
        const DsaConfig& d = c.dsa;
        const std::string x = a + "indexer.";
        out.push_back({x + "wq_b.weight",
                       {d.n_heads * d.head_dim, m.q_lora_rank.value_or(0)},
                       WeightRole::kAttention,
                       i});
        out.push_back({x + "wk.weight", {d.head_dim, H}, WeightRole::kAttention, i});
        out.push_back({x + "k_norm.weight", {d.head_dim}, WeightRole::kNorm, i});
        out.push_back({x + "k_norm.bias", {d.head_dim}, WeightRole::kNorm, i});
        out.push_back({x + "weights_proj.weight", {d.n_heads, H}, WeightRole::kAttention, i});
      }
    } else {
      const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
      out.push_back({a + "q_proj.weight", {q, H}, WeightRole::kAttention, i});
      out.push_back({a + "k_proj.weight", {kv, H}, WeightRole::kAttention, i});
      out.push_back({a + "v_proj.weight", {kv, H}, WeightRole::kAttention, i});
      if (c.attention_bias) {
        out.push_back({a + "q_proj.bias", {q}, WeightRole::kAttention, i});
        out.push_back({a + "k_proj.bias", {kv}, WeightRole::kAttention, i});
        out.push_back({a + "v_proj.bias", {kv}, WeightRole::kAttention, i});
      }
      out.push_back({a + "o_proj.weight", {H, q}, WeightRole::kAttention, i});
      if (c.qk_norm) {
        out.push_back({a + "q_norm.weight", {c.head_dim}, WeightRole::kNorm, i});
        out.push_back({a + "k_norm.weight", {c.head_dim}, WeightRole::kNorm, i});
      }
    }
    out.push_back({p + "post_attention_layernorm.weight", {H}, WeightRole::kNorm, i});
    if (!c.layers[static_cast<size_t>(i)].moe) {
      AddMlp(out, p + "mlp.", H, c.intermediate_size, WeightRole::kDenseMlp, i);
      continue;
    }
    const auto& moe = c.moe;
    const std::string block =
        c.arch == Architecture::kMixtral ? p + "block_sparse_moe." : p + "mlp.";
    out.push_back({block + "gate.weight", {moe.num_experts, H}, WeightRole::kRouter, i});
    if (moe.score_correction_bias)
      out.push_back(
          {block + "gate.e_score_correction_bias", {moe.num_experts}, WeightRole::kRouter, i});
    for (int e = 0; e < static_cast<int>(moe.num_experts); ++e) {
      const int64_t I = moe.intermediate_size;
      out.push_back({ExpertWeightName(c, i, e, ExpertProj::kGate),
                     {I, H},
                     WeightRole::kRoutedExpert,
                     i,
                     e,
                     ExpertProj::kGate});
      out.push_back({ExpertWeightName(c, i, e, ExpertProj::kUp),
                     {I, H},
                     WeightRole::kRoutedExpert,
                     i,
                     e,
                     ExpertProj::kUp});
      out.push_back({ExpertWeightName(c, i, e, ExpertProj::kDown),
                     {H, I},
                     WeightRole::kRoutedExpert,
                     i,
                     e,
                     ExpertProj::kDown});
    }
    if (moe.num_shared_experts > 0)
      AddMlp(out, block + "shared_experts.", H, moe.intermediate_size * moe.num_shared_experts,
             WeightRole::kSharedExpert, i);
  }
  out.push_back({"model.norm.weight", {H}, WeightRole::kNorm});
  if (!c.tie_word_embeddings)
    out.push_back({"lm_head.weight", {c.vocab_size, H}, WeightRole::kLmHead});
  return out;
}

ParamCounts CountParameters(const ModelConfig& c) {
  ParamCounts n;
  for (const WeightSpec& w : ExpectedWeights(c)) {
    if (IsRouterBuffer(w)) continue;
    const int64_t k = NumElements(w.shape);
    n.total += k;
    switch (w.role) {
      case WeightRole::kEmbedding:
      case WeightRole::kLmHead:
        n.embedding += k;
        break;
      case WeightRole::kNorm:
        n.norms += k;
        break;
      case WeightRole::kAttention:
        n.attention += k;
        break;
      case WeightRole::kDenseMlp:
        n.dense_mlp += k;
        break;
      case WeightRole::kRouter:
        n.router += k;
        break;
      case WeightRole::kSharedExpert:
        n.shared_experts += k;
        break;
      case WeightRole::kRoutedExpert:
        n.routed_experts += k;
        break;
    }
  }
  n.routed_per_expert = 3 * c.hidden_size * c.moe.intermediate_size;
  n.active = n.total - n.routed_experts;
  if (c.moe.num_experts > 0)
    n.active += n.routed_experts * c.moe.experts_per_token / c.moe.num_experts;
  return n;
}

namespace {

// Each hash layer's tid2eid (shape and dtype already checked): every id in
// [0, n_routed_experts).
absl::Status CheckHashTables(const ModelConfig& c, const Checkpoint& ckpt) {
  for (const WeightSpec& w : ExpectedWeights(c)) {
    if (!IsHashTable(w)) continue;
    const TensorEntry* e = ckpt.Find(w.name);
    if (e == nullptr) continue;
    ASSIGN_OR_RETURN(const Tensor t, ckpt.Get(w.name));
    const bool i64 = e->dtype == DType::kI64;
    const auto* bytes = static_cast<const uint8_t*>(t.raw());
    const int64_t n = NumElements(e->shape), k = std::max<int64_t>(1, c.moe.experts_per_token);
    for (int64_t i = 0; i < n; ++i) {
      int64_t id = 0;
      if (i64) {
        std::memcpy(&id, bytes + i * 8, 8);
      } else {
        int32_t v = 0;
        std::memcpy(&v, bytes + i * 4, 4);
        id = v;
      }
      if (id < 0 || id >= c.moe.num_experts)
        return absl::InvalidArgumentError(absl::StrCat(
            ckpt.dir(), ": ", w.name, " (tid2eid) gives token id ", i / k, " expert ", id,
            ", outside the ", c.moe.num_experts, " routed experts (n_routed_experts)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWeights(const ModelConfig& c, const Checkpoint& ckpt, bool routed_experts) {
  std::vector<std::string> missing, wrong;
  const bool fp8 = c.quantization.method == "fp8";
  const NativeLayout* mxfp8 = FindNativeLayout(c.quantization);  // e4m3 weights, e8m0 scales
  if (mxfp8 != nullptr && mxfp8->expert_format != "mxfp8") mxfp8 = nullptr;
  const int64_t br = fp8 ? c.quantization.weight_block[0] : 0,
                bc = fp8 ? c.quantization.weight_block[1] : 0;
  for (const WeightSpec& w : ExpectedWeights(c)) {
    if (!routed_experts && w.role == WeightRole::kRoutedExpert) continue;
    const TensorEntry* e = ckpt.Find(w.name);
    if (e == nullptr && w.role == WeightRole::kRoutedExpert) {
      // Stored natively: LoadExpertWeights checks each one's codes and scales.
      const std::vector<std::string> native = NativeExpertTensors(c, w.name);
      if (!native.empty() && ckpt.Has(native[0])) {
        if (!ckpt.Has(native[1])) missing.push_back(native[1]);  // its scales
        continue;
      }
    }
    if (e == nullptr) {
      missing.push_back(w.name);
      continue;
    }
    if (e->shape != w.shape) {
      wrong.push_back(absl::StrCat(w.name, " has shape ", ShapeString(e->shape), ", expected ",
                                   ShapeString(w.shape)));
      continue;
    }
    const bool is_float =
        e->dtype == DType::kF32 || e->dtype == DType::kBF16 || e->dtype == DType::kF16;
    if (IsHashTable(w)) {
      if (e->dtype != DType::kI64 && e->dtype != DType::kI32)
        wrong.push_back(absl::StrCat(w.name, " has dtype ", DTypeName(e->dtype),
                                     ", expected I64 or I32 expert ids"));
    } else if (e->dtype == DType::kF8E4M3 && mxfp8 != nullptr &&
               w.role == WeightRole::kRoutedExpert) {
      const std::string sname = NativeTensorName(w.name, mxfp8->scales);
      const TensorEntry* s = ckpt.Find(sname);
      const Shape want{w.shape[0], (w.shape[1] + 31) / 32};
      if (s == nullptr)
        missing.push_back(sname);
      else if (s->shape != want || (s->dtype != DType::kF8E8M0 && s->dtype != DType::kU8))
        wrong.push_back(absl::StrCat(sname, " is ", DTypeName(s->dtype), " ", ShapeString(s->shape),
                                     ", expected F8_E8M0 ", ShapeString(want)));
    } else if (e->dtype == DType::kF8E4M3 && fp8 && w.matrix()) {
      const std::string sname = ScaleInvName(w.name);
      const TensorEntry* s = ckpt.Find(sname);
      const Shape want{(w.shape[0] + br - 1) / br, (w.shape[1] + bc - 1) / bc};
      if (s == nullptr)
        missing.push_back(sname);
      else if (s->shape != want || s->dtype != DType::kF32)
        wrong.push_back(absl::StrCat(sname, " is ", DTypeName(s->dtype), " ", ShapeString(s->shape),
                                     ", expected F32 ", ShapeString(want)));
    } else if (!is_float) {
      wrong.push_back(absl::StrCat(w.name, " has dtype ", DTypeName(e->dtype),
                                   fp8 && w.matrix() ? ", expected F32, BF16, F16 or F8_E4M3"
                                                     : ", expected F32, BF16 or F16"));
    }
  }
  // Extra tensors are allowed (MTP layers, buffers), but shared experts the
  // config does not declare would be silently dropped: a config.json missing
  // n_shared_experts (the parser's default is 0) is refused here.
  std::string undeclared_shared;
  if (c.moe.num_shared_experts == 0) {
    for (const std::string& name : ckpt.Names()) {
      int64_t layer = -1;
      absl::string_view rest = name;
      if (!absl::ConsumePrefix(&rest, "model.layers.")) continue;
      const size_t dot = rest.find('.');
      if (dot == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dot), &layer))
        continue;
      if (layer < c.num_layers && absl::StartsWith(rest.substr(dot), ".mlp.shared_experts.")) {
        undeclared_shared = name;
        break;
      }
    }
  }
  if (missing.empty() && wrong.empty() && undeclared_shared.empty())
    return CheckHashTables(c, ckpt);
  if (missing.empty() && wrong.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": checkpoint has shared experts (", undeclared_shared, ") but its ",
        c.model_type, " config declares none: set n_shared_experts in config.json"));
  }
  constexpr size_t kMaxListed = 50;
  auto list = [&](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(),
                                  v.begin() + static_cast<long>(std::min(v.size(), kMaxListed)));
    std::string s = absl::StrJoin(head, "; ");
    if (v.size() > kMaxListed) absl::StrAppend(&s, "; ... and ", v.size() - kMaxListed, " more");
    return s;
  };
  std::string msg =
      absl::StrCat(ckpt.dir(), ": checkpoint does not match its ", c.model_type, " config:");
  if (!missing.empty())
    absl::StrAppend(&msg, " ", missing.size(), " missing tensor(s): ", list(missing), ".");
  if (!wrong.empty())
    absl::StrAppend(&msg, " ", wrong.size(), " mis-shaped or mistyped tensor(s): ", list(wrong),
                    ".");
  return wrong.empty() ? absl::NotFoundError(msg) : absl::InvalidArgumentError(msg);
}

}  // namespace hmoe
