// Routed experts quantized to a weight format (format_codes.h), in plain
// row-major form: what the expert service packs for its kernels, what
// `hmoe convert` writes, what the worker's hot and streamed experts lay out
// for the GPU, and what the CPU reference computes with. Every side
// quantizes through QuantizeExpert, so all hold the same weights, bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/experts/expert_weights.h"
#include "common/experts/format_codes.h"

namespace hmoe {

// How an expert is quantized: the format, its group, and the slice
// [i_begin, i_end) of the intermediate dim kept (a tensor-parallel shard's).
struct QuantOptions {
  WeightFormat format = WeightFormat::kBf16;
  int group = 128;      // grouped formats (int4): 32, 64 or 128 along K
  int64_t i_begin = 0;  // intermediate slice owned by this shard
  int64_t i_end = -1;   // -1: to the end
};

// A shard's part of a MoE layer: its experts' quantization and which experts
// it owns (the expert service's Pack lays them out; `hmoe convert` writes them).
struct PackOptions : QuantOptions {
  int64_t expert_begin = 0;  // experts owned by this shard
  int64_t expert_end = -1;   // -1: to the end
};

// A quantized matrix in plain row-major form (logical shape, no padding).
struct QuantMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;  // grouped formats only
  int64_t rows = 0, cols = 0;
  std::vector<uint16_t> bf16;  // kBf16
  std::vector<int8_t> q;       // scaled formats, one value per weight
  // [rows][ScalesPerRow(format, group, cols)] (int8: [rows]; int4: [rows][ceil(cols / group)])
  std::vector<float> scale;
  float At(int64_t r, int64_t c) const;  // the weight value: bf16, or f32(q * s)
};
struct QuantExpert {
  QuantMatrix gate, up;  // [I_slice][H]
  QuantMatrix down;      // [H][I_slice]
};

// INVALID_ARGUMENT naming the bad value: a dim not > 0, an empty or
// out-of-range intermediate slice, a group the format does not take.
absl::Status CheckQuantOptions(const QuantOptions& opts, int64_t hidden, int64_t intermediate,
                               int64_t num_experts);
// Quantizes one expert's slice (common/dtype.h quantizers; fp8 dequantized
// with its block scales first). INVALID_ARGUMENT for bad options
// (CheckQuantOptions), shapes or dtypes not of `src`, and non-finite
// weights (naming the matrix and element).
absl::StatusOr<QuantExpert> QuantizeExpert(const ExpertWeights& w, const MoeWeightsSource& src,
                                           const QuantOptions& opts);

}  // namespace hmoe
