// Plain fp32 building blocks of the CPU reference backend. Every function is
// the scalar reference its faster counterparts are tested against; results
// of Linear do not depend on T or on the thread split (each output element
// is one fixed-order dot product), which is what makes incremental decode
// bit-identical to a full recompute.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/runtime/thread_pool.h"
#include "common/safetensors.h"
#include "gpu_worker/driver/rope.h"

namespace hmoe::cpu {

// A row-major [rows, cols] weight, either f32 or bf16 (bf16 stays in the
// checkpoint mapping; `owner` keeps whichever storage alive).
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  std::shared_ptr<const void> owner;
  bool empty() const { return f32 == nullptr && bf16 == nullptr; }
  void RowToF32(int64_t r, float* out) const;  // out[cols]
};

// Loads `name` as a Matrix: BF16 (2-byte aligned) is used in place; F32, F16
// and unaligned BF16 are converted to an owned f32 copy; F8_E4M3 is
// dequantized with "<name>_scale_inv" and `fp8_block` (0: fp8 refused).
absl::StatusOr<Matrix> LoadMatrix(const Checkpoint& ckpt, const std::string& name,
                                  int64_t fp8_block = 0);
// Loads a tensor of any float dtype as a flat f32 vector; checks its size.
absl::StatusOr<std::vector<float>> LoadVector(const Checkpoint& ckpt, const std::string& name,
                                              int64_t expected_numel);
// LoadVector, or an empty vector when the checkpoint lacks `name`.
absl::StatusOr<std::vector<float>> LoadOptionalVector(const Checkpoint& ckpt,
                                                      const std::string& name,
                                                      int64_t expected_numel);

// Instruction sets Linear can use, in order; each gives the same bits.
enum class LinearIsa { kScalar, kAvx2, kAvx512 };
// The best this CPU has (cpuid).
LinearIsa BestLinearIsa();

// y[t, n] = dot(x[t, :], w[n, :]) (+ bias[n]) for t < T, n < w.rows;
// x is [T, w.cols]. Parallel over output rows. bias may be null. Each dot
// product keeps 8 partial sums (lane j: elements j, j + 8, ...), each a
// rounded multiply then a rounded add (no fused multiply-add), combined
// pairwise, then the tail. `isa` caps the instructions (the CPU's best
// below it is used): with AVX2 the 8 lanes run in one register, blocks of 2
// rows x 4 tokens sharing their loads; with AVX-512 two rows' lanes share
// one register, blocks of 4 rows x 4 tokens. Every path has the scalar
// loop's bits.
void Linear(ThreadPool* pool, const float* x, int64_t T, const Matrix& w, const float* bias,
            float* y, LinearIsa isa = LinearIsa::kAvx512);

// y = x * rsqrt(mean(x^2) + eps) * weight, per row of n (in place allowed).
void RmsNorm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* y);

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// ---- rotary embeddings (tables and layouts: gpu_worker/driver/rope.h) -------
// Rotates x[dim] in place with a RopeCosSin row.
void ApplyRope(float* x, int64_t dim, const float* cs, RopeLayout layout);

// ---- attention ------------------------------------------------------------------
// Whether a query at position q sees the key at position k (causal, and within
// the last `window` positions when window > 0, as transformers' sliding mask:
// k > q - window).
inline bool Visible(int64_t q, int64_t k, int64_t window) {
  return k <= q && (window <= 0 || k > q - window);
}
// Softmax attention of one query head over keys [0, q_pos] of a cache:
// out[dv] = sum_s p_s v[s], p = softmax(scale * q . k[s]) over visible s.
// k rows are `k_stride` floats apart, v rows `v_stride`. `scores` is scratch
// of q_pos + 1 floats.
void AttendOne(const float* q, int64_t dk, const float* k, int64_t k_stride, const float* v,
               int64_t dv, int64_t v_stride, int64_t q_pos, int64_t window, float scale,
               float* scores, float* out);
// AttendOne over the cache rows `rows[0..n)` only (ascending positions):
// out[dv] = sum_i p_i v[rows[i]], p = softmax(scale * q . k[rows[i]]).
// `scores` is scratch of n floats.
void AttendRows(const float* q, int64_t dk, const float* k, int64_t k_stride, const float* v,
                int64_t dv, int64_t v_stride, const int64_t* rows, int64_t n, float scale,
                float* scores, float* out);

}  // namespace hmoe::cpu
