#include "gpu_worker/cpu/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/weight_map.h"

namespace hmoe::cpu {
namespace {

inline float ToF(float v) { return v; }
inline float ToF(uint16_t v) { return Bf16ToF32(v); }

// Fixed-order dot product: 8 strided partial sums, combined pairwise, then the tail.
template <typename W>
inline float Dot(const float* x, const W* w, int64_t n) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += x[i + j] * ToF(w[i + j]);
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; i < n; ++i) s += x[i] * ToF(w[i]);
  return s;
}

// Dot with the 8 partial sums in one AVX2 register: the same multiply and
// add per lane (no FMA: this target does not enable it), the same pairwise
// combination and tail, so the same bits.
__attribute__((target("avx2"))) inline __m256 Load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2"))) inline __m256 Load8(const uint16_t* w) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
template <typename W>
__attribute__((target("avx2"))) float DotAvx2(const float* x, const W* w, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(x + i), Load8(w + i)));
  alignas(32) float p[8];
  _mm256_store_ps(p, a);
  float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
  for (; i < n; ++i) s += x[i] * ToF(w[i]);
  return s;
}

template <typename W>
void LinearRows(const float* x, int64_t T, const W* w, int64_t K, int64_t N, const float* bias,
                int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t t = 0; t < T; ++t) y[t * N + n] = Dot(x + t * K, row, K) + b;
  }
}
// The AVX2 path in blocks of 2 weight rows x 4 tokens: each weight load
// serves 4 tokens and each activation load 2 rows, while every output keeps
// its own register of 8 partial sums, filled in DotAvx2's order and finished
// as DotAvx2 finishes (same bits).
template <typename W>
__attribute__((target("avx2"))) void Block2x4Avx2(const float* xt, int64_t K, const W* w0,
                                                  const float* bias, int64_t n, int64_t N,
                                                  float* yt) {
  const W* w1 = w0 + K;
  const int64_t k8 = K / 8 * 8;
  // Named accumulators: GCC -O2 keeps arrays of them on the stack.
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  const float* x0 = xt;
  const float* x1 = xt + K;
  const float* x2 = xt + 2 * K;
  const float* x3 = xt + 3 * K;
  for (int64_t i = 0; i < k8; i += 8) {
    const __m256 v0 = Load8(w0 + i), v1 = Load8(w1 + i);
    __m256 xv = _mm256_loadu_ps(x0 + i);
    a00 = _mm256_add_ps(a00, _mm256_mul_ps(xv, v0));
    a10 = _mm256_add_ps(a10, _mm256_mul_ps(xv, v1));
    xv = _mm256_loadu_ps(x1 + i);
    a01 = _mm256_add_ps(a01, _mm256_mul_ps(xv, v0));
    a11 = _mm256_add_ps(a11, _mm256_mul_ps(xv, v1));
    xv = _mm256_loadu_ps(x2 + i);
    a02 = _mm256_add_ps(a02, _mm256_mul_ps(xv, v0));
    a12 = _mm256_add_ps(a12, _mm256_mul_ps(xv, v1));
    xv = _mm256_loadu_ps(x3 + i);
    a03 = _mm256_add_ps(a03, _mm256_mul_ps(xv, v0));
    a13 = _mm256_add_ps(a13, _mm256_mul_ps(xv, v1));
  }
  const __m256 acc[2][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}};
  for (int r = 0; r < 2; ++r) {
    const W* row = r == 0 ? w0 : w1;
    const float b = bias ? bias[n + r] : 0.0f;
    for (int j = 0; j < 4; ++j) {
      alignas(32) float p[8];
      _mm256_store_ps(p, acc[r][j]);
      float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      const float* xj = xt + j * K;
      for (int64_t i = k8; i < K; ++i) s += xj[i] * ToF(row[i]);
      yt[j * N + n + r] = s + b;
    }
  }
}

// AVX-512: the same 8-lane accumulators, two rows' in one register (lanes
// 0-7 one row, 8-15 the next), in blocks of 4 rows x 4 tokens: twice the
// arithmetic per instruction, each lane still a multiply then an add (this
// file is built with -ffp-contract=off: AVX-512F brings FMA, which GCC
// would otherwise contract into).
// (Here and below the maskz forms: GCC 12 warns that the plain ones'
// undefined sources may be used uninitialized.)
__attribute__((target("avx512f"))) inline __m512 Load8x2(const float* a, const float* b) {
  const __m256d lo = _mm256_castps_pd(_mm256_loadu_ps(a)),
                hi = _mm256_castps_pd(_mm256_loadu_ps(b));
  return _mm512_castpd_ps(
      _mm512_mask_broadcast_f64x4(_mm512_maskz_broadcast_f64x4(0x0F, lo), 0xF0, hi));
}
__attribute__((target("avx512f"))) inline __m512 Load8x2(const uint16_t* a, const uint16_t* b) {
  const __m256i u = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  const __m512i v = _mm512_maskz_cvtepu16_epi32(0xFFFF, u);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, v, 16));
}
__attribute__((target("avx512f"))) inline __m512 Broadcast8(const float* x) {
  return _mm512_castpd_ps(_mm512_maskz_broadcast_f64x4(0xFF, _mm256_castps_pd(_mm256_loadu_ps(x))));
}
template <typename W>
__attribute__((target("avx512f"))) void Block4x4Avx512(const float* xt, int64_t K, const W* w0,
                                                       const float* bias, int64_t n, int64_t N,
                                                       float* yt) {
  const W* w1 = w0 + K;
  const W* w2 = w1 + K;
  const W* w3 = w2 + K;
  const int64_t k8 = K / 8 * 8;
  __m512 p00 = _mm512_setzero_ps(), p01 = p00, p02 = p00, p03 = p00;  // rows 0, 1
  __m512 p10 = p00, p11 = p00, p12 = p00, p13 = p00;                  // rows 2, 3
  const float* x0 = xt;
  const float* x1 = xt + K;
  const float* x2 = xt + 2 * K;
  const float* x3 = xt + 3 * K;
  for (int64_t i = 0; i < k8; i += 8) {
    const __m512 v01 = Load8x2(w0 + i, w1 + i), v23 = Load8x2(w2 + i, w3 + i);
    __m512 xb = Broadcast8(x0 + i);
    p00 = _mm512_add_ps(p00, _mm512_mul_ps(xb, v01));
    p10 = _mm512_add_ps(p10, _mm512_mul_ps(xb, v23));
    xb = Broadcast8(x1 + i);
    p01 = _mm512_add_ps(p01, _mm512_mul_ps(xb, v01));
    p11 = _mm512_add_ps(p11, _mm512_mul_ps(xb, v23));
    xb = Broadcast8(x2 + i);
    p02 = _mm512_add_ps(p02, _mm512_mul_ps(xb, v01));
    p12 = _mm512_add_ps(p12, _mm512_mul_ps(xb, v23));
    xb = Broadcast8(x3 + i);
    p03 = _mm512_add_ps(p03, _mm512_mul_ps(xb, v01));
    p13 = _mm512_add_ps(p13, _mm512_mul_ps(xb, v23));
  }
  const __m512 acc[2][4] = {{p00, p01, p02, p03}, {p10, p11, p12, p13}};
  const W* rows[4] = {w0, w1, w2, w3};
  for (int r = 0; r < 4; ++r) {
    const float b = bias ? bias[n + r] : 0.0f;
    for (int j = 0; j < 4; ++j) {
      alignas(64) float q[16];
      _mm512_store_ps(q, acc[r / 2][j]);
      const float* p = q + (r % 2) * 8;
      float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      const float* xj = xt + j * K;
      for (int64_t i = k8; i < K; ++i) s += xj[i] * ToF(rows[r][i]);
      yt[j * N + n + r] = s + b;
    }
  }
}

// Rows [n0, n1) in chunks whose weights stay in L2 (~256 KiB) while every
// 4-token block passes over them (activations from L1, weights from L2),
// in blocks of kRows rows x 4 tokens; rows and tokens left over go one by
// one through DotAvx2 (the same bits as the blocks).
template <int kRows, typename W>
void LinearRowsBlocked(const float* x, int64_t T, const W* w, int64_t K, int64_t N,
                       const float* bias, int64_t n0, int64_t n1, float* y,
                       void (*block)(const float*, int64_t, const W*, const float*, int64_t,
                                     int64_t, float*)) {
  constexpr int64_t kL2Bytes = 256 << 10;
  const int64_t chunk = std::max<int64_t>(
      kRows, kL2Bytes / std::max<int64_t>(1, K * int64_t{sizeof(W)}) / kRows * kRows);
  const int64_t t4 = T / 4 * 4;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk), blocks_end = c0 + (c1 - c0) / kRows * kRows;
    for (int64_t t = 0; t < t4; t += 4)
      for (int64_t n = c0; n < blocks_end; n += kRows)
        block(x + t * K, K, w + n * K, bias, n, N, y + t * N);
    for (int64_t n = c0; n < c1; ++n) {
      const W* row = w + n * K;
      const float b = bias ? bias[n] : 0.0f;
      // The tokens past the blocks; for rows past the last block, every token.
      for (int64_t t = n < blocks_end ? t4 : 0; t < T; ++t)
        y[t * N + n] = DotAvx2(x + t * K, row, K) + b;
    }
  }
}

std::string Where(const Checkpoint& ckpt, const std::string& name) {
  return absl::StrCat(ckpt.dir(), ": tensor \"", name, "\"");
}

}  // namespace

void Matrix::RowToF32(int64_t r, float* out) const {
  if (f32) {
    std::memcpy(out, f32 + r * cols, static_cast<size_t>(cols) * sizeof(float));
  } else {
    const uint16_t* p = bf16 + r * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = Bf16ToF32(p[c]);
  }
}

absl::StatusOr<Matrix> LoadMatrix(const Checkpoint& ckpt, const std::string& name,
                                  int64_t fp8_block) {
  ASSIGN_OR_RETURN(Tensor t, ckpt.Get(name));
  if (t.rank() != 2)
    return absl::InvalidArgumentError(absl::StrCat(Where(ckpt, name), " has shape ",
                                                   ShapeString(t.shape()), ", expected a matrix"));
  Matrix m;
  m.rows = t.dim(0);
  m.cols = t.dim(1);
  const bool aligned2 = reinterpret_cast<uintptr_t>(t.raw()) % alignof(uint16_t) == 0;
  switch (t.dtype()) {
    case DType::kBF16:
      if (aligned2) {
        auto keep = std::make_shared<Tensor>(t);
        m.bf16 = keep->data<uint16_t>();
        m.owner = keep;
        return m;
      }
      [[fallthrough]];
    case DType::kF32:
    case DType::kF16: {
      auto v = std::make_shared<std::vector<float>>(t.ToF32());
      m.f32 = v->data();
      m.owner = v;
      return m;
    }
    case DType::kF8E4M3: {
      if (fp8_block <= 0)
        return absl::InvalidArgumentError(absl::StrCat(
            Where(ckpt, name), " is F8_E4M3 but the config has no fp8 quantization_config"));
      const std::string sname = ScaleInvName(name);
      ASSIGN_OR_RETURN(Tensor s, ckpt.Get(sname));
      const Shape want{(m.rows + fp8_block - 1) / fp8_block, (m.cols + fp8_block - 1) / fp8_block};
      if (s.shape() != want || s.dtype() != DType::kF32)
        return absl::InvalidArgumentError(
            absl::StrCat(Where(ckpt, sname), " is ", DTypeName(s.dtype()), " ",
                         ShapeString(s.shape()), ", expected F32 ", ShapeString(want)));
      const std::vector<float> scale = s.ToF32();
      auto v = std::make_shared<std::vector<float>>(static_cast<size_t>(m.rows * m.cols));
      DequantFp8BlockToF32(t.data<uint8_t>(), m.rows, m.cols, scale.data(), fp8_block, v->data());
      m.f32 = v->data();
      m.owner = v;
      return m;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(Where(ckpt, name), " has dtype ",
                                                     DTypeName(t.dtype()),
                                                     ", expected F32, BF16, F16 or F8_E4M3"));
  }
}

absl::StatusOr<std::vector<float>> LoadVector(const Checkpoint& ckpt, const std::string& name,
                                              int64_t expected_numel) {
  ASSIGN_OR_RETURN(Tensor t, ckpt.Get(name));
  if (t.numel() != expected_numel)
    return absl::InvalidArgumentError(absl::StrCat(Where(ckpt, name), " has shape ",
                                                   ShapeString(t.shape()), ", expected ",
                                                   expected_numel, " elements"));
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16)
    return absl::InvalidArgumentError(absl::StrCat(
        Where(ckpt, name), " has dtype ", DTypeName(t.dtype()), ", expected F32, BF16 or F16"));
  return t.ToF32();
}

absl::StatusOr<std::vector<float>> LoadOptionalVector(const Checkpoint& ckpt,
                                                      const std::string& name,
                                                      int64_t expected_numel) {
  if (!ckpt.Has(name)) return std::vector<float>();
  return LoadVector(ckpt, name, expected_numel);
}

LinearIsa BestLinearIsa() {
  if (__builtin_cpu_supports("avx512f")) return LinearIsa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return LinearIsa::kAvx2;
  return LinearIsa::kScalar;
}

void Linear(ThreadPool* pool, const float* x, int64_t T, const Matrix& w, const float* bias,
            float* y, LinearIsa isa) {
  const int64_t K = w.cols, N = w.rows;
  if (T <= 0 || N <= 0) return;
  // Chunks of at least ~32k multiply-adds, so tiny products stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K * T));
  const LinearIsa use = std::min(isa, BestLinearIsa());
  auto body = [&](int64_t n0, int64_t n1) {
    switch (use) {
      case LinearIsa::kAvx512:
        if (w.f32)
          LinearRowsBlocked<4>(x, T, w.f32, K, N, bias, n0, n1, y, &Block4x4Avx512<float>);
        else
          LinearRowsBlocked<4>(x, T, w.bf16, K, N, bias, n0, n1, y, &Block4x4Avx512<uint16_t>);
        return;
      case LinearIsa::kAvx2:
        if (w.f32)
          LinearRowsBlocked<2>(x, T, w.f32, K, N, bias, n0, n1, y, &Block2x4Avx2<float>);
        else
          LinearRowsBlocked<2>(x, T, w.bf16, K, N, bias, n0, n1, y, &Block2x4Avx2<uint16_t>);
        return;
      case LinearIsa::kScalar:
        break;
    }
    if (w.f32)
      LinearRows(x, T, w.f32, K, N, bias, n0, n1, y);
    else
      LinearRows(x, T, w.bf16, K, N, bias, n0, n1, y);
  };
  if (!pool) return body(0, N);
  // Ranges of whole 4-row units, so no thread's range ends mid-block.
  constexpr int64_t kUnit = 4;
  pool->ParallelFor((N + kUnit - 1) / kUnit, (grain + kUnit - 1) / kUnit,
                    [&](int64_t u0, int64_t u1) { body(u0 * kUnit, std::min(N, u1 * kUnit)); });
}

void RmsNorm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float ss = 0.0f;
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

// ---- rope ---------------------------------------------------------------------

void ApplyRope(float* x, int64_t dim, const float* cs, RopeLayout layout) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = layout == RopeLayout::kHalves ? i : 2 * i;
    const int64_t b = layout == RopeLayout::kHalves ? i + half : 2 * i + 1;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x1 = x[a], x2 = x[b];
    x[a] = x1 * c - x2 * s;
    x[b] = x2 * c + x1 * s;
  }
}

// ---- attention -----------------------------------------------------------------

void AttendOne(const float* q, int64_t dk, const float* k, int64_t k_stride, const float* v,
               int64_t dv, int64_t v_stride, int64_t q_pos, int64_t window, float scale,
               float* scores, float* out) {
  const int64_t s0 = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
  float mx = -INFINITY;
  for (int64_t s = s0; s <= q_pos; ++s) {
    scores[s] = Dot(q, k + s * k_stride, dk) * scale;
    mx = std::max(mx, scores[s]);
  }
  float sum = 0.0f;
  for (int64_t s = s0; s <= q_pos; ++s) sum += (scores[s] = std::exp(scores[s] - mx));
  const float inv = 1.0f / sum;
  std::fill(out, out + dv, 0.0f);
  for (int64_t s = s0; s <= q_pos; ++s) {
    const float p = scores[s] * inv;
    const float* vs = v + s * v_stride;
    for (int64_t i = 0; i < dv; ++i) out[i] += p * vs[i];
  }
}

void AttendRows(const float* q, int64_t dk, const float* k, int64_t k_stride, const float* v,
                int64_t dv, int64_t v_stride, const int64_t* rows, int64_t n, float scale,
                float* scores, float* out) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = Dot(q, k + rows[i] * k_stride, dk) * scale;
    mx = std::max(mx, scores[i]);
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (scores[i] = std::exp(scores[i] - mx));
  const float inv = 1.0f / sum;
  std::fill(out, out + dv, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float p = scores[i] * inv;
    const float* vs = v + rows[i] * v_stride;
    for (int64_t j = 0; j < dv; ++j) out[j] += p * vs[j];
  }
}

}  // namespace hmoe::cpu
