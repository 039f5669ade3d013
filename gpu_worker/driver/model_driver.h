// The backend-neutral Model: validates steps, forms each pass's tokens,
// positions and rope rows, runs the layer schedule over a LayerBackend
// (backend.h), calls the routed experts (RoutedExperts) per MoE layer with
// the shared experts running meanwhile, and implements Expert Deferral's
// split and join. Model::Create builds it with the backend ModelOptions name.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/driver/backend.h"
#include "gpu_worker/driver/rope.h"
#include "gpu_worker/model.h"

namespace hmoe {

// `backend` is owned; `experts` borrowed (must outlive the Model), or null
// when the config has no MoE layers; `owned_experts` (may be null) is kept
// alive with the model. Options must have been validated and resolved
// (num_threads, max_seq_len, backend).
absl::StatusOr<std::unique_ptr<Model>> CreateModelDriver(
    const ModelConfig& config, const ModelOptions& options, std::unique_ptr<LayerBackend> backend,
    RoutedExperts* experts, std::unique_ptr<RoutedExperts> owned_experts);

// The rotary dimension, pair layout and softmax scale of `config`'s attention
// (MLA: qk_rope_head_dim, interleaved for V2 and rope_interleave, YaRN
// mscale^2 folded into the scale; GQA: head_dim, halves).
struct AttentionGeometry {
  int64_t rope_dim = 0;
  RopeLayout rope_layout = RopeLayout::kHalves;
  float softmax_scale = 1.0f;
};
AttentionGeometry AttentionGeometryFor(const ModelConfig& config);

// transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with the
// RMSNorm default eps, not config.rms_norm_eps.
inline constexpr float kMlaNormEps = 1e-6f;

}  // namespace hmoe
