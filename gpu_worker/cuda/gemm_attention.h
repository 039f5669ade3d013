// Attention of long prefill runs by tensor-core GEMMs (cuBLAS, TF32 inputs,
// f32 accumulation): a run is one sequence's consecutive positions in a
// pass. Its keys (and values) are gathered from the paged cache once; per
// chunk of queries and per kv head, scores = scale * q . k^T (one strided
// batched GEMM over the heads that share the kv head), a masked softmax in
// place, out = p . v (a second one). The same contract as PagedAttention
// (paged_attention_kernels.h) within TF32 rounding; PagedAttention stays the
// path of short runs and decode. Internal to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"

namespace hmoe::cuda {

// Tokens [row0, row0 + n) of a pass: one sequence's positions [pos0, pos0 + n),
// its blocks at block_table[table_start].
struct AttentionRun {
  int64_t row0 = 0, n = 0, pos0 = 0;
  int32_t table_start = 0;
};

// The maximal runs of at least min_tokens tokens (min_tokens >= 1) in a
// pass's host metadata: consecutive tokens with one table_start and
// consecutive positions. Ascending by row0.
std::vector<AttentionRun> FindAttentionRuns(const int32_t* table_start, const int32_t* pos,
                                            int64_t T, int64_t min_tokens);

// Floats GemmAttention needs for `run` when it takes queries `chunk` at a
// time (its gathered keys and values and one chunk's scores).
int64_t GemmAttentionScratchFloats(const PagedAttentionArgs& a, const AttentionRun& run,
                                   int64_t chunk);

// The largest query chunk (<= kMaxGemmAttentionChunk, <= run.n) whose
// scratch fits in `scratch_floats`; 0 when not even one query does.
inline constexpr int64_t kMaxGemmAttentionChunk = 512;
int64_t GemmAttentionChunk(const PagedAttentionArgs& a, const AttentionRun& run,
                           int64_t scratch_floats);

// Where GemmAttention works and how it multiplies.
struct GemmAttentionOptions {
  float* scratch = nullptr;  // device
  int64_t scratch_floats = 0;
  // TF32 inputs (tensor cores); false: full-fp32 GEMMs (slower; rounding as
  // PagedAttention's up to summation order).
  bool tf32 = true;
};

// Enqueues the attention of `run`'s tokens on `s` (`blas` bound to `s`): a's
// q, k/v cache, block table (device), heads, dims, window, scale and out as
// for PagedAttention; a.T / a.pos / a.table_start / a.scratch are not read.
// INVALID_ARGUMENT when the scratch holds no chunk (GemmAttentionChunk 0);
// INTERNAL for a failed launch. `launches` (nullable) counts launches.
absl::Status GemmAttention(const PagedAttentionArgs& a, const AttentionRun& run,
                           const GemmAttentionOptions& o, cublasHandle_t blas, cudaStream_t s,
                           int64_t* launches);

// A whole pass: `runs` (from FindAttentionRuns over a's metadata) whose
// chunk fits the GEMM scratch by GemmAttention, every other token by
// PagedAttention (a.scratch as given, over the token ranges between them).
// `gemm_tokens` (nullable) adds the tokens GemmAttention took.
absl::Status AttendPass(const PagedAttentionArgs& a, const std::vector<AttentionRun>& runs,
                        const GemmAttentionOptions& o, cublasHandle_t blas, cudaStream_t s,
                        int64_t* launches, int64_t* gemm_tokens);

}  // namespace hmoe::cuda
