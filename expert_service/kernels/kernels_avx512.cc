// AVX-512 kernels (BF16 vdpbf16ps, VNNI vpdpbusd): GEMV-style, for experts
// with few tokens. Compiled with -mavx512{f,bw,dq,vl,bf16,vnni}; entered only
// after dispatch says the CPU has them.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "common/dtype.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/i4_dequant_avx512.h"

namespace hmoe::kern {
namespace {

// Software prefetch distances of the GEMV kernels: FewTuning (tuning.h).
// Measured in process on the GPU machine (16 threads, bench/results run 8):
// ds-v3 T=1 int4 1.38-1.45 ms with the defaults vs 1.66-1.69 ms without;
// bf16 and int8 gain 4-15% at T=1 / T=8 (qwen3-30b too).

// Prefetches base + off. The address may lie past the end of the panel
// buffer (the last panel's stream runs ahead of its data): it is formed as an
// integer, never as an out-of-range pointer, and prefetches do not fault.
inline void Prefetch(const uint8_t* base, int64_t off) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +
                                             static_cast<uintptr_t>(off)),
               _MM_HINT_T0);
}

inline __m512i Bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// ---- bf16 -------------------------------------------------------------------------
template <int MB, int NB>
void Bf16Block(const uint8_t* const* panels, const uint16_t* const* rows, int64_t kp, int64_t pf,
               float* const* c) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp / 2; ++kk) {
    if (pf > 0)
      for (int n = 0; n < NB; ++n) Prefetch(panels[n], kk * 64 + pf);
    __m512i w[NB];
    for (int n = 0; n < NB; ++n) w[n] = _mm512_load_si512(panels[n] + kk * 64);
    for (int m = 0; m < MB; ++m) {
      const __m512i x = Bcast32(rows[m] + 2 * kk);
      for (int n = 0; n < NB; ++n)
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)w[n], (__m512bh)x);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) _mm512_storeu_ps(c[m] + 16 * n, acc[m][n]);
}

// ---- int8 x int8 (u8 = a + 128 against s8 weights; rowsum corrects) --------------------
template <int MB, int NB>
void I8Block(const uint8_t* const* panels, const int8_t* const* rows, const float* a_scale,
             const PackedGeom& g, int64_t pf, float* const* c) {
  __m512i acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int64_t q = 0; q < g.kp / 4; ++q) {
    if (pf > 0)
      for (int n = 0; n < NB; ++n) Prefetch(panels[n], q * 64 + pf);
    __m512i w[NB];
    for (int n = 0; n < NB; ++n) w[n] = _mm512_load_si512(panels[n] + q * 64);
    for (int m = 0; m < MB; ++m) {
      const __m512i x = _mm512_xor_si512(Bcast32(rows[m] + 4 * q), flip);
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], x, w[n]);
    }
  }
  for (int n = 0; n < NB; ++n) {
    const __m512 sc = _mm512_loadu_ps(panels[n] + g.i8_scale_offset());
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(panels[n] + g.i8_rowsum_offset()), 7);
    for (int m = 0; m < MB; ++m) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][n], corr));
      _mm512_storeu_ps(c[m] + 16 * n,
                       _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(a_scale[m])), sc));
    }
  }
}

// ---- int4 (u8 nibbles = q + 8) x int8 activations, per-group scales --------------------
template <int MB, int NB>
void I4I8Block(const uint8_t* const* panels, const int8_t* const* rows, const float* a_scale,
               const int32_t* const* gsum, const PackedGeom& g, int64_t pf, float* const* c) {
  __m512 accf[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) accf[m][n] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t groups = g.kp / g.group, gb = g.i4_group_bytes(), lines = g.group / 8;
  pf = (pf + gb - 1) / gb * gb;  // whole groups ahead
  for (int64_t gi = 0; gi < groups; ++gi) {
    if (pf > 0)
      for (int n = 0; n < NB; ++n)
        for (int64_t b = 0; b < gb; b += 64) Prefetch(panels[n], gi * gb + pf + b);
    __m512i acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_si512();
    for (int64_t o = 0; o < lines; ++o) {
      __m512i lo[NB], hi[NB];
      for (int n = 0; n < NB; ++n) {
        const __m512i v = _mm512_load_si512(panels[n] + gi * gb + o * 64);
        lo[n] = _mm512_and_si512(v, low4);
        hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      const int64_t k0 = gi * g.group + 8 * o;
      for (int m = 0; m < MB; ++m) {
        const __m512i x0 = Bcast32(rows[m] + k0), x1 = Bcast32(rows[m] + k0 + 4);
        for (int n = 0; n < NB; ++n) {
          acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], lo[n], x0);
          acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], hi[n], x1);
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 sc = _mm512_loadu_ps(panels[n] + gi * gb + int64_t{g.group} * 8);
      for (int m = 0; m < MB; ++m) {
        const __m512i corr = _mm512_set1_epi32(8 * gsum[m][gi]);
        accf[m][n] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][n], corr)), sc, accf[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n)
      _mm512_storeu_ps(c[m] + 16 * n, _mm512_mul_ps(accf[m][n], _mm512_set1_ps(a_scale[m])));
}

// Drives a block function over rows (chunks of up to 4) and panels (pairs).
template <typename F>
void ForBlocks(const GemmArgs& a, const uint8_t* w, int64_t panel_bytes, F&& f) {
  for (int m0 = 0; m0 < a.m; m0 += 4) {
    const int mb = std::min(4, a.m - m0);
    for (int64_t j = a.nb0; j < a.nb1; j += 2) {
      const int nb = static_cast<int>(std::min<int64_t>(2, a.nb1 - j));
      const uint8_t* panels[2] = {w + j * panel_bytes, w + (j + nb - 1) * panel_bytes};
      float* c[4];
      for (int m = 0; m < mb; ++m) c[m] = a.c + (m0 + m) * a.ldc + (j - a.nb0) * 16;
      f(m0, mb, nb, panels, c);
    }
  }
}

#define HMOE_DISPATCH_MB_NB(mb, nb, CALL) \
  do {                                    \
    if (nb == 2) {                        \
      switch (mb) {                       \
        case 1:                           \
          CALL(1, 2);                     \
          break;                          \
        case 2:                           \
          CALL(2, 2);                     \
          break;                          \
        case 3:                           \
          CALL(3, 2);                     \
          break;                          \
        default:                          \
          CALL(4, 2);                     \
          break;                          \
      }                                   \
    } else {                              \
      switch (mb) {                       \
        case 1:                           \
          CALL(1, 1);                     \
          break;                          \
        case 2:                           \
          CALL(2, 1);                     \
          break;                          \
        case 3:                           \
          CALL(3, 1);                     \
          break;                          \
        default:                          \
          CALL(4, 1);                     \
          break;                          \
      }                                   \
    }                                     \
  } while (0)

void GemmBf16(const GemmArgs& a) { GemmBf16PanelsAvx512(a, a.w, a.g->panel_bytes, a.g->kp); }

void GemmI8(const GemmArgs& a) {
  const int64_t pf = a.tune().few.pf_i8;
  ForBlocks(a, a.w, a.g->panel_bytes,
            [&](int m0, int mb, int nb, const uint8_t* const* panels, float* const* c) {
              const int8_t* rows[4];
              for (int m = 0; m < mb; ++m)
                rows[m] = static_cast<const int8_t*>(a.a) + (m0 + m) * a.lda;
#define CALL(M, N) I8Block<M, N>(panels, rows, a.a_scale + m0, *a.g, pf, c)
              HMOE_DISPATCH_MB_NB(mb, nb, CALL);
#undef CALL
            });
}

void GemmI4I8(const GemmArgs& a) {
  const int64_t pf = a.tune().few.pf_i4;
  ForBlocks(a, a.w, a.g->panel_bytes,
            [&](int m0, int mb, int nb, const uint8_t* const* panels, float* const* c) {
              const int8_t* rows[4];
              const int32_t* gs[4];
              for (int m = 0; m < mb; ++m) {
                rows[m] = static_cast<const int8_t*>(a.a) + (m0 + m) * a.lda;
                gs[m] = a.a_gsum + (m0 + m) * a.gsum_stride;
              }
#define CALL(M, N) I4I8Block<M, N>(panels, rows, a.a_scale + m0, gs, *a.g, pf, c)
              HMOE_DISPATCH_MB_NB(mb, nb, CALL);
#undef CALL
            });
}

// int4 "many" without AMX: dequantize each panel to bf16 in scratch, then bf16 GEMV.
void GemmI4Bf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  uint16_t* buf = reinterpret_cast<uint16_t*>(a.scratch);
  const int64_t kc = std::min<int64_t>(g.kp, kGemmScratchBytes / 64 / 2 / g.group * g.group);
  // Per panel, per K chunk: dequantize, then accumulate into c.
  for (int64_t j = a.nb0; j < a.nb1; ++j)
    for (int m = 0; m < a.m; ++m) std::memset(a.c + m * a.ldc + (j - a.nb0) * 16, 0, 64);
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    for (int64_t k0 = 0; k0 < g.kp; k0 += kc) {
      const int64_t k1 = std::min(g.kp, k0 + kc);
      DequantI4PanelBf16Avx512(g, a.w + j * g.panel_bytes, k0, k1, buf);
      for (int m = 0; m < a.m; ++m) {
        const uint16_t* x =
            reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda) + k0;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < (k1 - k0) / 2; ++kk)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(buf + kk * 32),
                                 (__m512bh)Bcast32(x + 2 * kk));
        float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
        _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), acc));
      }
    }
  }
}

// ---- native formats (packed.h native layout) ----------------------------------------
// 16 e8m0 scales -> f32 2^(e - 127) (e = 0: 2^-127, a denormal).
inline __m512 E8m0x16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __mmask16 z = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), z, _mm512_set1_epi32(0x00400000)));
}

// The 16 channels' scales of panel-local group gi (fp8: super-block gi).
inline __m512 NativeScales(const PackedGeom& g, const uint8_t* panel, int64_t gi) {
  if (g.format == WeightFormat::kFp8) {
    float v;
    std::memcpy(&v, panel + g.fp8_scale_offset + gi * 4, 4);
    return _mm512_set1_ps(v);
  }
  const int64_t per = g.sb_k / g.group;
  const uint8_t* p = panel + (gi / per) * g.sb_bytes + g.sb_code_bytes;
  if (g.format == WeightFormat::kInt4Bf16) {
    const __m512i v = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (gi % per) * 32)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  return E8m0x16(p + (gi % per) * 16);
}

template <WeightFormat F>
constexpr bool kE4m3 = F == WeightFormat::kFp8 || F == WeightFormat::kMxfp8;
// k per 64-byte code line.
template <WeightFormat F>
constexpr int kLineK = kE4m3<F> ? 4 : 8;

template <int T>
inline __m512 Nibble(__m512i d, __m512 table) {
  constexpr int kShift = (T & 3) * 8 + (T >> 2) * 4;  // k0+i: bits 8i; k0+4+i: bits 8i+4
  return _mm512_permutexvar_ps(_mm512_srli_epi32(d, kShift), table);  // low 4 bits index
}
// Two k (32 bytes: 16 channels each) of e4m3 codes -> value / 256 (f16 bit
// trick: s.eeee.mmm placed as f16 s.0eeee.mmm0000000, exact, denormals too).
inline void E4m3Pair(const uint8_t* p, __m512* w0, __m512* w1) {
  const __m512i t = _mm512_slli_epi16(
      _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p))), 7);
  const __m512i h = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));
  *w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
// One code line -> the values of its kLineK k (16 channels each); e4m3 as
// value / 256.
template <WeightFormat F>
inline void DecodeLine(const uint8_t* line, __m512* w) {
  if constexpr (kE4m3<F>) {
    E4m3Pair(line, &w[0], &w[1]);
    E4m3Pair(line + 32, &w[2], &w[3]);
  } else {
    const __m512 table = F == WeightFormat::kMxfp4
                             ? _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                              -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f)
                             : _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, -8.0f,
                                              -7.0f, -6.0f, -5.0f, -4.0f, -3.0f, -2.0f, -1.0f);
    const __m512i d = _mm512_load_si512(line);
    w[0] = Nibble<0>(d, table);
    w[1] = Nibble<1>(d, table);
    w[2] = Nibble<2>(d, table);
    w[3] = Nibble<3>(d, table);
    w[4] = Nibble<4>(d, table);
    w[5] = Nibble<5>(d, table);
    w[6] = Nibble<6>(d, table);
    w[7] = Nibble<7>(d, table);
  }
}

// Group gi's 16 channel scales within a super-block whose scales start at
// sc (all but fp8).
template <WeightFormat F>
inline __m512 GroupScales(const uint8_t* sc, int64_t gi) {
  if constexpr (F == WeightFormat::kInt4Bf16) {
    const __m512i v =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + gi * 32)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  } else {
    return E8m0x16(sc + gi * 16);
  }
}
// Super-block sb's scale for group gi (fp8: one f32 per super-block).
template <WeightFormat F>
inline __m512 SuperBlockScales(const PackedGeom& g, const uint8_t* panel, int64_t sb, int64_t gi) {
  if constexpr (F == WeightFormat::kFp8) {
    float v;
    std::memcpy(&v, panel + g.fp8_scale_offset + sb * 4, 4);
    return _mm512_set1_ps(v);
  } else {
    return GroupScales<F>(panel + sb * g.sb_bytes + g.sb_code_bytes, gi);
  }
}

// "few": MB rows x one panel; per group sum_k x * value, times the scale.
// The code lines are walked in storage order (no division per line); each
// row keeps kChains independent accumulators over a group so the FMAs do
// not wait on each other.
template <WeightFormat F, int MB>
void NativeBlock(const PackedGeom& g, const uint8_t* panel, const uint16_t* const* rows, int64_t pf,
                 float* const* c) {
  constexpr int kK = kLineK<F>;
  constexpr int kChains = 4;
  const int64_t groups_per_sb = F == WeightFormat::kFp8 ? 1 : g.sb_k / g.group;
  const int64_t group_k = g.sb_k / groups_per_sb;
  alignas(64) float xf[MB][256];
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* line = panel + sb * g.sb_bytes;
    for (int m = 0; m < MB; ++m)
      for (int64_t k = 0; k < g.sb_k; k += 16) {
        const __m256i b =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[m] + sb * g.sb_k + k));
        _mm512_store_ps(xf[m] + k,
                        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
    for (int64_t gi = 0; gi < groups_per_sb; ++gi) {
      __m512 ga[MB][kChains];
      for (int m = 0; m < MB; ++m)
        for (int i = 0; i < kChains; ++i) ga[m][i] = _mm512_setzero_ps();
      const int64_t k0 = gi * group_k;
      for (int64_t k = k0; k < k0 + group_k; k += kK, line += 64) {
        if (pf > 0) Prefetch(line, pf);
        __m512 w[kK];
        DecodeLine<F>(line, w);
        for (int t = 0; t < kK; ++t)
          for (int m = 0; m < MB; ++m)
            ga[m][t % kChains] =
                _mm512_fmadd_ps(w[t], _mm512_set1_ps(xf[m][k + t]), ga[m][t % kChains]);
      }
      const __m512 s = SuperBlockScales<F>(g, panel, sb, gi);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fmadd_ps(
            _mm512_add_ps(_mm512_add_ps(ga[m][0], ga[m][1]), _mm512_add_ps(ga[m][2], ga[m][3])), s,
            acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm512_storeu_ps(c[m], kE4m3<F> ? _mm512_mul_ps(acc[m], _mm512_set1_ps(256.0f)) : acc[m]);
}

// 4-bit codes, "few", on bf16 dot products: one code line (8 k x 16
// channels, the INT4 nibble order) gives four vectors of bf16 pairs by a
// 16-entry vpermw table: the 16-bit halves of channel c's dword hold k0,
// k0+4, k0+1, k0+5 (low half) and k0+2, k0+6, k0+3, k0+7 (high half) at
// nibble shifts 0, 4, 8, 12, so shift s pairs (k0, k0+2), (k0+4, k0+6),
// (k0+1, k0+3), (k0+5, k0+7). The activations come as bf16 pairs in that
// order (PairRows). The values are exact in bf16; vdpbf16ps sums exact
// products in fp32 (as the bf16 kernel).
template <WeightFormat F>
inline __m512i Bf16Table() {
  // The 16 entries in both 256-bit halves (vpermw reads the low 5 bits of
  // an index; a 4-bit code reaches the first 16).
  return _mm512_broadcast_i64x4(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(FourBitBf16Table(F))));
}

// xp[k / 2 + i], i < 4: the bf16 pairs of Native4Block's order for the 8 k
// at k (k a multiple of 8), over kp k of row x.
inline void PairRow(const uint16_t* x, int64_t kp, uint32_t* xp) {
  const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int64_t k = 0; k < kp; k += 8)
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(xp + k / 2),
        _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k)), order));
}

template <WeightFormat F, int MB>
void Native4Block(const PackedGeom& g, const uint8_t* panel, const uint32_t* const* xp, int64_t pf,
                  float* c0, int64_t ldc) {
  const __m512i table = Bf16Table<F>();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const int64_t groups_per_sb = g.sb_k / g.group;
  const int64_t group_lines = g.group / 8;
  const uint32_t* x[MB];
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm512_setzero_ps();
    x[m] = xp[m];
  }
  // Lines in storage order: each super-block's code lines, group after
  // group, then its scales. One accumulator per vpermw shift (4 chains).
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* line = panel + sb * g.sb_bytes;
    const uint8_t* sc = line + g.sb_code_bytes;
    for (int64_t gi = 0; gi < groups_per_sb; ++gi) {
      __m512 ga[MB][4];
      for (int m = 0; m < MB; ++m)
        for (int i = 0; i < 4; ++i) ga[m][i] = _mm512_setzero_ps();
      for (int64_t o = 0; o < group_lines; ++o, line += 64) {
        if (pf > 0) Prefetch(line, pf);
        const __m512i d = _mm512_load_si512(line);
        const __m512i w[4] = {
            _mm512_permutexvar_epi16(_mm512_and_si512(d, low4), table),
            _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(d, 4), low4), table),
            _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(d, 8), low4), table),
            _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 12), table)};
        for (int m = 0; m < MB; ++m) {
          for (int i = 0; i < 4; ++i)
            ga[m][i] = _mm512_dpbf16_ps(ga[m][i], (__m512bh)w[i],
                                        (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m][i])));
          x[m] += 4;
        }
      }
      const __m512 s = GroupScales<F>(sc, gi);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fmadd_ps(
            _mm512_add_ps(_mm512_add_ps(ga[m][0], ga[m][1]), _mm512_add_ps(ga[m][2], ga[m][3])), s,
            acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(c0 + m * ldc, acc[m]);
}

// 4-bit "few" with the activations paired once per call (in the scratch).
template <WeightFormat F>
void Native4Few(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  const int64_t pf = a.tune().few.pf_i4;
  uint32_t* buf = reinterpret_cast<uint32_t*>(a.scratch);
  for (int m0 = 0; m0 < a.m; m0 += 4) {
    const int mb = std::min(4, a.m - m0);
    const uint32_t* xp[4];
    for (int m = 0; m < mb; ++m) {
      PairRow(
          reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + (m0 + m) * a.lda),
          g.kp, buf + m * (g.kp / 2));
      xp[m] = buf + m * (g.kp / 2);
    }
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      float* c = a.c + m0 * a.ldc + (j - a.nb0) * 16;
      switch (mb) {
        case 1:
          Native4Block<F, 1>(g, panel, xp, pf, c, a.ldc);
          break;
        case 2:
          Native4Block<F, 2>(g, panel, xp, pf, c, a.ldc);
          break;
        case 3:
          Native4Block<F, 3>(g, panel, xp, pf, c, a.ldc);
          break;
        default:
          Native4Block<F, 4>(g, panel, xp, pf, c, a.ldc);
          break;
      }
    }
  }
}

template <WeightFormat F>
void NativeFew(const GemmArgs& a) {
  if constexpr (!kE4m3<F>) {
    // The paired activations of 4 rows: 8 bytes per k.
    if (a.scratch != nullptr && 8 * a.g->kp <= a.scratch_bytes) return Native4Few<F>(a);
  }
  const int64_t pf = kE4m3<F> ? a.tune().few.pf_i8 : a.tune().few.pf_i4;
  ForBlocks(a, a.w, a.g->panel_bytes,
            [&](int m0, int mb, int nb, const uint8_t* const* panels, float* const* c) {
              const uint16_t* rows[4];
              for (int m = 0; m < mb; ++m)
                rows[m] = reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) +
                                                            (m0 + m) * a.lda);
              for (int n = 0; n < nb; ++n) {
                float* cn[4];
                for (int m = 0; m < mb; ++m) cn[m] = c[m] + 16 * n;
                switch (mb) {
                  case 1:
                    NativeBlock<F, 1>(*a.g, panels[n], rows, pf, cn);
                    break;
                  case 2:
                    NativeBlock<F, 2>(*a.g, panels[n], rows, pf, cn);
                    break;
                  case 3:
                    NativeBlock<F, 3>(*a.g, panels[n], rows, pf, cn);
                    break;
                  default:
                    NativeBlock<F, 4>(*a.g, panels[n], rows, pf, cn);
                    break;
                }
              }
            });
}

void GemmNative(const GemmArgs& a) {
  switch (a.g->format) {
    case WeightFormat::kMxfp4:
      return NativeFew<WeightFormat::kMxfp4>(a);
    case WeightFormat::kInt4Bf16:
      return NativeFew<WeightFormat::kInt4Bf16>(a);
    case WeightFormat::kFp8:
      return NativeFew<WeightFormat::kFp8>(a);
    case WeightFormat::kMxfp8:
      return NativeFew<WeightFormat::kMxfp8>(a);
    default:
      return;
  }
}

template <WeightFormat F>
void DequantNative(const PackedGeom& g, const uint8_t* panel, int64_t k0, int64_t k1,
                   uint16_t* out) {
  constexpr int kK = kLineK<F>;
  // bf16 pairs [c][2]: lanes 2c, 2c+1 <- k, k+1 of channel c.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t k = k0; k < k1; k += g.group) {
    const uint8_t* p = panel + (k / g.sb_k) * g.sb_bytes;
    __m512 s = NativeScales(g, panel, k / g.group);
    for (int64_t kl = k % g.sb_k; kl < k % g.sb_k + g.group; kl += kK) {
      __m512 w[kK];
      DecodeLine<F>(p + kl / kK * 64, w);
      for (int t = 0; t < kK; t += 2) {
        __m512 w0 = w[t], w1 = w[t + 1];
        if (kE4m3<F>) {  // value / 256 back to the value, then the scale (never overflows early)
          w0 = _mm512_mul_ps(w0, _mm512_set1_ps(256.0f));
          w1 = _mm512_mul_ps(w1, _mm512_set1_ps(256.0f));
        }
        const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(w1, s), _mm512_mul_ps(w0, s));
        const int64_t kg = (k / g.sb_k) * g.sb_k + kl + t;  // panel-local k of the pair
        _mm512_store_si512(out + (kg - k0) / 2 * 32, _mm512_permutexvar_epi16(pairs, b));
      }
    }
  }
}

// Native "many" without AMX: dequantize each panel to bf16 in scratch, then bf16 GEMV.
void GemmNativeBf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  uint16_t* buf = reinterpret_cast<uint16_t*>(a.scratch);
  const int64_t kc = std::min<int64_t>(g.kp, kGemmScratchBytes / 64 / 2 / g.sb_k * g.sb_k);
  for (int64_t j = a.nb0; j < a.nb1; ++j)
    for (int m = 0; m < a.m; ++m) std::memset(a.c + m * a.ldc + (j - a.nb0) * 16, 0, 64);
  for (int64_t j = a.nb0; j < a.nb1; ++j) {
    for (int64_t k0 = 0; k0 < g.kp; k0 += kc) {
      const int64_t k1 = std::min(g.kp, k0 + kc);
      DequantNativePanelBf16Avx512(g, a.w + j * g.panel_bytes, k0, k1, buf);
      for (int m = 0; m < a.m; ++m) {
        const uint16_t* x =
            reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda) + k0;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < (k1 - k0) / 2; ++kk)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(buf + kk * 32),
                                 (__m512bh)Bcast32(x + 2 * kk));
        float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
        _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), acc));
      }
    }
  }
}

// ---- SiLU --------------------------------------------------------------------------
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 SiluMul16(__m512 g, __m512 u) {
  const __m512 e = Exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

void SiluMul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, SiluMul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  if (i < n) SiluMulScalar(g + i, u + i, n - i, out + i);
}

void SiluMulBf16(const float* g, const float* u, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = SiluMul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
  if (i < n) SiluMulBf16Scalar(g + i, u + i, n - i, out + i);
}

// ---- int8 quantization of activations ---------------------------------------------------
inline __m512 LoadBf16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

inline __mmask16 TailMask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

template <typename Load>
void QuantCore(Load load, int64_t n, int64_t kp, float inv, int8_t* q, int32_t* gsum, int group) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i gacc = _mm512_setzero_si512();
  for (int64_t i = 0; i < kp; i += 16) {
    __m512i v = _mm512_setzero_si512();
    if (i < n) {
      const __mmask16 k = TailMask(n - i);
      v = _mm512_maskz_mov_epi32(k, _mm512_cvtps_epi32(_mm512_mul_ps(load(i, k), vinv)));
      v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    }
    _mm_mask_storeu_epi8(q + i, TailMask(kp - i), _mm512_cvtepi32_epi8(v));
    if (gsum != nullptr) {
      gacc = _mm512_add_epi32(gacc, v);
      if ((i + 16) % group == 0) {
        gsum[i / group] = _mm512_reduce_add_epi32(gacc);
        gacc = _mm512_setzero_si512();
      }
    }
  }
}

// max_ps drops NaN operands: NaNs are counted apart (the row's scale, and
// so its output, is NaN as the scalar reference makes it).
void QuantBf16(const uint16_t* x, int64_t n, int64_t kp, int8_t* q, float* scale, int32_t* gsum,
               int group) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = LoadBf16(x + i, TailMask(n - i));
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m) / 127.0f;
  const float inv = Int8InvScale(s);
  *scale = s;
  QuantCore([&](int64_t i, __mmask16 k) { return LoadBf16(x + i, k); }, n, kp, inv, q, gsum, group);
}

float AmaxF32(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(TailMask(n - i), x + i);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m);
}

void QuantF32(const float* x, int64_t n, int64_t kp, float inv, int8_t* q, int32_t* gsum,
              int group) {
  QuantCore([&](int64_t i, __mmask16 k) { return _mm512_maskz_loadu_ps(k, x + i); }, n, kp, inv, q,
            gsum, group);
}

}  // namespace

void GemmBf16PanelsAvx512(const GemmArgs& a, const uint8_t* w, int64_t panel_bytes, int64_t kp) {
  const int64_t pf = a.tune().few.pf_bf16;
  ForBlocks(a, w, panel_bytes,
            [&](int m0, int mb, int nb, const uint8_t* const* panels, float* const* c) {
              const uint16_t* rows[4];
              for (int m = 0; m < mb; ++m)
                rows[m] = reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) +
                                                            (m0 + m) * a.lda);
#define CALL(M, N) Bf16Block<M, N>(panels, rows, kp, pf, c)
              HMOE_DISPATCH_MB_NB(mb, nb, CALL);
#undef CALL
            });
}

void DequantI4PanelBf16Avx512(const PackedGeom& g, const uint8_t* panel, int64_t k0, int64_t k1,
                              uint16_t* out) {
  const int64_t gb = g.i4_group_bytes();
  for (int64_t gi = k0 / g.group; gi < k1 / g.group; ++gi) {
    const uint8_t* gp = panel + gi * gb;
    const i4::GroupScales s = i4::LoadGroupScales(gp + int64_t{g.group} * 8);
    for (int64_t o = 0; o < g.group / 8; ++o)
      i4::DequantLine(gp + o * 64, s, out + ((gi * g.group - k0) / 2 + 4 * o) * 32);
  }
}

void DequantNativePanelBf16Avx512(const PackedGeom& g, const uint8_t* panel, int64_t k0, int64_t k1,
                                  uint16_t* out) {
  switch (g.format) {
    case WeightFormat::kMxfp4:
      return DequantNative<WeightFormat::kMxfp4>(g, panel, k0, k1, out);
    case WeightFormat::kInt4Bf16:
      return DequantNative<WeightFormat::kInt4Bf16>(g, panel, k0, k1, out);
    case WeightFormat::kFp8:
      return DequantNative<WeightFormat::kFp8>(g, panel, k0, k1, out);
    case WeightFormat::kMxfp8:
      return DequantNative<WeightFormat::kMxfp8>(g, panel, k0, k1, out);
    default:
      return;
  }
}

uint64_t StreamReadAvx512(const uint8_t* p, int64_t bytes) {
  // Four interleaved sequential streams (as a kernel task reads several
  // panels at once), two lines each per step: enough loads in flight.
  const int64_t q = bytes / 4 / 128 * 128;
  __m512i a[8];
  for (auto& v : a) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < q; i += 128) {
    for (int s = 0; s < 4; ++s) {
      a[2 * s] = _mm512_xor_si512(a[2 * s], _mm512_load_si512(p + s * q + i));
      a[2 * s + 1] = _mm512_xor_si512(a[2 * s + 1], _mm512_load_si512(p + s * q + i + 64));
    }
  }
  __m512i r = a[0];
  for (int s = 1; s < 8; ++s) r = _mm512_xor_si512(r, a[s]);
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(r));
}

void StoreRows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t n) {
  const bool stream = n % 16 == 0 && ldd % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  if (!stream) return StoreRowsScalar(src, lds, dst, ldd, rows, n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; i += 16)
      _mm512_stream_ps(dst + r * ldd + i, _mm512_loadu_ps(src + r * lds + i));
  _mm_sfence();  // streaming stores are weakly ordered: publish before the phase barrier
}

void PackTiledBlock(const uint8_t* const* rows, int64_t n, int64_t kbytes, uint8_t* block,
                    bool stream) {
  for (int64_t s = 0; s * 64 < kbytes; ++s) {
    const int64_t c = std::clamp<int64_t>(n - s * 64, 0, 64);
    const __mmask64 mask = c == 64 ? ~__mmask64{0} : (__mmask64{1} << c) - 1;
    for (int i = 0; i < 16; ++i) {
      const __m512i v = rows[i] == nullptr || c == 0
                            ? _mm512_setzero_si512()
                            : _mm512_maskz_loadu_epi8(mask, rows[i] + s * 64);
      if (stream)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(block + s * 1024 + i * 64), v);
      else
        _mm512_store_si512(block + s * 1024 + i * 64, v);
    }
  }
  if (stream) _mm_sfence();
}

void WeightedSum(const float* const* rows, const float* w, int n, int64_t len, float* out,
                 bool stream) {
  const bool nt = stream && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  int64_t i = 0;
  // 32 floats per step: two independent sums, n rows read side by side.
  for (; i + 32 <= len; i += 32) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const __m512 wj = _mm512_set1_ps(w[j]);
      s0 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(rows[j] + i), s0);
      s1 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(rows[j] + i + 16), s1);
    }
    if (nt) {
      _mm512_stream_ps(out + i, s0);
      _mm512_stream_ps(out + i + 16, s1);
    } else {
      _mm512_storeu_ps(out + i, s0);
      _mm512_storeu_ps(out + i + 16, s1);
    }
  }
  for (; i < len; i += 16) {
    const int64_t c = std::min<int64_t>(16, len - i);
    const __mmask16 m = static_cast<__mmask16>((1u << c) - 1);
    __m512 s0 = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j)
      s0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(m, rows[j] + i), s0);
    _mm512_mask_storeu_ps(out + i, m, s0);
  }
  if (nt) _mm_sfence();  // publish the streaming stores before the caller's barrier
}

const KernelSet& Avx512Kernels() {
  static const KernelSet k = [] {
    KernelSet s{GemmBf16,  GemmI8,  GemmI4I8, GemmI4Bf16, SiluMul,        SiluMulBf16,
                QuantBf16, AmaxF32, QuantF32, StoreRows,  PackTiledBlock, WeightedSum};
    s.native = GemmNative;
    s.native_bf16 = GemmNativeBf16;
    return s;
  }();
  return k;
}

}  // namespace hmoe::kern
