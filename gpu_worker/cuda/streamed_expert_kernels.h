// Streamed experts' kernels: dequantization to bf16 and the row gathers /
// scatters around cuBLAS. Launcher conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// Streamed experts (hybrid prefill: weights uploaded per pass, computed by
// cuBLAS on bf16 copies). DequantToBf16: out [rows][cols] = bf16(w's value):
// bf16 as is, int8 q * scale[r], int4 q * scale[r][c / group], the native
// formats bf16(f32(value * scale)) (QuantMatrix::At), rounded once.
cudaError_t DequantToBf16(const DevQuantMatrix& w, uint16_t* out, cudaStream_t s);
// out[i][:] = x[rows[i]][:] for i < n (bf16 rows of `cols`).
cudaError_t GatherBf16Rows(const uint16_t* x, int64_t cols, const int32_t* rows, int64_t n,
                           uint16_t* out, cudaStream_t s);
// ys[slots[i]][:] = w[slots[i]] * z[i][:] for i < n (f32 rows of `cols`).
cudaError_t ScatterWeightedRows(const float* z, int64_t cols, const int32_t* slots, int64_t n,
                                const float* w, float* ys, cudaStream_t s);
// out[t][c] = sum over j < K ascending with marked[t*K + j] of ys[t*K + j][c].
cudaError_t SumMarkedSlots(const float* ys, const uint8_t* marked, int64_t T, int64_t K, int64_t H,
                           float* out, cudaStream_t s);

}  // namespace hmoe::cuda
