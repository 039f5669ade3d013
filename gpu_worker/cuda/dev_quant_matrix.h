// Routed expert weights on the device, in the expert service's quantized
// form; read by the hot and streamed expert kernels. CUDA-free.
#pragma once

#include <cstdint>

namespace hmoe::cuda {

// One matrix of a routed expert in the expert service's quantized form
// (expert_service/kernels/moe.h QuantMatrix), on the device: format 0 bf16
// ([rows][cols] bf16); 1 int8 (q [rows][cols], scale [rows]); 2 int4 (q
// packed two per byte, the even column in the low nibble, [rows][ceil(cols /
// 2)] bytes, values in [-8, 7]; scale [rows][ceil(cols / group)]).
struct DevQuantMatrix {
  int format = 0;
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
