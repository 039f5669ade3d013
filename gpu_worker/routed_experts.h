// RoutedExperts: the one interface through which a model reaches its routed
// (MoE) experts. The CPU reference model calls it once per MoE layer per
// forward pass; the in-process reference below, the CPU kernels and the remote
// expert service all plug in behind it.
//
// Contract of one call, for MoE layer `layer` and T tokens:
//
//   out[t] = sum_j weights[t, j] * E_{layer, ids[t, j]}(hidden[t]),
//
// over the j whose id is not kNoExpert (an empty slot: weight ignored),
//   E(x)   = down(silu(gate(x)) * up(x)),
//
// with `out` ([T, hidden_size], f32) OVERWRITTEN, not accumulated into. The
// routing weights arrive final (normalized and scaled by the router); shared
// experts are not part of this interface. `hidden` is f32; an implementation
// may round it (e.g. to bf16) internally, and that rounding is part of its
// accuracy contract against the reference. The summation over j is in
// ascending expert-id order in the reference (so a token's result does not
// depend on which other tokens share the batch).
//
// Errors: INVALID_ARGUMENT for a layer that has no routed experts, an expert
// id out of range or a bad shape; UNAVAILABLE when a remote service cannot be
// reached (the caller may retry). On error `out` is unspecified.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/transport/expert_slots.h"

namespace hmoe {

// One MoE layer's routed work. All pointers are borrowed for the call (for
// Submit: until the matching Wait returns).
struct ExpertBatch {
  int layer = 0;                        // decoder layer index (an MoE layer)
  int64_t num_tokens = 0;               // T >= 0
  int64_t hidden_size = 0;              // H, must equal the model's
  const float* hidden = nullptr;        // [T, H] post-attention-norm hidden states
  int top_k = 0;                        // k >= 1
  const int32_t* expert_ids = nullptr;  // [T, k], each in [0, num_experts) or kNoExpert
  const float* weights = nullptr;       // [T, k] routing weights
};

class RoutedExperts {
 public:
  virtual ~RoutedExperts() = default;

  // Synchronous: computes `batch` into `out` ([T, H], overwritten).
  virtual absl::Status Forward(const ExpertBatch& batch, float* out) = 0;

  // Asynchronous pair: Submit starts the work and returns a ticket at once;
  // Wait(ticket) blocks until `out` is complete and returns the batch's
  // status. Every ticket must be waited on exactly once; buffers stay valid
  // until then. Wait on an unknown ticket -> INVALID_ARGUMENT. The default
  // runs Forward inside Submit (for implementations with no real overlap).
  virtual absl::StatusOr<uint64_t> Submit(const ExpertBatch& batch, float* out);
  virtual absl::Status Wait(uint64_t ticket);

  // Fixed expert-call slots (gpu_worker/transport/expert_slots.h) reaching these
  // experts, for passes a backend runs from the GPU (one CUDA Graph per
  // step). The default: in-process slots in host memory whose calls are
  // this object's Submit / Wait (the bf16 hidden rows widened to f32).
  // The experts must outlive the slots.
  virtual absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeSlots(const ExpertSlotsOptions& opts);

 private:
  std::mutex mu_;
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, absl::Status> finished_;
};

// Validates `batch` against `config` (layer is MoE, hidden size, k, ids in
// range, non-null pointers); INVALID_ARGUMENT naming the problem. For
// implementations to call first.
absl::Status ValidateExpertBatch(const ModelConfig& config, const ExpertBatch& batch);

// The in-process reference: fp32 math over the checkpoint's weights (bf16 read
// in place from the mapping; f16 converted; fp8 dequantized once at load with
// its block scale_inv). `num_threads` <= 0: hardware concurrency.
// The checkpoint's tensors are expected to have passed CheckWeights.
absl::StatusOr<std::unique_ptr<RoutedExperts>> MakeReferenceRoutedExperts(const ModelConfig& config,
                                                                          const Checkpoint& ckpt,
                                                                          int num_threads = 0);

}  // namespace hmoe
