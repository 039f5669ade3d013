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

// The format `cfg`'s quantization_config stores routed experts in, as read
// natively (format kBf16: none; fp8 blocks the fp8 row does not take are
// dequantized). UNIMPLEMENTED for non-square fp8 blocks.
struct NativeExpertFormat {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
};
absl::StatusOr<NativeExpertFormat> CheckpointExpertFormat(const ModelConfig& cfg,
                                                          const std::string& dir);

// A routed expert's weights as views into the checkpoint's mapping (no copy):
// bf16/f16/f32, or fp8 with its block scale_inv, or the checkpoint's native
// format (expert_weights.h: compressed-tensors' weight_packed / weight_scale /
// weight_shape, its mxfp4's weight_packed / weight_scale, mxfp4's
// weight_blocks / weight_scales, fp8's weight /
// weight_scale_inv, mxfp8's weight / weight_scale); a module the
// quantization left out is read plainly. Every dtype, shape and scale count
// checked, a scale without a value (e8m0 0xFF, a non-finite f32 / bf16)
// refused: INVALID_ARGUMENT naming the checkpoint, the tensor, its shape and
// the one expected (or the scale's index and value).
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
