// AVX2 + FMA kernels for CPUs without AVX-512 (same packed layout, same
// numerics). Compiled with -mavx2 -mfma -mf16c; entered only after dispatch.
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
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

// ---- native formats (packed.h native layout) ----------------------------------------
// Channels 0-7 and 8-15 of a panel as two 8-lane halves.
struct Half2 {
  __m256 v[2];
};

// 8 e8m0 scales -> f32 2^(e - 127) (e = 0: 2^-127, a denormal).
inline __m256 E8m0x8(const uint8_t* p) {
  int64_t b;
  std::memcpy(&b, p, 8);
  const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b));
  const __m256i bits = _mm256_slli_epi32(e, 23);
  const __m256i zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), zero));
}
inline __m256 Bf16x8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// The 16 channels' scales of panel-local group gi (fp8: super-block gi).
inline Half2 NativeScales(const PackedGeom& g, const uint8_t* panel, int64_t gi) {
  Half2 s;
  if (g.format == WeightFormat::kFp8) {
    float v;
    std::memcpy(&v, panel + g.fp8_scale_offset + gi * 4, 4);
    s.v[0] = s.v[1] = _mm256_set1_ps(v);
    return s;
  }
  const int64_t per = g.sb_k / g.group;
  const uint8_t* p = panel + (gi / per) * g.sb_bytes + g.sb_code_bytes;
  if (g.format == WeightFormat::kInt4Bf16) {
    p += (gi % per) * 32;
    s.v[0] = Bf16x8(p);
    s.v[1] = Bf16x8(p + 16);
  } else {
    p += (gi % per) * 16;
    s.v[0] = E8m0x8(p);
    s.v[1] = E8m0x8(p + 8);
  }
  return s;
}

// The values of k (super-block-local) of a super-block's 16 channels; e4m3
// as value / 256 (f16 bit trick, exact: the caller multiplies by 256).
template <WeightFormat F>
inline Half2 NativeDecode(const uint8_t* sb, int64_t k) {
  Half2 w;
  if constexpr (F == WeightFormat::kFp8 || F == WeightFormat::kMxfp8) {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + (k / 4) * 64 + 16 * (k % 4)));
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);  // s at bit 14, e m at 13..7
    const __m256i h = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    w.v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    w.v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else {
    const uint8_t* line = sb + (k / 8) * 64;
    const int t = static_cast<int>(k % 8);
    const int sh = (t & 3) * 8 + (t >> 2) * 4;
    for (int hf = 0; hf < 2; ++hf) {
      const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32 * hf));
      if constexpr (F == WeightFormat::kMxfp4) {
        const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
        const __m256i n = _mm256_srl_epi32(d, _mm_cvtsi32_si128(sh));
        const __m256i sign =
            _mm256_and_si256(_mm256_slli_epi32(n, 28), _mm256_set1_epi32(INT32_MIN));
        w.v[hf] = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, n), _mm256_castsi256_ps(sign));
      } else {  // int4bf16: the nibble sign-extended
        const __m256i q = _mm256_srai_epi32(_mm256_sll_epi32(d, _mm_cvtsi32_si128(28 - sh)), 28);
        w.v[hf] = _mm256_cvtepi32_ps(q);
      }
    }
  }
  return w;
}

// f32 -> bf16 -> f32, round to nearest even (F32ToBf16 for finite values).
inline __m256 RoundBf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// kMany = false: "few" (per group sum x * value, times the scale); true:
// "many" (sum x * bf16(value * scale)).
template <WeightFormat F, int MB, bool kMany>
void NativeRows(const GemmArgs& a, const uint16_t* const* rows, float* const* c) {
  const PackedGeom& g = *a.g;
  constexpr bool kE4m3 = F == WeightFormat::kFp8 || F == WeightFormat::kMxfp8;
  alignas(32) float xf[MB][256];
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    const uint8_t* panel = a.w + j * g.panel_bytes;
    __m256 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < g.nsb; ++sb) {
      const uint8_t* p = panel + sb * g.sb_bytes;
      for (int m = 0; m < MB; ++m)
        for (int64_t k = 0; k < g.sb_k; ++k) xf[m][k] = Bf16ToF32(rows[m][sb * g.sb_k + k]);
      for (int64_t k0 = 0; k0 < g.sb_k; k0 += g.group) {
        __m256 ga[MB][2];
        for (int m = 0; m < MB; ++m) ga[m][0] = ga[m][1] = _mm256_setzero_ps();
        const Half2 s = NativeScales(g, panel, (sb * g.sb_k + k0) / g.group);
        for (int64_t k = k0; k < k0 + g.group; ++k) {
          Half2 w = NativeDecode<F>(p, k);
          if constexpr (kMany)
            for (int h = 0; h < 2; ++h) {
              const __m256 v = kE4m3 ? _mm256_mul_ps(w.v[h], _mm256_set1_ps(256.0f)) : w.v[h];
              w.v[h] = RoundBf16(_mm256_mul_ps(v, s.v[h]));
            }
          for (int m = 0; m < MB; ++m) {
            const __m256 x = _mm256_set1_ps(xf[m][k]);
            ga[m][0] = _mm256_fmadd_ps(w.v[0], x, ga[m][0]);
            ga[m][1] = _mm256_fmadd_ps(w.v[1], x, ga[m][1]);
          }
        }
        for (int m = 0; m < MB; ++m)
          for (int h = 0; h < 2; ++h)
            acc[m][h] = kMany ? _mm256_add_ps(acc[m][h], ga[m][h])
                              : _mm256_fmadd_ps(ga[m][h], s.v[h], acc[m][h]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) {
        const __m256 v =
            kE4m3 && !kMany ? _mm256_mul_ps(acc[m][h], _mm256_set1_ps(256.0f)) : acc[m][h];
        _mm256_storeu_ps(c[m] + (j - a.nb0) * 16 + 8 * h, v);
      }
  }
}

template <WeightFormat F, bool kMany>
void NativeFormat(const GemmArgs& a) {
  for (int m0 = 0; m0 < a.m; m0 += 4) {
    const int mb = std::min(4, a.m - m0);
    const uint16_t* rows[4];
    float* c[4];
    for (int m = 0; m < mb; ++m) {
      rows[m] =
          reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + (m0 + m) * a.lda);
      c[m] = a.c + (m0 + m) * a.ldc;
    }
    switch (mb) {
      case 1:
        NativeRows<F, 1, kMany>(a, rows, c);
        break;
      case 2:
        NativeRows<F, 2, kMany>(a, rows, c);
        break;
      case 3:
        NativeRows<F, 3, kMany>(a, rows, c);
        break;
      default:
        NativeRows<F, 4, kMany>(a, rows, c);
        break;
    }
  }
}

template <bool kMany>
void GemmNativeT(const GemmArgs& a) {
  switch (a.g->format) {
    case WeightFormat::kMxfp4:
      return NativeFormat<WeightFormat::kMxfp4, kMany>(a);
    case WeightFormat::kInt4Bf16:
      return NativeFormat<WeightFormat::kInt4Bf16, kMany>(a);
    case WeightFormat::kFp8:
      return NativeFormat<WeightFormat::kFp8, kMany>(a);
    case WeightFormat::kMxfp8:
      return NativeFormat<WeightFormat::kMxfp8, kMany>(a);
    default:
      return;
  }
}
void GemmNative(const GemmArgs& a) { GemmNativeT<false>(a); }
void GemmNativeBf16(const GemmArgs& a) { GemmNativeT<true>(a); }

}  // namespace

const KernelSet& Avx2Kernels() {
  static const KernelSet k = [] {
    KernelSet s = ScalarKernels();
    s.bf16 = GemmBf16;
    s.i8 = GemmI8;
    s.i4_i8 = GemmI4I8;
    s.weighted_sum = WeightedSum;
    s.native = GemmNative;
    s.native_bf16 = GemmNativeBf16;
    return s;  // i4_bf16, SiLU and quantization: the scalar versions
  }();
  return k;
}

}  // namespace hmoe::kern
