// The backend-neutral Model: validates steps, forms each pass's tokens,
// positions and rope rows, runs the layer schedule over a LayerBackend
// (backend.h), calls the routed experts (RoutedExperts) per MoE layer with
// the shared experts running meanwhile, and implements Expert Deferral's
// split and join. Model::Create builds it with the backend ModelOptions name.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/driver/attention.h"
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

}  // namespace hmoe
