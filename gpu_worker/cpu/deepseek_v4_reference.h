// DeepSeek-V4's forward pass written out once, plainly, in f32: the spec the
// per-kind implementations behind the driver's seams (attention kinds
// v4_sliding / v4_csa / v4_hca, router kinds hash / sqrtsoftplus_topk,
// residual kind mhc) are checked against. One full pass over a whole
// sequence (no cache), single-threaded, every weight read as f32; meant for
// the tiny fixtures, not for serving.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace hmoe::cpu {

// The logits [ids.size(), vocab] at every position of `ids` (positions 0..),
// as transformers' DeepseekV4ForCausalLM computes them without a cache.
// INVALID_ARGUMENT for a config that is not deepseek_v4 or a token id
// outside the vocabulary; the checkpoint's errors name the tensor.
absl::StatusOr<std::vector<float>> DeepseekV4Logits(const ModelConfig& config,
                                                    const Checkpoint& ckpt,
                                                    const std::vector<int32_t>& ids);

}  // namespace hmoe::cpu
