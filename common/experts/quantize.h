// Routed experts quantized to a weight format (format_codes.h), in plain
// row-major form: what the expert service packs for its kernels, what
// `hmoe convert` writes, what the worker's hot and streamed experts lay out
// for the GPU, and what the CPU reference computes with. Every side
// quantizes through QuantizeExpert, so all hold the same weights, bit for bit.
#pragma once

#include <cstdint>
#include <string_view>
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
// The formats read natively from checkpoints (mxfp4, int4bf16, fp8, mxfp8)
// keep their codes and scales as stored: `packed` holds rows x
// RowBytes(format, cols) bytes (4-bit codes two per byte, the even col in
// the low nibble; int4 two's complement; 8-bit: one e4m3fn byte), and the
// scales stay in their own type.
struct QuantMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;  // grouped formats only (fp8: the block edge)
  int64_t rows = 0, cols = 0;
  std::vector<uint16_t> bf16;   // kBf16
  std::vector<int8_t> q;        // kInt8, kInt4: one value per weight
  std::vector<uint8_t> packed;  // kMxfp4, kInt4Bf16, kFp8, kMxfp8
  // The scales, [ScaleRows][ScalesPerRow] (format_codes.h), in the vector of
  // the format's scale type: f32 (int8: [rows]; int4: [rows][ceil(cols /
  // group)]; fp8: [ceil(rows / group)][ceil(cols / group)]), bf16
  // (int4bf16), e8m0 (mxfp4, mxfp8; never 0xFF).
  std::vector<float> scale;
  std::vector<uint16_t> scale_bf16;
  std::vector<uint8_t> scale_e8m0;

  // The weight value, the scalar reference every kernel matches: bf16, or
  // f32(value * scale) with the value and scale decoded exactly.
  float At(int64_t r, int64_t c) const;
  // Row `r`'s cols weights into out[0, cols), each as At(r, c).
  void DequantizeRow(int64_t r, float* out) const;
  // The scale of weight (r, c) as f32 (1 without scales).
  float ScaleAt(int64_t r, int64_t c) const;
};
struct QuantExpert {
  QuantMatrix gate, up;  // [I_slice][H]
  QuantMatrix down;      // [H][I_slice]
};

// Quantizes a finite row-major [rows][cols] matrix to `f` (grouped: `group`,
// which `f` must take), as QuantizeExpert does each of its matrices.
QuantMatrix QuantizeMatrix(const float* w, int64_t rows, int64_t cols, WeightFormat f, int group);

// The matrix `name` [rows][cols] of native format `f` (mxfp4, int4bf16,
// fp8, mxfp8) from its codes `t` and scales `s` as a checkpoint stores them
// (expert_weights.h ExpertWeights), bit for bit (compressed-tensors'
// offset-binary nibbles become two's complement). INVALID_ARGUMENT naming
// `name`, the expected and the given dtype and shape, a non-finite f32 / bf16
// scale or an e8m0 scale of 0xFF (NaN).
absl::StatusOr<QuantMatrix> NativeMatrix(const Tensor& t, const Tensor& s, WeightFormat f,
                                         int group, int64_t rows, int64_t cols,
                                         std::string_view name);

// INVALID_ARGUMENT naming the bad value: a dim not > 0, an empty or
// out-of-range intermediate slice, a group the format does not take.
absl::Status CheckQuantOptions(const QuantOptions& opts, int64_t hidden, int64_t intermediate,
                               int64_t num_experts);
// Quantizes one expert's slice (common/dtype.h quantizers; fp8 dequantized
// with its block scales first). An expert stored in a native format (w.format)
// asked for in that format and group is kept as stored (NativeMatrix; a
// slice must not cut its scale blocks); in another format it is dequantized
// first. The native formats quantize by these rules (each element the
// nearest code of w / scale): mxfp4 / mxfp8 a power-of-two scale per 32,
// the smallest that clips nothing (compressed-tensors 0.20 picks another
// power of two for some blocks: the same grid, not always its codes);
// int4bf16 scale bf16(max|w| / 7.5), q in [-8, 7]; fp8 scale max|w| / 448
// per block. What a producer stored is kept, never re-derived by these
// rules (the producer fixtures' tests). INVALID_ARGUMENT for bad options
// (CheckQuantOptions), shapes or dtypes not of `src`, and non-finite
// weights (naming the matrix and element).
absl::StatusOr<QuantExpert> QuantizeExpert(const ExpertWeights& w, const MoeWeightsSource& src,
                                           const QuantOptions& opts);

}  // namespace hmoe
