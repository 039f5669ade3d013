// Routed experts' weights as they come in, before any quantization: one
// expert's matrices, and a MoE layer's source of them (a checkpoint,
// synthetic weights, a test's).
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "common/experts/format_codes.h"
#include "common/tensor.h"

namespace hmoe {

// One expert as stored in a checkpoint: gate, up [I][H], down [H][I].
// `format` kBf16: bf16, f16 or f32, or f8_e4m3 whose *_scale_inv are the f32
// block scales (DeepSeek-V3 style: w = fp8 * scale_inv[r / block][c /
// block], block MoeWeightsSource::fp8_block). A natively quantized format
// (format_codes.h) otherwise, each matrix's codes and scales as stored:
//   kFp8:      F8_E4M3 [rows][cols]; F32 [ceil(rows / group)][ceil(cols / group)]
//   kMxfp4:    U8 / I8 [rows][cols / 2] (or [rows][cols / 32][16]), two e2m1
//              codes per byte, the even col in the low nibble; U8 / F8_E8M0
//              [rows][cols / 32]
//   kInt4Bf16: I32 [rows][ceil(cols / 8)], eight nibbles q + 8 per int32, the
//              first in the low bits (compressed-tensors pack-quantized); BF16
//              [rows][ceil(cols / group)]
//   kMxfp8:    F8_E4M3 [rows][cols]; U8 / F8_E8M0 [rows][ceil(cols / 32)]
struct ExpertWeights {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;  // native formats: their group (fp8: the block edge)
  Tensor gate, up, down;
  Tensor gate_scale_inv, up_scale_inv, down_scale_inv;  // the scales
};

struct MoeWeightsSource {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t fp8_block = 128;
  // The format the experts are stored in (kBf16: plain or fp8 to dequantize)
  // and its group: QuantizeExpert keeps it without re-quantizing when asked
  // for it (`hmoe convert`'s default).
  WeightFormat native_format = WeightFormat::kBf16;
  int native_group = 0;
  // Expert e's weights; called once per expert quantized, from any thread.
  std::function<absl::StatusOr<ExpertWeights>(int64_t e)> expert;
};

}  // namespace hmoe
