#include "common/transport/moe_call.h"

#include <cmath>

#include "absl/strings/str_cat.h"
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
    if (call.ids[i] < 0 || call.ids[i] >= info.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("expert_ids[", i, "]: ", call.ids[i],
                                                     " out of range [0, ", info.num_experts, ")"));
    }
    if (!std::isfinite(call.weights[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert_weights[", i, "]: ", call.weights[i], " is not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace hmoe
