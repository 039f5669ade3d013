// Weight map: the tensors a checkpoint of a given ModelConfig must hold, with
// their Hugging Face names and shapes, and a checker that reports every
// missing or mis-shaped tensor in one error.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/tensor.h"

namespace hmoe {

enum class WeightRole {
  kEmbedding,
  kNorm,
  kAttention,
  kDenseMlp,
  kRouter,
  kRoutedExpert,
  kSharedExpert,
  kLmHead,
};

enum class ExpertProj { kNone, kGate, kUp, kDown };

struct WeightSpec {
  std::string name;
  Shape shape;
  WeightRole role;
  int layer = -1;   // -1: not inside a decoder layer
  int expert = -1;  // routed expert index, for kRoutedExpert
  ExpertProj proj = ExpertProj::kNone;
  bool matrix() const { return shape.size() == 2; }  // fp8 checkpoints quantize these
};

// Every tensor of the main decoder stack, in a stable order: embedding, then
// each layer, then final norm and LM head (absent when embeddings are tied).
// DeepSeek-V3's MTP layers (num_nextn_predict_layers) are not part of it.
std::vector<WeightSpec> ExpectedWeights(const ModelConfig& config);

// Name of a routed expert's projection: e.g. "model.layers.3.mlp.experts.7.gate_proj.weight",
// or Mixtral's "model.layers.3.block_sparse_moe.experts.7.w1.weight".
std::string ExpertWeightName(const ModelConfig& config, int layer, int expert, ExpertProj proj);

// A fingerprint of a checkpoint's routed experts ("%016x"): FNV-1a 64 over,
// for every MoE layer and experts 0, E/2 and E-1, each projection's name,
// dtype, shape and first and last 4 KiB of stored bytes (and its fp8
// scale_inv's). Two checkpoints of one architecture (V3 and R1) differ in it;
// cheap (a few pages per layer). NOT_FOUND naming a tensor the checkpoint
// lacks. `hmoe convert` records it; services and the worker compare theirs.
absl::StatusOr<std::string> RoutedExpertsFingerprint(const Checkpoint& ckpt,
                                                     const ModelConfig& config);

// The tensors a routed expert's "<module>.weight" is stored as instead, when
// `config`'s quantization renames it (common/native_layout.h's row):
// compressed-tensors int4 "..weight_packed", "..weight_scale",
// "..weight_shape", its mxfp4 "..weight_packed", "..weight_scale"; mxfp4
// "..weight_blocks", "..weight_scales"; none otherwise (fp8 and mxfp8 keep
// the name). The first is the codes. Their shapes are checked where they are
// read (common/experts/checkpoint_source.h LoadExpertWeights).
std::vector<std::string> NativeExpertTensors(const ModelConfig& config,
                                             const std::string& weight_name);

// "<module>.weight" -> "<module>" + suffix (".weight_packed").
std::string NativeTensorName(const std::string& weight_name, std::string_view suffix);

// For an fp8 weight [rows, cols] stored with block size b: its "<name>_scale_inv"
// companion ("...weight" -> "...weight_scale_inv") of shape [ceil(rows/b), ceil(cols/b)].
std::string ScaleInvName(const std::string& weight_name);

// Parameter counts by role, as transformers counts them (model.parameters():
// e_score_correction_bias is a buffer there, so it is left out).
struct ParamCounts {
  int64_t total = 0;
  int64_t embedding = 0;  // embed_tokens + lm_head (once when tied)
  int64_t attention = 0;
  int64_t norms = 0;
  int64_t dense_mlp = 0;
  int64_t router = 0;
  int64_t shared_experts = 0;
  int64_t routed_experts = 0;
  int64_t routed_per_expert = 0;  // one expert of one layer
  int64_t active = 0;             // total - routed + routed * k / E
};
ParamCounts CountParameters(const ModelConfig& config);

// Checks `ckpt` against ExpectedWeights(config): each tensor present with the
// expected shape, a float dtype (f32/bf16/f16) or, for matrices of an fp8
// checkpoint, F8_E4M3 with a correctly shaped F32 scale_inv. Returns OK, or one
// error listing every problem (NOT_FOUND if all are missing tensors, else
// INVALID_ARGUMENT). Extra tensors (e.g. MTP layers) are allowed.
// `routed_experts` false: the routed experts' tensors are not required (a
// worker whose experts are served elsewhere).
absl::Status CheckWeights(const ModelConfig& config, const Checkpoint& ckpt,
                          bool routed_experts = true);

}  // namespace hmoe
