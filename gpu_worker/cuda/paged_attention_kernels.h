// Attention over the paged KV cache: the GQA cache write, paged attention
// with split keys, and GEMM attention's gather / masked softmax pieces
// (gpu_worker/cuda/gemm_attention.h). Launcher conventions:
// gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// GQA cache write: kcache[slot[t]*row + i] = k[t*row + i], same for v, i < row;
// tokens with slot[t] < 0 are skipped.
cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, int64_t row,
                         const int32_t* slot, float* kcache, float* vcache, cudaStream_t s);
// The same into caches of any element type: row t of k / v (kc.row floats;
// vc.row == kc.row) is stored as row slot[t] of kc / vc (StoreKvRow's
// rounding, common/kv_quant.h).
cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, const int32_t* slot,
                         const KvRows& kc, const KvRows& vc, cudaStream_t s);

// Paged causal attention (optionally sliding-window), one query row per
// (token, head).
struct PagedAttentionArgs {
  const float* q = nullptr;
  int64_t q_tok_stride = 0, q_head_stride = 0;
  int64_t dk = 0;  // <= 576
  // Key of kv head g for cache row `row` at k_cache[row*k_row + g*k_head_offset].
  // Row and offsets count elements of the caches' type `kv` (KvRows'
  // layout, kernel_api.h); kFp8: k_scale / v_scale hold kv_parts f32 per
  // row, element e of a row in part min(e / kv_part_len, kv_parts - 1).
  const void* k_cache = nullptr;
  int64_t k_row = 0;
  int64_t k_head_offset = 0;
  const void* v_cache = nullptr;
  int64_t v_row = 0;
  int64_t v_head_offset = 0;
  KvElem kv = KvElem::kF32;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t kv_part_len = 0, kv_parts = 1;
  int64_t dv = 0;  // <= 512
  // kv head of head h = h / (num_heads / num_kv_heads).
  int64_t T = 0, num_heads = 0, num_kv_heads = 1;
  const int32_t* block_table = nullptr;  // flat array of physical block ids
  // [T]: token t's sequence's blocks start at block_table[table_start[t]].
  const int32_t* table_start = nullptr;
  const int32_t* pos = nullptr;  // [T]: the query's position
  int64_t block_tokens = 16;
  int64_t window = 0;  // > 0: keys k > pos - window only
  float scale = 1.0f;
  float* out = nullptr;
  int64_t out_tok_stride = 0, out_head_stride = 0;
  // Optional scratch for splitting long key ranges across blocks (decode).
  // With scratch == nullptr the kernel runs unsplit (correct, slower at small
  // T); otherwise it needs PagedAttentionScratchFloats(*this) floats.
  float* scratch = nullptr;
  int64_t scratch_floats = 0;
};
// Key position p of token t lives in cache row
// block_table[table_start[t] + p / block_tokens] * block_tokens + p % block_tokens.
// out = softmax(scale * q.k) v over visible keys (cpu::Visible: k <= pos and,
// when window > 0, k > pos - window), as cpu::AttendOne; rows with no visible
// key get zeros. num_heads must be a multiple of num_kv_heads. Any context
// length (online softmax over chunks of keys). Returns cudaErrorInvalidValue
// when dk > 576, dv > 512, or scratch is given but smaller than needed.
cudaError_t PagedAttention(const PagedAttentionArgs& a, cudaStream_t s);
// GEMM attention's pieces (gpu_worker/cuda/gemm_attention.h):
// out[i][:] = the cache row of key position p0 + i, i < n, where position p
// lives in row table[p / block_tokens] * block_tokens + p % block_tokens
// (rows of row_floats floats).
cudaError_t GatherPagedRows(const float* cache, int64_t row_floats, const int32_t* table,
                            int64_t block_tokens, int64_t p0, int64_t n, float* out,
                            cudaStream_t s);
// The same from a cache of any element type (rows of c.row elements),
// decoded to f32: out[i][:] holds c.row floats.
cudaError_t GatherPagedRows(const KvRows& c, const int32_t* table, int64_t block_tokens, int64_t p0,
                            int64_t n, float* out, cudaStream_t s);
// In place over rows r < rows of `cols` scores: row r is the query at
// position q_pos0 + r % group_rows, column c the key at position k_pos0 + c;
// visible keys (cpu::Visible: k <= q and, when window > 0, k > q - window)
// get softmax weights exp(s - max) / sum over the visible ones, the rest 0
// (a row with none visible: all 0).
cudaError_t MaskedSoftmaxRows(float* scores, int64_t rows, int64_t cols, int64_t group_rows,
                              int64_t q_pos0, int64_t k_pos0, int64_t window, cudaStream_t s);
// Scratch floats PagedAttention uses for these shapes (0: it never splits);
// depends on T, num_heads, num_kv_heads and dv only, and is at most
// 2 * 512 * 8 * (dv + 2).
int64_t PagedAttentionScratchFloats(const PagedAttentionArgs& a);

}  // namespace hmoe::cuda
