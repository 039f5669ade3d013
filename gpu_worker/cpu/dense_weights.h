// Dense weights (attention projections, dense MLPs, shared experts, the LM
// head) in the stored form ModelOptions::weights asks for: one loader both
// backends use, so the CPU reference computes with exactly the codes and
// scales the CUDA backend keeps on the device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/experts/format_codes.h"
#include "common/experts/quantize.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/model.h"

namespace hmoe::cpu {

// How a backend loads its dense weights.
struct WeightLoad {
  // The checkpoint's fp8 block edge (quantization "fp8"); 0: not an fp8 checkpoint.
  int64_t fp8_block = 0;
  // The stored form: kBf16, or kFp8 (group 128), kInt8, kInt4 (group 128)
  // as DenseFormatOf gives them.
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
  // With kBf16 (ModelOptions::weights auto): an F8_E4M3 tensor of 128 x 128
  // blocks keeps its codes and scales as kFp8; other tensors are bf16.
  bool keep_fp8 = false;
  bool quantized() const { return format != WeightFormat::kBf16 || keep_fp8; }
};
// The WeightLoad of `weights` for a checkpoint of `config` (auto: the
// checkpoint's own precision, tensor by tensor).
WeightLoad WeightLoadFor(const ModelConfig& config, DenseWeights weights);
// `load` without its quantization: as LoadMatrix reads (fp8 dequantized).
inline WeightLoad PlainLoad(const WeightLoad& load) { return WeightLoad{load.fp8_block}; }

// The weight `name` ([rows, cols]) in the form `load` gives it:
//   - an F8_E4M3 tensor asked for as fp8 (kFp8, or keep_fp8) with 128 x 128
//     blocks keeps its codes and "<name>_scale_inv" bit for bit (NativeMatrix);
//   - any other asked for as kBf16 is bf16 (f32 / f16 rounded to nearest even);
//   - else the values LoadMatrix reads (fp8 dequantized with its scales) are
//     quantized by QuantizeMatrix: fp8 max|w| / 448 per 128 x 128 block (e4m3
//     round to nearest even); int8 max|w| / 127 per row; int4 max|w| / 7 per
//     128 cols of a row.
// Errors: LoadMatrix's and NativeMatrix's (each naming the tensor, the
// expected and the given dtype and shape), non-finite weights (naming the
// element).
absl::StatusOr<QuantMatrix> LoadDenseMatrix(const Checkpoint& ckpt, const std::string& name,
                                            const WeightLoad& load);

// The codes of a kFp8, kInt8 or kInt4 matrix as the device keeps them
// (cuda/dev_quant_matrix.h): row-major, fp8 one e4m3 byte and int8 one byte
// a weight, int4 two a byte (the even column in the low nibble), rows of
// whole bytes. Empty for other formats.
std::vector<uint8_t> DenseCodes(const QuantMatrix& m);

// For the CPU reference: the weight as LoadDenseMatrix stores it, as f32
// values (QuantMatrix::At). A load that quantizes nothing (kBf16 without
// keep_fp8) is LoadMatrix itself; keep_fp8 gives LoadMatrix's values too
// (an fp8 tensor dequantizes to the same f32 either way).
absl::StatusOr<Matrix> LoadDenseAsMatrix(const Checkpoint& ckpt, const std::string& name,
                                         const WeightLoad& load);

}  // namespace hmoe::cpu
