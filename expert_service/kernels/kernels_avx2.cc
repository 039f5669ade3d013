// AVX2 + FMA kernels for CPUs without AVX-512 (same packed layout, same
// numerics). Compiled with -mavx2 -mfma -mf16c; entered only after dispatch.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "common/dtype.h"
#include "expert_service/kernels/gemm.h"

namespace hmoe::kern {
namespace {

inline float Bf(const uint16_t* p) { return Bf16ToF32(*p); }

void GemmBf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    const uint8_t* p = a.w + j * g.panel_bytes;
    for (int m = 0; m < a.m; ++m) {
      const uint16_t* x =
          reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda);
      __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t kk = 0; kk < g.kp / 2; ++kk) {
        const __m256 x0 = _mm256_set1_ps(Bf(x + 2 * kk)), x1 = _mm256_set1_ps(Bf(x + 2 * kk + 1));
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_load_si256(reinterpret_cast<const __m256i*>(p + kk * 64 + 32 * h));
          acc[h] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), x0, acc[h]);
          acc[h] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)), x1, acc[h]);
        }
      }
      float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
      _mm256_storeu_ps(c, acc[0]);
      _mm256_storeu_ps(c + 8, acc[1]);
    }
  }
}

// acc[q] (q = quarter of 4 n) += pairwise int16 products of a 64-byte
// [16 n][4 k] int8 line with 4 activations.
inline void Dot4(const __m256i lo_half, const __m256i hi_half, __m256i x16, __m256i* acc) {
  acc[0] = _mm256_add_epi32(
      acc[0], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo_half)), x16));
  acc[1] = _mm256_add_epi32(
      acc[1], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo_half, 1)), x16));
  acc[2] = _mm256_add_epi32(
      acc[2], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi_half)), x16));
  acc[3] = _mm256_add_epi32(
      acc[3], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi_half, 1)), x16));
}

inline __m256i Act4(const int8_t* x) {
  const int64_t v = static_cast<uint16_t>(x[0]) |
                    static_cast<int64_t>(static_cast<uint16_t>(x[1])) << 16 |
                    static_cast<int64_t>(static_cast<uint16_t>(x[2])) << 32 |
                    static_cast<int64_t>(static_cast<uint16_t>(x[3])) << 48;
  return _mm256_set1_epi64x(v);
}

// Sums the pair lanes: acc[q] holds [n][2] for 4 n -> out[16] int32.
inline void PairSums(const __m256i* acc, int32_t* out) {
  alignas(32) int32_t t[32];
  for (int q = 0; q < 4; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8 * q), acc[q]);
  for (int n = 0; n < 16; ++n) out[n] = t[2 * n] + t[2 * n + 1];
}

void GemmI8(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    const uint8_t* p = a.w + j * g.panel_bytes;
    const float* sc = reinterpret_cast<const float*>(p + g.i8_scale_offset());
    for (int m = 0; m < a.m; ++m) {
      const int8_t* x = static_cast<const int8_t*>(a.a) + m * a.lda;
      __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
      for (int64_t q = 0; q < g.kp / 4; ++q) {
        const __m256i l0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + q * 64));
        const __m256i l1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + q * 64 + 32));
        Dot4(l0, l1, Act4(x + 4 * q), acc);
      }
      int32_t s[16];
      PairSums(acc, s);
      float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
      for (int n = 0; n < 16; ++n) c[n] = static_cast<float>(s[n]) * a.a_scale[m] * sc[n];
    }
  }
}

void GemmI4I8(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  const __m256i low4 = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
  const int64_t groups = g.kp / g.group, gb = g.i4_group_bytes();
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    const uint8_t* p = a.w + j * g.panel_bytes;
    for (int m = 0; m < a.m; ++m) {
      const int8_t* x = static_cast<const int8_t*>(a.a) + m * a.lda;
      float accf[16] = {};
      for (int64_t gi = 0; gi < groups; ++gi) {
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        const uint8_t* gp = p + gi * gb;
        for (int64_t o = 0; o < g.group / 8; ++o) {
          const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(gp + o * 64));
          const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(gp + o * 64 + 32));
          const int64_t k0 = gi * g.group + 8 * o;
          Dot4(_mm256_sub_epi8(_mm256_and_si256(v0, low4), eight),
               _mm256_sub_epi8(_mm256_and_si256(v1, low4), eight), Act4(x + k0), acc);
          Dot4(_mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4), eight),
               _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4), eight),
               Act4(x + k0 + 4), acc);
        }
        int32_t s[16];
        PairSums(acc, s);
        const float* sc = reinterpret_cast<const float*>(gp + int64_t{g.group} * 8);
        for (int n = 0; n < 16; ++n) accf[n] += static_cast<float>(s[n]) * sc[n];
      }
      float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
      for (int n = 0; n < 16; ++n) c[n] = accf[n] * a.a_scale[m];
    }
  }
}

// KernelSet::weighted_sum: 16 floats per step (two sums), scalar tail;
// plain stores (AVX2 machines: the output is small next to the rows read).
void WeightedSum(const float* const* rows, const float* w, int n, int64_t len, float* out,
                 bool /*stream*/) {
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      s0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(rows[j] + i), s0);
      s1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(rows[j] + i + 8), s1);
    }
    _mm256_storeu_ps(out + i, s0);
    _mm256_storeu_ps(out + i + 8, s1);
  }
  for (; i < len; ++i) {
    float s = 0.0f;
    for (int j = 0; j < n; ++j) s = std::fma(w[j], rows[j][i], s);
    out[i] = s;
  }
}

}  // namespace

const KernelSet& Avx2Kernels() {
  static const KernelSet k = [] {
    KernelSet s = ScalarKernels();
    s.bf16 = GemmBf16;
    s.i8 = GemmI8;
    s.i4_i8 = GemmI4I8;
    s.weighted_sum = WeightedSum;
    return s;  // i4_bf16, SiLU and quantization: the scalar versions
  }();
  return k;
}

}  // namespace hmoe::kern
