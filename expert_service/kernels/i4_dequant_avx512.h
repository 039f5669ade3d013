// Internal, AVX-512 only (include from files built with HMOE_AVX512_FLAGS):
// int4 weights (packed.h INT4 layout) to bf16 (packed.h BF16 layout), one
// int4 line at a time. One int4 line holds 8 consecutive k of a panel's 16
// channels; it becomes 4 bf16 lines (k pairs), 256 bytes.
// DequantI4PanelBf16Avx512 (whole groups) and the AMX int4 kernel's staged
// path (a few lines between tile products) share these.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace hmoe::kern::i4 {

// A group's 16 channel scales, spread to the two lane orders the
// conversion needs, and -8 * scale (the nibbles are q + 8).
struct GroupScales {
  __m512 s0, s1, n0, n1;
};

// The functions are static: each ISA object that includes this keeps its own
// copy of whatever the compiler does not inline (a sanitized clang build left
// DequantLine's lambda out of line), never a weak one the linker could share
// across objects (tests/kernels/isa_objects_check.sh).

// `scales`: the group's 64-byte f32 scale[16] (after its G / 8 lines).
static inline GroupScales LoadGroupScales(const uint8_t* scales) {
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi =
      _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const __m512 sc = _mm512_loadu_ps(scales);
  GroupScales s;
  s.s0 = _mm512_permutexvar_ps(dup_lo, sc);
  s.s1 = _mm512_permutexvar_ps(dup_hi, sc);
  s.n0 = _mm512_mul_ps(s.s0, _mm512_set1_ps(-8.0f));
  s.n1 = _mm512_mul_ps(s.s1, _mm512_set1_ps(-8.0f));
  return s;
}

// One int4 line (64-byte aligned) -> 4 bf16 lines at dst (64-byte aligned):
// bf16(q * scale) for k pairs (k0, k0+1) .. (k0+6, k0+7).
static inline void DequantLine(const uint8_t* line, const GroupScales& s, uint16_t* dst) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i wsplit =
      _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                       22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i v = _mm512_load_si512(line);
  const __m512i halves[2] = {_mm512_and_si512(v, low4),
                             _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
  for (int h = 0; h < 2; ++h) {
    const __m512i p = _mm512_permutexvar_epi16(wsplit, halves[h]);  // [pair0: 32 B][pair1: 32 B]
    // Lanes 0-1 are pair 0, lanes 2-3 pair 1 (immediates: no loop).
    const auto store_pair = [&](__m128i b0, __m128i b1, int pr) {
      const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b0)), s.s0, s.n0);
      const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b1)), s.s1, s.n1);
      _mm512_store_si512(dst + (2 * h + pr) * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    };
    store_pair(_mm512_extracti32x4_epi32(p, 0), _mm512_extracti32x4_epi32(p, 1), 0);
    store_pair(_mm512_extracti32x4_epi32(p, 2), _mm512_extracti32x4_epi32(p, 3), 1);
  }
}

}  // namespace hmoe::kern::i4
