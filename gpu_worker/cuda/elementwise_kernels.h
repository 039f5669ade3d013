// Elementwise and row-wise kernels of the CUDA backend: embedding, add +
// RMSNorm, RoPE, SiLU * up, bf16 <-> f32, bias, accumulate, row gathers.
// Launcher conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// out[t, :] = f32(table[ids[t], :]) for t < T; table bf16 [rows, cols].
cudaError_t EmbedRows(const uint16_t* table, int64_t cols, const int32_t* ids, int64_t T,
                      float* out, cudaStream_t s);

// Per row r < rows (n contiguous values each): if add != nullptr, x[r] += add[r]
// (x updated in place); then h[r] = w * (x[r] * inv) with
// inv = 1 / sqrt(sum(x^2) / n + eps), as cpu::RmsNorm. h may equal x. h_bf16
// (nullable) also receives bf16(h); h may be nullptr if only h_bf16 is wanted.
cudaError_t AddRmsNorm(float* x, const float* add, int64_t rows, int64_t n, const float* w,
                       float eps, float* h, uint16_t* h_bf16, cudaStream_t s);

// For t < T, i < heads: rotates x[t*tok_stride + i*head_stride + offset, ... + dim)
// in place with the RopeCosSin row cs[t*dim, (t+1)*dim) (cs[2j] = cos, cs[2j+1] =
// sin), pairs (j, j + dim/2) (halves) or (2j, 2j+1) (interleaved), as
// cpu::ApplyRope. The rotated ranges must not overlap.
cudaError_t ApplyRope(float* x, int64_t T, int64_t heads, int64_t tok_stride, int64_t head_stride,
                      int64_t offset, int64_t dim, const float* cs, bool interleaved,
                      cudaStream_t s);

// gu [T, 2I] (per row gate I values, then up I values) ->
// out_bf16[t*I + i] = bf16(silu(gate) * up), silu(x) = x / (1 + exp(-x)).
cudaError_t SiluMul(const float* gu, int64_t T, int64_t I, uint16_t* out_bf16, cudaStream_t s);

// out[i] = bf16(x[i]), i < n.
cudaError_t ToBf16(const float* x, int64_t n, uint16_t* out, cudaStream_t s);
// out[i] = f32(x[i]), i < n.
cudaError_t Bf16ToF32(const uint16_t* x, int64_t n, float* out, cudaStream_t s);

// y[t*N + n] += b[n], t < T, n < N.
cudaError_t AddBias(float* y, int64_t T, int64_t N, const float* b, cudaStream_t s);

// x[i] += a[i] (+ b[i] when b != nullptr), i < n.
cudaError_t Accumulate(float* x, const float* a, const float* b, int64_t n, cudaStream_t s);

// out[i*cols + j] = x[rows[i]*cols + j], i < n, j < cols.
cudaError_t GatherRows(const float* x, int64_t cols, const int32_t* rows, int64_t n, float* out,
                       cudaStream_t s);

}  // namespace hmoe::cuda
