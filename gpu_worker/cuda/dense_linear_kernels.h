// Linear layers over quantized dense weights (attention projections, dense
// MLPs, shared experts, the LM head): kFp8 (e4m3, an f32 scale per 128 x 128
// block), kInt8 (an f32 scale per row) and kInt4 (two's complement codes two
// per byte, the even column in the low nibble, an f32 scale per 128 columns
// of a row), in DevQuantMatrix's layout. Each weight is f32(value * scale),
// as QuantMatrix::At. Launcher conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include <cstdint>

#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// The most tokens DenseGemv takes; larger passes dequantize (DenseToBf16)
// and multiply with cuBLAS.
inline constexpr int64_t kDenseGemvMaxTokens = 32;

// Whether DenseGemv and DenseToBf16 take `f` with `group`: kFp8 and kInt4
// with group 128, kInt8.
bool DenseLinearTakes(WeightFormat f, int group);

// y[t * ldy + r] = sum over c of x[t, c] * W(r, c), for t < T and r <
// W.rows (overwritten; ldy >= W.rows); x bf16 [T][W.cols], 1 <= T <=
// kDenseGemvMaxTokens. Fused: every weight byte is read once (16-byte loads
// when each row's bytes are a multiple of 16 and the pointers 16-byte
// aligned, else byte by byte), several lanes share a row, and the sums are
// f32 (a 128-column group's partial sum times its scale). The order of the
// sum differs from the CPU reference's: results agree to f32 rounding.
cudaError_t DenseGemv(const DevQuantMatrix& W, const uint16_t* x, int64_t T, float* y, int64_t ldy,
                      cudaStream_t s);

// out[i, c] = bf16(W(row0 + i, c)) for i < n, c < W.cols (row-major, out's
// rows W.cols apart), rows [row0, row0 + n) within W.rows.
cudaError_t DenseToBf16(const DevQuantMatrix& W, int64_t row0, int64_t n, uint16_t* out,
                        cudaStream_t s);

}  // namespace hmoe::cuda
