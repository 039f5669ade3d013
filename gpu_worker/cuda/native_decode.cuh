// Device decoding of the native formats (mxfp4, int4bf16, fp8, mxfp8) in the
// worker's kernel layout (gpu_worker/hot_weights.h ToKernelLayout): the codes
// row-major as stored (4-bit two per byte, the even column in the low
// nibble; 8-bit one e4m3fn byte) and every scale widened to f32, laid out
// [ScaleRows][ScalesPerRow] (format_codes.h). Included by .cu files only.
#pragma once

#include <cstdint>

#include "gpu_worker/cuda/dev_quant_matrix.h"

namespace hmoe::cuda {
namespace {

__device__ __forceinline__ bool IsNativeDev(WeightFormat f) {
  return f == WeightFormat::kMxfp4 || f == WeightFormat::kInt4Bf16 || f == WeightFormat::kFp8 ||
         f == WeightFormat::kMxfp8;
}

// e2m1: sign bit 3; |v| = m * 0.5 (e = 0) or (1 + m * 0.5) * 2^(e - 1).
__device__ __forceinline__ float E2M1Dev(uint32_t code) {
  const uint32_t e = (code >> 1) & 3, m = code & 1;
  const float mag = e == 0 ? 0.5f * static_cast<float>(m)
                           : ldexpf(1.0f + 0.5f * static_cast<float>(m), static_cast<int>(e) - 1);
  return (code & 8) ? -mag : mag;
}

// e4m3fn: bias 7; e = 0 is m * 2^-9; never NaN here (refused at load).
__device__ __forceinline__ float E4M3Dev(uint32_t b) {
  const int e = static_cast<int>((b >> 3) & 15), m = static_cast<int>(b & 7);
  const float mag =
      e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(static_cast<float>(8 + m), e - 10);
  return (b & 0x80) ? -mag : mag;
}

// The weight (r, c) of a native-format matrix: f32(value * scale), exactly
// QuantMatrix::At.
__device__ __forceinline__ float NativeWeightDev(const DevQuantMatrix& W, int64_t r, int64_t c) {
  const uint8_t* w = static_cast<const uint8_t*>(W.w);
  const int64_t spr = (W.cols + W.group - 1) / W.group;
  const int64_t si = (W.format == WeightFormat::kFp8 ? r / W.group : r) * spr + c / W.group;
  float v;
  if (W.format == WeightFormat::kFp8 || W.format == WeightFormat::kMxfp8) {
    v = E4M3Dev(w[r * W.cols + c]);
  } else {
    const uint32_t b = w[r * ((W.cols + 1) / 2) + c / 2];
    const uint32_t code = (c % 2 == 0) ? (b & 15) : (b >> 4);
    v = W.format == WeightFormat::kMxfp4 ? E2M1Dev(code)
                                         : static_cast<float>(static_cast<int>(code ^ 8) - 8);
  }
  return v * W.scale[si];
}

}  // namespace
}  // namespace hmoe::cuda
