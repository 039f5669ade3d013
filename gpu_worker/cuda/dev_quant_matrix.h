// Routed expert weights on the device, in the expert service's quantized
// form; read by the hot and streamed expert kernels. CUDA-free.
#pragma once

#include <cstdint>

#include "common/experts/format_codes.h"

namespace hmoe::cuda {

// One matrix of a routed expert in the expert service's quantized form
// (common/experts/quantize.h QuantMatrix), on the device: kBf16 ([rows][cols]
// bf16); kInt8 (q [rows][cols], scale [rows]); kInt4 (q packed two per byte,
// the even column in the low nibble, [rows][ceil(cols / 2)] bytes, values in
// [-8, 7]; scale [rows][ceil(cols / group)]).
struct DevQuantMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
  int64_t rows = 0, cols = 0;
  const void* w = nullptr;
  const float* scale = nullptr;
};
struct DevExpert {
  DevQuantMatrix gate, up;  // [I][H]
  DevQuantMatrix down;      // [H][I]
};

}  // namespace hmoe::cuda
