// Routed experts' weights as they come in, before any quantization: one
// expert's matrices, and a MoE layer's source of them (a checkpoint,
// synthetic weights, a test's).
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace hmoe {

// One expert as stored in a checkpoint: gate, up [I][H], down [H][I]; bf16, f32
// or f8_e4m3 (then *_scale_inv are the f32 block scales, DeepSeek-V3 style:
// w = fp8 * scale_inv[r / block][c / block]).
struct ExpertWeights {
  Tensor gate, up, down;
  Tensor gate_scale_inv, up_scale_inv, down_scale_inv;
};

struct MoeWeightsSource {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t fp8_block = 128;
  // Expert e's weights; called once per expert quantized, from any thread.
  std::function<absl::StatusOr<ExpertWeights>(int64_t e)> expert;
};

}  // namespace hmoe
