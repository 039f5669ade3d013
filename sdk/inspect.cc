#include "sdk/inspect.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/weight_format.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hmoe {

const char* ExpertFormatName(ExpertFormat f) {
  switch (f) {
    case ExpertFormat::kBf16:
      return "bf16";
    case ExpertFormat::kInt8:
      return "int8";
    case ExpertFormat::kInt4G64:
      return "int4g64";
    case ExpertFormat::kMxfp4:
      return "mxfp4";
    case ExpertFormat::kInt4Bf16G32:
      return "int4bf16g32";
    case ExpertFormat::kFp8:
      return "fp8";
    case ExpertFormat::kMxfp8:
      return "mxfp8";
  }
  return "?";
}

double ExpertBytesPerWeight(ExpertFormat f, int64_t k) {
  switch (f) {
    case ExpertFormat::kBf16:
      return 2.0;
    case ExpertFormat::kInt8:
      return 1.0 + 4.0 / static_cast<double>(k);
    case ExpertFormat::kInt4G64:
      return 0.5 + 4.0 / 64.0;
    case ExpertFormat::kMxfp4:
      return 0.5 + 1.0 / 32.0;
    case ExpertFormat::kInt4Bf16G32:
      return 0.5 + 2.0 / 32.0;
    case ExpertFormat::kFp8:
      return 1.0 + 4.0 / (128.0 * 128.0);
    case ExpertFormat::kMxfp8:
      return 1.0 + 1.0 / 32.0;
  }
  return 0;
}

absl::StatusOr<ModelReport> InspectModel(const std::string& model_dir,
                                         const InspectOptions& options) {
  if (!(options.dram_gbps > 0))
    return absl::InvalidArgumentError(
        absl::StrCat("--dram-gbps must be positive, got ", options.dram_gbps));
  ModelReport r;
  ASSIGN_OR_RETURN(r.config, LoadModelConfig(model_dir));
  const ModelConfig& c = r.config;
  r.params = CountParameters(c);
  r.moe_layers = c.num_moe_layers();
  const double H = static_cast<double>(c.hidden_size),
               I = static_cast<double>(c.moe.intermediate_size);
  for (int f = 0; f < kNumExpertFormats; ++f) {
    const auto fmt = static_cast<ExpertFormat>(f);
    // gate and up reduce over H, down over I.
    const double per_expert = 2 * H * I * ExpertBytesPerWeight(fmt, c.hidden_size) +
                              H * I * ExpertBytesPerWeight(fmt, c.moe.intermediate_size);
    r.routed_bytes[f] =
        per_expert * static_cast<double>(c.moe.num_experts) * static_cast<double>(r.moe_layers);
    r.bytes_per_token[f] = per_expert * static_cast<double>(c.moe.experts_per_token) *
                           static_cast<double>(r.moe_layers);
    r.decode_ceiling_tps[f] =
        r.bytes_per_token[f] > 0 ? options.dram_gbps * 1e9 / r.bytes_per_token[f] : 0;
  }
  const absl::StatusOr<NativeExpertFormat> native_or = CheckpointExpertFormat(c, model_dir);
  const NativeExpertFormat native = native_or.ok() ? *native_or : NativeExpertFormat{};
  if (!native_or.ok()) {
    r.expert_format = absl::StrCat("unreadable: ", native_or.status().message());
  } else if (native.format != WeightFormat::kBf16) {
    r.expert_format = WeightFormatName(native.format, native.group);
    for (int f = 0; f < kNumExpertFormats; ++f)
      if (r.expert_format == ExpertFormatName(static_cast<ExpertFormat>(f)))
        r.expert_format_row = f;
  } else if (c.quantization.method == "fp8") {
    r.expert_format = "fp8 (dequantized: blocks the service does not read)";
  }
  if (options.plan.gpu_mem_gb > 0) {
    ASSIGN_OR_RETURN(r.plan, PlanGpuMemory(c, options.plan));
  }
  if (!options.check_weights) return r;
  std::error_code ec;
  bool any = false;
  for (const auto& e : std::filesystem::directory_iterator(model_dir, ec))
    any |= e.path().extension() == ".safetensors";
  if (!any) return r;
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(model_dir));
  r.has_checkpoint = true;
  r.checkpoint_files = static_cast<int64_t>(ckpt->files().size());
  for (const auto& f : ckpt->files()) {
    r.checkpoint_tensors += static_cast<int64_t>(f->entries().size());
    for (const auto& e : f->entries()) r.checkpoint_bytes += static_cast<double>(e.end - e.begin);
  }
  absl::Status s = CheckWeights(c, *ckpt);
  r.weight_check = s.ok() ? "ok" : std::string(s.message());
  return r;
}

namespace {

std::string Count(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}
std::string Billions(int64_t n) {
  const double x = static_cast<double>(n);
  if (x >= 1e9) return absl::StrFormat("%.2f B", x / 1e9);
  if (x >= 1e6) return absl::StrFormat("%.2f M", x / 1e6);
  return absl::StrFormat("%.1f K", x / 1e3);
}
std::string GB(double b) {
  if (b >= 1e9) return absl::StrFormat("%.1f GB", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.1f MB", b / 1e6);
  return absl::StrFormat("%.1f KB", b / 1e3);
}

nlohmann::json PlanJson(const MemoryPlan& p) {
  nlohmann::json j;
  j["fits"] = p.fits;
  j["message"] = p.message;
  j["limit_bytes"] = p.limit_bytes;
  j["weights"] = std::string(DenseWeightsName(p.weights));
  j["kv_dtype"] = std::string(KvDtypeName(p.kv_dtype));
  j["host_embedding"] = p.host_embedding;
  j["context"] = p.context;
  j["batch"] = p.batch;
  j["kv_blocks"] = p.kv_blocks;
  j["kv_bytes_per_token"] = p.kv_bytes_per_token;
  j["parts"] = nlohmann::json::array();
  for (const PlanPart& part : p.parts)
    j["parts"].push_back({{"name", part.name},
                          {"params", part.params},
                          {"format", part.format},
                          {"bytes", part.bytes},
                          {"on_gpu", part.on_gpu}});
  j["weight_bytes"] = p.weight_bytes;
  j["kv_bytes"] = p.kv_bytes;
  j["workspace_bytes"] = p.workspace_bytes;
  j["hot_bytes"] = p.hot_bytes;
  j["total_bytes"] = p.total_bytes;
  j["left_bytes"] = p.left_bytes;
  j["max_context"] = p.max_context;
  j["hot_expert_bytes"] = p.hot_expert_bytes;
  j["hot_experts_fit"] = p.hot_experts_fit;
  j["changes"] = p.changes;
  return j;
}

}  // namespace

std::string FormatReport(const ModelReport& r, const InspectOptions& o) {
  const ModelConfig& c = r.config;
  const ParamCounts& p = r.params;
  if (o.json) {
    nlohmann::json j;
    j["model_type"] = c.model_type;
    j["layers"] = {
        {"total", c.num_layers}, {"moe", r.moe_layers}, {"dense", c.num_layers - r.moe_layers}};
    j["params"] = {{"total", p.total},
                   {"active", p.active},
                   {"routed_experts", p.routed_experts},
                   {"embedding", p.embedding},
                   {"attention", p.attention},
                   {"dense_mlp", p.dense_mlp},
                   {"router", p.router},
                   {"shared_experts", p.shared_experts},
                   {"norms", p.norms}};
    j["dram_gbps"] = o.dram_gbps;
    if (!r.expert_format.empty()) j["expert_format"] = r.expert_format;
    for (int f = 0; f < kNumExpertFormats; ++f) {
      j["formats"][ExpertFormatName(static_cast<ExpertFormat>(f))] = {
          {"routed_bytes", r.routed_bytes[f]},
          {"bytes_per_token", r.bytes_per_token[f]},
          {"decode_ceiling_tok_s", r.decode_ceiling_tps[f]}};
    }
    if (r.plan) j["gpu_plan"] = PlanJson(*r.plan);
    if (r.has_checkpoint)
      j["checkpoint"] = {{"files", r.checkpoint_files},
                         {"tensors", r.checkpoint_tensors},
                         {"bytes", r.checkpoint_bytes},
                         {"weight_check", r.weight_check}};
    return j.dump(2) + "\n";
  }
  std::string s;
  absl::StrAppend(&s, "architecture   ", c.model_type, "  (vocab ", c.vocab_size, ", hidden ",
                  c.hidden_size, ", max positions ", c.max_position_embeddings,
                  c.tie_word_embeddings ? ", tied embeddings" : "", ")\n");
  absl::StrAppend(&s, "layers         ", c.num_layers, ": ", c.num_layers - r.moe_layers,
                  " dense MLP + ", r.moe_layers, " MoE");
  if (c.num_nextn_predict_layers > 0)
    absl::StrAppend(&s, " (+", c.num_nextn_predict_layers, " MTP, not counted",
                    c.arch == Architecture::kDeepseekV4 ? "; its tensors load and are not run" : "",
                    ")");
  absl::StrAppend(&s, "\n");
  if (c.arch == Architecture::kDeepseekV4) {
    const V4Config& v = c.v4;
    int64_t kinds[3] = {0, 0, 0}, hash = 0;
    for (const auto& l : c.layers) {
      kinds[l.attention == AttentionKind::kV4Csa   ? 1
            : l.attention == AttentionKind::kV4Hca ? 2
                                                   : 0]++;
      hash += l.router == RouterKind::kHash;
    }
    absl::StrAppend(&s, "attention      ", c.num_heads, " heads x ", c.head_dim,
                    " over one shared K=V head (rope on the last ", v.qk_rope_head_dim,
                    " dims), q_lora ", v.q_lora_rank, ", output ", v.o_groups, " groups x ",
                    v.o_lora_rank, ", sink per head; sliding window ", v.sliding_window,
                    " on every layer\n");
    absl::StrAppend(&s, "               ", kinds[0], " sliding only, ", kinds[1], " csa (",
                    v.csa_compress_rate, ":1 compressed, indexer ", c.dsa.n_heads, " heads x ",
                    c.dsa.head_dim, ", top ", c.dsa.topk, "), ", kinds[2], " hca (",
                    v.hca_compress_rate, ":1 compressed)\n");
    absl::StrAppend(&s, "residual       mHC, ", v.hc_mult, " streams, Sinkhorn ",
                    v.hc_sinkhorn_iters, " iterations (eps ", v.hc_eps, ")\n");
    absl::StrAppend(&s, "routing        ", hash, " hash layers (tid2eid), ", c.num_layers - hash,
                    " top-k; experts' gate/up clamped at ", v.swiglu_limit, "\n");
    const RopeConfig& cr = v.compress_rope;
    absl::StrAppend(&s, "compress rope  ", RopeTypeName(cr.type), ", theta ", cr.theta);
    if (cr.type != RopeType::kDefault) absl::StrAppend(&s, ", factor ", cr.factor);
    if (cr.type == RopeType::kYarn)
      absl::StrAppend(&s, ", original ", cr.original_max_position_embeddings);
    absl::StrAppend(&s, "\n");
  } else if (c.is_mla()) {
    absl::StrAppend(&s, "attention      MLA, ", c.num_heads, " heads, q_lora ",
                    c.mla.q_lora_rank ? std::to_string(*c.mla.q_lora_rank) : std::string("none"),
                    ", kv_lora ", c.mla.kv_lora_rank, ", qk ", c.mla.qk_nope_head_dim, "+",
                    c.mla.qk_rope_head_dim, " (rope), v ", c.mla.v_head_dim,
                    c.dsa.topk > 0 ? absl::StrCat("; DSA indexer ", c.dsa.n_heads, " heads x ",
                                                  c.dsa.head_dim, ", top ", c.dsa.topk, " keys")
                                   : std::string(),
                    "\n");
  } else {
    int64_t sliding = 0;
    for (const auto& l : c.layers) sliding += l.sliding_window > 0;
    absl::StrAppend(&s, "attention      GQA, ", c.num_heads, " heads / ", c.num_kv_heads,
                    " kv heads, head_dim ", c.head_dim, c.qk_norm ? ", q/k norm" : "");
    if (c.rope.partial_rotary_factor < 1)
      absl::StrAppend(
          &s, ", rope on ",
          static_cast<int64_t>(static_cast<double>(c.head_dim) * c.rope.partial_rotary_factor),
          " dims");
    if (sliding > 0)
      absl::StrAppend(&s, ", sliding window ", c.layers.back().sliding_window, " on ", sliding,
                      " layers");
    absl::StrAppend(&s, "\n");
  }
  absl::StrAppend(&s, "rope           ", RopeTypeName(c.rope.type), ", theta ", c.rope.theta);
  if (c.rope.type != RopeType::kDefault) absl::StrAppend(&s, ", factor ", c.rope.factor);
  if (c.rope.type == RopeType::kYarn)
    absl::StrAppend(&s, ", original ", c.rope.original_max_position_embeddings, ", beta ",
                    c.rope.beta_fast, "/", c.rope.beta_slow, ", mscale ", c.rope.mscale, "/",
                    c.rope.mscale_all_dim);
  absl::StrAppend(&s, "\n");
  const auto& m = c.moe;
  absl::StrAppend(&s, "experts        ", m.num_experts, " routed (I ", m.intermediate_size,
                  "), top-", m.experts_per_token, ", ", m.num_shared_experts, " shared; ",
                  ScoringFuncName(m.scoring), " scoring, ", TopkMethodName(m.topk_method));
  if (m.n_group > 1) absl::StrAppend(&s, " (", m.n_group, " groups, top ", m.topk_group, ")");
  if (m.score_correction_bias) absl::StrAppend(&s, ", correction bias");
  absl::StrAppend(&s, m.norm_topk_prob ? ", renormalized" : "", ", scaling ",
                  m.routed_scaling_factor, "\n");
  if (!c.quantization.method.empty()) {
    absl::StrAppend(&s, "checkpoint     ", c.quantization.method, " weights");
    if (c.quantization.weight_block.size() == 2)
      absl::StrAppend(&s, ", blocks ", c.quantization.weight_block[0], "x",
                      c.quantization.weight_block[1]);
    if (!r.expert_format.empty())
      absl::StrAppend(
          &s, "; routed experts ", r.expert_format,
          r.expert_format_row >= 0
              ? absl::StrFormat(" (%.3f bytes/weight, %s per token)",
                                ExpertBytesPerWeight(static_cast<ExpertFormat>(r.expert_format_row),
                                                     c.hidden_size),
                                GB(r.bytes_per_token[r.expert_format_row]))
              : std::string());
    absl::StrAppend(&s, "\n");
  }
  absl::StrAppend(&s, "\nparameters     total          ", Count(p.total), "  (", Billions(p.total),
                  ")\n");
  absl::StrAppend(&s, "               active/token   ", Count(p.active), "  (", Billions(p.active),
                  ")\n");
  absl::StrAppend(
      &s, "               routed experts ", Count(p.routed_experts), "  (",
      Billions(p.routed_experts),
      absl::StrFormat(", %.1f%%", p.total ? 100.0 * static_cast<double>(p.routed_experts) /
                                                static_cast<double>(p.total)
                                          : 0.0),
      "; ", Count(p.routed_per_expert), " per expert)\n");
  absl::StrAppend(&s, "               attention ", Billions(p.attention), ", dense MLP ",
                  Billions(p.dense_mlp), ", shared experts ", Billions(p.shared_experts),
                  ", router ", Billions(p.router), ", embeddings ", Billions(p.embedding), "\n");
  absl::StrAppend(&s, "\nrouted experts by format  (decode ceiling = ", o.dram_gbps,
                  " GB/s / routed bytes read per token)\n");
  absl::StrAppend(&s, "  format      all experts    per token    ceiling\n");
  for (int f = 0; f < kNumExpertFormats; ++f)
    absl::StrAppend(
        &s, absl::StrFormat("  %-11s %11s %12s %9.2f tok/s%s\n",
                            ExpertFormatName(static_cast<ExpertFormat>(f)), GB(r.routed_bytes[f]),
                            GB(r.bytes_per_token[f]), r.decode_ceiling_tps[f],
                            f == r.expert_format_row ? "  (the checkpoint's)" : ""));
  absl::StrAppend(&s,
                  "  (int8: f32 scale per output row; int4g64: f32 scale per 64 weights; mxfp4 / "
                  "mxfp8: e8m0 per 32; int4bf16g32: bf16 per 32; fp8: f32 per 128x128)\n");
  if (r.has_checkpoint) {
    absl::StrAppend(&s, "\ncheckpoint     ", r.checkpoint_files, " file(s), ", r.checkpoint_tensors,
                    " tensors, ", GB(r.checkpoint_bytes), "\nweight map     ", r.weight_check,
                    "\n");
  } else {
    absl::StrAppend(&s, "\ncheckpoint     none (config.json only)\n");
  }
  if (r.plan) absl::StrAppend(&s, "\n", FormatPlan(*r.plan));
  return s;
}

}  // namespace hmoe
