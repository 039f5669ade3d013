// The KV cache's stored element types and their exact encodings, shared by
// the reference backend (gpu_worker/cpu/) and the CUDA kernels (header-only,
// C++17, host and device): both round a cache row identically.
//
//   - kBf16: f32 -> bf16 round to nearest, ties to even (dtype.h's F32ToBf16).
//   - kFp8: e4m3fn with one f32 scale per part of a row: scale = amax / 448
//     (amax = max |x| over the part); each x is stored as e4m3(x / scale),
//     rounded to nearest even and saturated to +-448 (dtype.h's
//     F32ToFp8E4M3); a part whose scale is 0 (amax 0, or amax / 448
//     underflows) stores zeros. Read back as e4m3 value * scale.
// Cache values are finite (NaN and infinities are not part of the contract).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HMOE_KV_HD __host__ __device__ __forceinline__
#else
#define HMOE_KV_HD inline
#endif

namespace hmoe {

enum class KvElem : uint8_t { kF32, kBf16, kFp8 };

// Bytes of one stored element.
constexpr int KvElemBytes(KvElem e) { return e == KvElem::kF32 ? 4 : e == KvElem::kBf16 ? 2 : 1; }

// The largest finite e4m3fn value.
constexpr float kKvFp8Max = 448.0f;

HMOE_KV_HD uint32_t KvF32Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

HMOE_KV_HD float KvBitsF32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- bf16 -----------------------------------------------------------------------
HMOE_KV_HD uint16_t KvToBf16(float f) {
  uint32_t u = KvF32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
HMOE_KV_HD float KvFromBf16(uint16_t h) { return KvBitsF32(static_cast<uint32_t>(h) << 16); }

// ---- e4m3fn ---------------------------------------------------------------------
// f32 -> e4m3fn, round to nearest even, saturating (infinities too) to +-448;
// NaN -> 0x7f (with the sign).
HMOE_KV_HD uint8_t KvToE4m3(float f) {
  const uint32_t u = KvF32Bits(f);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448
  const uint32_t e = a >> 23;                                       // biased f32 exponent
  if (e >= 121) {  // >= 2^-6: a normal e4m3 value; round the mantissa to 3 bits
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);  // may carry into the exponent
    return static_cast<uint8_t>(sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
  }
  // Below 2^-6: multiples of 2^-9 (code m = m * 2^-9; m = 8 is the smallest
  // normal, code 0x08). a = M * 2^(e - 150) with the implicit bit in M.
  if (e == 0) return static_cast<uint8_t>(sign);  // f32 subnormal: far below 2^-10
  const uint32_t M = (a & 0x7fffffu) | 0x800000u;
  const uint32_t s = 141u - e;  // a / 2^-9 = M / 2^s, s >= 21
  if (s >= 25) return static_cast<uint8_t>(sign);
  const uint32_t q = (M + (1u << (s - 1)) - 1u + ((M >> s) & 1u)) >> s;
  return static_cast<uint8_t>(sign | q);
}

HMOE_KV_HD float KvFromE4m3(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 15u, m = v & 7u;
  if (e == 15 && m == 7) return KvBitsF32(sign | 0x7fc00000u);
  if (e == 0) return KvBitsF32(sign | KvF32Bits(static_cast<float>(m) * 0.001953125f));  // 2^-9
  return KvBitsF32(sign | ((e + 120u) << 23) | (m << 20));
}

// The scale of a part whose largest magnitude is `amax`.
HMOE_KV_HD float KvFp8Scale(float amax) { return amax / kKvFp8Max; }
// The code of x in a part of scale `scale`.
HMOE_KV_HD uint8_t KvFp8Code(float x, float scale) {
  return scale > 0.0f ? KvToE4m3(x / scale) : uint8_t{0};
}
HMOE_KV_HD float KvFp8Value(uint8_t code, float scale) { return KvFromE4m3(code) * scale; }

// Host reference: encodes x[0, n) as one fp8 part into q, returns its scale.
inline float KvEncodeFp8Part(const float* x, int64_t n, uint8_t* q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = x[i] < 0.0f ? -x[i] : x[i];
    amax = a > amax ? a : amax;
  }
  const float scale = KvFp8Scale(amax);
  for (int64_t i = 0; i < n; ++i) q[i] = KvFp8Code(x[i], scale);
  return scale;
}

// Host: rounds x[0, n) in place to what a cache of element type `e` stores
// and reads back, x being one part (kFp8's scale unit).
inline void KvRoundPart(KvElem e, float* x, int64_t n) {
  if (e == KvElem::kBf16) {
    for (int64_t i = 0; i < n; ++i) x[i] = KvFromBf16(KvToBf16(x[i]));
  } else if (e == KvElem::kFp8) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float a = x[i] < 0.0f ? -x[i] : x[i];
      amax = a > amax ? a : amax;
    }
    const float scale = KvFp8Scale(amax);
    for (int64_t i = 0; i < n; ++i) x[i] = KvFp8Value(KvFp8Code(x[i], scale), scale);
  }
}

}  // namespace hmoe
