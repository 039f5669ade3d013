// The reference backend's attention ops, one per AttentionKind
// (gpu_worker/driver/attention.h) in the table of attention.cc: each owns
// its layer's weights and writes and reads the cache rows its kind's
// AttentionSpec lays out.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/kv_quant.h"
#include "common/model_config.h"
#include "common/runtime/thread_pool.h"
#include "common/safetensors.h"
#include "gpu_worker/cpu/dense_weights.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/driver/attention.h"
#include "gpu_worker/driver/weight_names.h"

namespace hmoe::cpu {

// A linear layer: its weight and, when the checkpoint has one, its bias.
struct Lin {
  Matrix w;
  std::vector<float> b;  // empty: no bias
  const float* bias() const { return b.empty() ? nullptr : b.data(); }
};
// Loads PREFIX.weight as `load` stores it (dense_weights.h
// LoadDenseAsMatrix) and PREFIX.bias.
absl::Status LoadLin(const Checkpoint& ckpt, const std::string& prefix, const WeightLoad& load,
                     Lin* out);

// What a layer's attention reads of the pass.
struct AttentionPass {
  ThreadPool* pool = nullptr;
  int64_t T = 0;
  const int64_t* pos = nullptr;  // [T] each token's position
  int64_t max_pos = 0;
  const float* rope_cs = nullptr;  // [T, rope_dim] RopeCosSin rows
  // [T] each token's Sequence's key / value cache of this layer: rows of
  // the spec's cache.k_row / cache.v_row floats by position (v: null
  // entries when v_row is 0).
  float* const* k = nullptr;
  float* const* v = nullptr;
  // The cache's element type: rows are rounded at write (KvRoundPart,
  // common/kv_quant.h; parts as the CUDA backend's) and kept as f32, which
  // holds every rounded value exactly, so attention reads what a bf16 / fp8
  // cache stores.
  KvElem kv = KvElem::kF32;
};

class AttentionOp {
 public:
  virtual ~AttentionOp() = default;
  // Loads the layer's attention weights (input norm aside).
  // Its projections as `load` stores them; MLA's kv_b_proj and the DSA
  // indexer's weights as read (PlainLoad).
  virtual absl::Status Load(const Checkpoint& ckpt, const LayerNames& names,
                            const WeightLoad& load) = 0;
  // Writes each token's cache row at its position, then out [T, H] =
  // o_proj(attention(h [T, H])) over positions [0, pos] of its cache.
  virtual void Forward(const AttentionPass& p, const float* h, float* out) const = 0;
};

// The op of `spec.kind` for a layer of `config`; UNIMPLEMENTED naming the
// kind when the reference backend has none.
absl::StatusOr<std::unique_ptr<AttentionOp>> MakeAttentionOp(const ModelConfig& config,
                                                             const AttentionSpec& spec);

// The kinds' ops (one file each: mla_attention.cc, gqa_attention.cc; MLA-DSA
// is mla_attention.cc's op with a DsaIndexer, dsa_indexer.h).
std::unique_ptr<AttentionOp> MakeMlaAttention(const ModelConfig& config, const AttentionSpec& spec);
std::unique_ptr<AttentionOp> MakeMlaDsaAttention(const ModelConfig& config,
                                                 const AttentionSpec& spec);
std::unique_ptr<AttentionOp> MakeGqaAttention(const ModelConfig& config, const AttentionSpec& spec);

}  // namespace hmoe::cpu
