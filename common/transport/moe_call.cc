#include "common/transport/moe_call.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace hmoe {

const char* SplitModeName(SplitMode m) { return m == SplitMode::kTp ? "tp" : "ep"; }

MoeCall MoeCall::Make(int32_t layer, int32_t tokens, int32_t top_k, int64_t hidden_dim,
                      const uint16_t* hidden, const int32_t* ids, const float* weights) {
  MoeCall c;
  c.layer = layer;
  c.tokens = tokens;
  c.top_k = top_k;
  c.hidden = hidden;
  c.ids = ids;
  c.weights = weights;
  const uint64_t t = tokens > 0 ? static_cast<uint64_t>(tokens) : 0;
  const uint64_t k = top_k > 0 ? static_cast<uint64_t>(top_k) : 0;
  c.hidden_bytes = t * static_cast<uint64_t>(hidden_dim) * 2;
  c.ids_bytes = t * k * 4;
  c.weights_bytes = t * k * 4;
  return c;
}

std::string ServedDifference(const ShardInfo& was, const ShardInfo& now) {
  auto num = [](const char* what, int64_t n, int64_t w) {
    return absl::StrCat(what, " ", n, " (was ", w, ")");
  };
  if (now.shard_index != was.shard_index || now.num_shards != was.num_shards)
    return absl::StrCat("shard ", now.shard_index, "/", now.num_shards, " (was ", was.shard_index,
                        "/", was.num_shards, ")");
  if (now.model_type != was.model_type)
    return absl::StrCat("model type ", now.model_type, " (was ", was.model_type, ")");
  if (now.hidden != was.hidden) return num("hidden size", now.hidden, was.hidden);
  if (now.intermediate != was.intermediate)
    return num("expert intermediate size", now.intermediate, was.intermediate);
  if (now.num_experts != was.num_experts)
    return num("routed experts", now.num_experts, was.num_experts);
  if (now.top_k != was.top_k) return num("top-k", now.top_k, was.top_k);
  if (now.moe_layers != was.moe_layers)
    return absl::StrCat("MoE layers ", absl::StrJoin(now.moe_layers, ","), " (was ",
                        absl::StrJoin(was.moe_layers, ","), ")");
  if (now.split != was.split)
    return absl::StrCat("split ", SplitModeName(now.split), " (was ", SplitModeName(was.split),
                        ")");
  if (now.expert_begin != was.expert_begin || now.expert_end != was.expert_end ||
      now.i_begin != was.i_begin || now.i_end != was.i_end)
    return absl::StrCat("experts [", now.expert_begin, ", ", now.expert_end, "), intermediate [",
                        now.i_begin, ", ", now.i_end, ") (was [", was.expert_begin, ", ",
                        was.expert_end, "), [", was.i_begin, ", ", was.i_end, "))");
  if (now.weight_format != was.weight_format)
    return absl::StrCat("weight format ", now.weight_format, " (was ", was.weight_format, ")");
  if (now.max_tokens < was.max_tokens)
    return num("max tokens per call", now.max_tokens, was.max_tokens);
  // An empty fingerprint or conversion id is unknown (packed files from
  // before they were recorded), as ExpertPool::Connect takes it.
  if (!now.source_fingerprint.empty() && !was.source_fingerprint.empty() &&
      now.source_fingerprint != was.source_fingerprint)
    return absl::StrCat("routed experts of another checkpoint (fingerprint ",
                        now.source_fingerprint, ", was ", was.source_fingerprint, ")");
  if (!now.conversion_id.empty() && !was.conversion_id.empty() &&
      now.conversion_id != was.conversion_id)
    return absl::StrCat("packed files of another conversion (", now.conversion_id, ", was ",
                        was.conversion_id, ")");
  return "";
}

absl::Status CheckServesTheSame(const ShardInfo& was, const ShardInfo& now, const char* transport) {
  const std::string diff = ServedDifference(was, now);
  if (diff.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("expert service (", transport,
                   "): restarted serving something else than when the worker connected: ", diff));
}

absl::Status CheckMoeCallBytes(const MoeCall& call, uint64_t limit, const char* transport) {
  const unsigned __int128 total =
      static_cast<unsigned __int128>(call.hidden_bytes) + call.ids_bytes + call.weights_bytes;
  if (total > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert service (", transport, "): a call of ", call.hidden_bytes, " + ", call.ids_bytes,
        " + ", call.weights_bytes, " bytes, over the ", limit, " one call may carry"));
  }
  return absl::OkStatus();
}

absl::Status ValidateMoeCallShape(const ShardInfo& info, const MoeCall& call) {
  bool layer_ok = false;
  for (int32_t l : info.moe_layers) layer_ok |= (l == call.layer);
  if (!layer_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", call.layer, " is not a MoE layer of this model (", info.moe_layers.size(),
        " MoE layers, first ", info.moe_layers.empty() ? -1 : info.moe_layers.front(), ", last ",
        info.moe_layers.empty() ? -1 : info.moe_layers.back(), ")"));
  }
  if (call.tokens <= 0 || call.tokens > info.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", call.tokens, " outside [1, ",
                                                   info.max_tokens, "] (the shard's capacity)"));
  }
  if (call.top_k <= 0 || call.top_k > info.top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: ", call.top_k, " outside [1, ", info.top_k, "]"));
  }
  const uint64_t t = static_cast<uint64_t>(call.tokens), k = static_cast<uint64_t>(call.top_k);
  const uint64_t hb = t * static_cast<uint64_t>(info.hidden) * 2;
  if (call.hidden_bytes != hb) {
    return absl::InvalidArgumentError(absl::StrCat("hidden: ", call.hidden_bytes,
                                                   " bytes, expected ", hb, " (tokens ", t,
                                                   " x hidden ", info.hidden, " x bf16)"));
  }
  if (call.ids_bytes != t * k * 4) {
    return absl::InvalidArgumentError(absl::StrCat("expert_ids: ", call.ids_bytes,
                                                   " bytes, expected ", t * k * 4, " (tokens ", t,
                                                   " x top_k ", k, " x int32)"));
  }
  if (call.weights_bytes != t * k * 4) {
    return absl::InvalidArgumentError(absl::StrCat("expert_weights: ", call.weights_bytes,
                                                   " bytes, expected ", t * k * 4, " (tokens ", t,
                                                   " x top_k ", k, " x f32)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateMoeCall(const ShardInfo& info, const MoeCall& call) {
  RETURN_IF_ERROR(ValidateMoeCallShape(info, call));
  if (call.hidden == nullptr) return absl::InvalidArgumentError("hidden: no data");
  if (call.ids == nullptr) return absl::InvalidArgumentError("expert_ids: no data");
  if (call.weights == nullptr) return absl::InvalidArgumentError("expert_weights: no data");
  const uint64_t n = static_cast<uint64_t>(call.tokens) * static_cast<uint64_t>(call.top_k);
  for (uint64_t i = 0; i < n; ++i) {
    if ((call.ids[i] < 0 && call.ids[i] != kNoExpert) || call.ids[i] >= info.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert_ids[", i, "]: ", call.ids[i],
                                                     " out of range [0, ", info.num_experts,
                                                     ") and not ", kNoExpert, " (no expert)"));
    }
    if (!std::isfinite(call.weights[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert_weights[", i, "]: ", call.weights[i], " is not finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckServesModel(const ShardInfo& m, const ModelConfig& c, const std::string& who) {
  auto mismatch = [&](const char* what, int64_t ours, int64_t theirs) {
    return absl::FailedPreconditionError(absl::StrCat(who, " serves a different model: ", what, " ",
                                                      theirs, " there, ", ours, " in ",
                                                      c.model_type, " config"));
  };
  if (m.hidden != c.hidden_size) return mismatch("hidden size", c.hidden_size, m.hidden);
  if (m.num_experts != c.moe.num_experts)
    return mismatch("routed experts", c.moe.num_experts, m.num_experts);
  if (m.intermediate != c.moe.intermediate_size)
    return mismatch("expert intermediate size", c.moe.intermediate_size, m.intermediate);
  if (m.top_k < c.moe.experts_per_token) return mismatch("top-k", c.moe.experts_per_token, m.top_k);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.layers[static_cast<size_t>(l)].moe) continue;
    if (std::find(m.moe_layers.begin(), m.moe_layers.end(), l) == m.moe_layers.end())
      return absl::FailedPreconditionError(absl::StrCat(who, " does not serve MoE layer ", l));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
