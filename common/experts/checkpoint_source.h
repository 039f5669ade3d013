// Routed-expert weights read from a checkpoint, for whatever packs or
// quantizes them (the expert service's Pack, the worker's hot experts).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/experts/expert_weights.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace hmoe {

// A routed expert's weights as views into the checkpoint's mapping (no copy):
// bf16/f16/f32, or fp8 with its block scale_inv; shapes and dtypes checked,
// errors name the checkpoint and the tensor.
absl::StatusOr<ExpertWeights> LoadExpertWeights(const Checkpoint& ckpt, const ModelConfig& cfg,
                                                int layer, int64_t expert);
// The fp8 block size of `cfg`'s experts: 0 without an fp8
// quantization_config (an fp8 expert is then refused by LoadExpertWeights),
// UNIMPLEMENTED for non-square blocks (as the worker refuses them).
absl::StatusOr<int64_t> Fp8ExpertBlock(const ModelConfig& cfg, const std::string& dir);
// The weight source for one MoE layer of a checkpoint (streams
// LoadExpertWeights; `ckpt` and `cfg` must outlive it).
MoeWeightsSource CheckpointSource(const Checkpoint& ckpt, const ModelConfig& cfg, int layer);
}  // namespace hmoe
