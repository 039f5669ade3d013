// CUDA kernels of the GPU backend behind a narrow launcher interface. GPU-only
// header: public headers never include it.
//
// Every launcher takes device pointers, sizes and a stream (last), enqueues its
// work, allocates nothing, and returns the launch's cudaGetLastError() (or
// cudaErrorInvalidValue for arguments it cannot run). Zero-size work (T = 0,
// n = 0, ...) is a no-op returning cudaSuccess. Shapes are validated one layer
// up. bf16 values are uint16_t bit patterns: bf16 -> f32 is bits << 16, f32 ->
// bf16 rounds to nearest even and keeps NaN a (quiet) NaN. All math is fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/experts/format_codes.h"

namespace hmoe::cuda {

// Whether a CUDA device exists and a context can be made on the current one;
// otherwise false with the reason in *why (why may be null).
bool CudaDeviceUsable(std::string* why);

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

// MLA cache write: for t < T with slot[t] >= 0 (negative slots are skipped),
// row = cache + slot[t] * (r + rope): row[0, r) = RmsNorm(kva[t*(r+rope), +r),
// norm_w, eps); row[r, r + rope) = kva's rope part rotated with cs[t*rope, +rope).
cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          float* cache, cudaStream_t s);

// GQA cache write: kcache[slot[t]*row + i] = k[t*row + i], same for v, i < row;
// tokens with slot[t] < 0 are skipped.
cudaError_t WriteKvCache(const float* k, const float* v, int64_t T, int64_t row,
                         const int32_t* slot, float* kcache, float* vcache, cudaStream_t s);

// Paged causal attention (optionally sliding-window), one query row per
// (token, head).
struct PagedAttentionArgs {
  const float* q = nullptr;
  int64_t q_tok_stride = 0, q_head_stride = 0;
  int64_t dk = 0;  // <= 576
  // Key of kv head g for cache row `row` at k_cache[row*k_row + g*k_head_offset].
  const float* k_cache = nullptr;
  int64_t k_row = 0;
  int64_t k_head_offset = 0;
  const float* v_cache = nullptr;
  int64_t v_row = 0;
  int64_t v_head_offset = 0;
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

// MLA query absorption, qk = nope + rope, out [T, nh, r + rope]:
//   out[t, h, c] = sum_{j<nope} q[t*nh*qk + h*qk + j] * wkv[(h*(nope+vd) + j)*r + c], c < r;
//   out[t, h, r + i] = q[t, h, nope + i], i < rope (copied; roped later).
// wkv is bf16 [nh*(nope+vd), r] (kv_b_proj's weight). Each weight element is
// read once per call for T <= 32.
cudaError_t MlaAbsorbQuery(const float* q, const uint16_t* wkv, int64_t T, int64_t nh, int64_t nope,
                           int64_t rope, int64_t vd, int64_t r, float* out, cudaStream_t s);

// MLA output expansion:
//   out[t*nh*vd + h*vd + d] = sum_{c<r} wkv[(h*(nope+vd) + nope + d)*r + c] * olat[t*nh*r + h*r +
//   c].
// out_bf16 (nullable) also gets bf16(out); out may be nullptr if only out_bf16
// is wanted.
cudaError_t MlaExpandOutput(const float* olat, const uint16_t* wkv, int64_t T, int64_t nh,
                            int64_t nope, int64_t vd, int64_t r, float* out, uint16_t* out_bf16,
                            cudaStream_t s);

// Router parameters (hmoe::Route's GateSpec). method: 0 greedy,
// 1 group_limited_greedy (groups by their max), 2 noaux_tc (groups by the sum
// of their top 2).
struct RouteParams {
  int num_experts = 0, top_k = 0;
  bool sigmoid = false;
  int method = 0;
  int n_group = 1, topk_group = 1;
  bool norm = false;
  float norm_eps = 0, scale = 1;
};
// logits [T, E] -> ids/weights [T, K], as hmoe::Route: scores = sigmoid or
// softmax of the logits; selection on scores + bias (bias [E], nullable),
// restricted to the topk_group best groups when method != 0 and n_group > 1;
// ties go to the lower index; ids in descending selection score; weights =
// scores, divided by (their sum + norm_eps) when norm, times scale.
// E <= 512, K <= 16, n_group <= 16 (else cudaErrorInvalidValue).
cudaError_t RouteTokens(const float* logits, int64_t T, const RouteParams& p, const float* bias,
                        int32_t* ids, float* weights, cudaStream_t s);

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

// Expert Deferral's split, as hmoe::SplitDeferred (driver/routing.h):
// ids/w [T, K] -> the n lowest-weighted per token (ties: the later slot
// first) into ids_later/w_later [T, n], the rest in order into ids_now/w_now
// [T, K - n]. 0 <= n < K <= 64.
cudaError_t SplitDeferred(const int32_t* ids, const float* w, int64_t T, int64_t K, int64_t n,
                          int32_t* ids_now, float* w_now, int32_t* ids_later, float* w_later,
                          cudaStream_t s);

// A wait for the host without a host node (one thread): spins until *word
// leaves [busy_lo, busy_hi] or *abort != 0, or timeout_ns have passed (then
// sets *abort = 1, so the pass's later waits end at once); then a system
// fence, so the host data the word guards is read after it. *wait_ns (if not
// null) += the nanoseconds waited. word, abort and wait_ns are device
// pointers to mapped host memory (or device memory). busy_lo <= busy_hi.
cudaError_t WaitHostWord(const uint32_t* word, uint32_t busy_lo, uint32_t busy_hi, uint32_t* abort,
                         uint64_t timeout_ns, unsigned long long* wait_ns, cudaStream_t s);

// An expert call sent to the host in one kernel: copies hidden (bf16 [T, H])
// and ids / weights ([T, k]) into a slot's request regions (device pointers
// to mapped host memory), then, once every block's writes are fenced at
// system scope, the last block stores `request` into *state (release,
// system scope) if *armed != 0 and *abort == 0 (abort may be null: never). *counter is a device
// word, 0 between calls (the last block resets it); calls on one stream may share it. dst_ids,
// dst_weights and state are 4-byte aligned (hidden rows are copied 16 bytes at a time when both
// sides are 16-byte aligned).
cudaError_t SendExpertCall(const uint16_t* hidden, int64_t T, int64_t H, const int32_t* ids,
                           const float* weights, int64_t k, uint16_t* dst_hidden, int32_t* dst_ids,
                           float* dst_weights, uint32_t* state, uint32_t request,
                           const uint32_t* armed, const uint32_t* abort, unsigned int* counter,
                           cudaStream_t s);

// ---- hot experts: routed experts computed on the GPU ------------------------

// hmoe::SplitHot (driver/routing.h) on the device: slot i < n goes to hot
// (cold[i] = -1) when 0 <= ids[i] < E and mask[ids[i]] != 0, else to cold
// (hot[i] = -1).
cudaError_t SplitHotIds(const int32_t* ids, int64_t n, const uint8_t* mask, int64_t E,
                        int32_t* cold, int32_t* hot, cudaStream_t s);

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
struct HotExpertsArgs {
  const uint16_t* x = nullptr;  // bf16 [T][H]
  int64_t T = 0, H = 0, I = 0;
  const int32_t* ids = nullptr;    // [T][K]
  const float* weights = nullptr;  // [T][K]
  int64_t K = 0;
  // Device array [E]: slot ids[t, j] = e is computed when 0 <= e < E and
  // experts[e].gate.w != nullptr (a hot expert); other slots add nothing.
  const DevExpert* experts = nullptr;
  int64_t E = 0;
  float* out = nullptr;  // [T][H], overwritten
  void* scratch = nullptr;
  int64_t scratch_bytes = 0;  // >= HotExpertsScratchBytes(T, H, I, K)
};
int64_t HotExpertsScratchBytes(int64_t T, int64_t H, int64_t I, int64_t K);
// out[t] = sum over hot slots j (ascending) of weights[t, j] * E(x[t]) with
// the numerics of the expert service's reference in its "few tokens" regime
// (RunMoeReference): int8 and int4 weights meet int8 activations quantized
// per row (x per token over H, then silu(gate) * up per slot over I), the
// integer dot products exact, combined in double with the scales; bf16
// weights meet f32 activations and a bf16-rounded intermediate. Results
// match the reference up to summation order and expf's last bits.
cudaError_t HotExperts(const HotExpertsArgs& a, cudaStream_t s);

// Streamed experts (hybrid prefill: weights uploaded per pass, computed by
// cuBLAS on bf16 copies). DequantToBf16: out [rows][cols] = bf16(w's value):
// bf16 as is, int8 q * scale[r], int4 q * scale[r][c / group], rounded once.
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

// Launches a kernel that traps: the context's sticky error (a fault test's
// stand-in for a real device failure).
cudaError_t InjectStickyError(cudaStream_t s);

}  // namespace hmoe::cuda
