// Element types, their safetensors names, and exact scalar conversions.
//
// Conversions here are the reference semantics every kernel must match:
//   - f32 -> bf16 / f16: round to nearest, ties to even; NaN stays NaN.
//   - fp8 e4m3 ("e4m3fn", as in DeepSeek-V3): bias 7, no infinities,
//     S.1111.111 is NaN, max finite 448. f32 -> e4m3 rounds to nearest even
//     and saturates to +-448.
//   - int4 is packed two per byte, element 2i in the low nibble, 2i+1 in the
//     high nibble, two's complement in [-8, 7].
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace hmoe {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kI4,  // packed int4 (ours; not a safetensors dtype)
  kU16,
  kU32,
  kU64,
  kF8E8M0,  // OCP e8m0 scales (MX formats): 2^(e - 127), 0xFF NaN
};

// Bits per element (4 for kI4, 8*bytes otherwise).
int DTypeBits(DType t);
// Bytes for `n` elements, rounding packed types up to whole bytes.
int64_t DTypeBytes(DType t, int64_t n);
// The safetensors spelling ("BF16", "F8_E4M3", ...); "I4" for kI4.
const char* DTypeName(DType t);
// Parses a safetensors dtype name; nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);

inline uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- bf16 ---------------------------------------------------------------------
inline float Bf16ToF32(uint16_t h) { return BitsF32(static_cast<uint32_t>(h) << 16); }
inline uint16_t F32ToBf16(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- f16 ----------------------------------------------------------------------
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// ---- fp8 ----------------------------------------------------------------------
float Fp8E4M3ToF32(uint8_t v);
uint8_t F32ToFp8E4M3(float f);
float Fp8E5M2ToF32(uint8_t v);

// ---- OCP Microscaling (MX) elements and scales -----------------------------------
// e2m1 (fp4): code bit 3 is the sign, the low 3 bits index {0, 0.5, 1, 1.5,
// 2, 3, 4, 6}. f32 -> e2m1 rounds to nearest, ties to the even code, and
// saturates to +-6; NaN is refused by the callers (e2m1 has none).
float E2M1ToF32(uint8_t code);
uint8_t F32ToE2M1(float f);
// e8m0: 2^(e - 127) for e in [0, 254]; 0xFF is NaN.
float E8M0ToF32(uint8_t e);

// Dequantizes a DeepSeek-V3 block-scaled fp8 weight: w[r][c] = fp8[r][c] *
// scale_inv[r / block][c / block], scale_inv being [ceil(rows/block), ceil(cols/block)].
void DequantFp8BlockToF32(const uint8_t* w, int64_t rows, int64_t cols, const float* scale_inv,
                          int64_t block, float* out);

// ---- int4 ---------------------------------------------------------------------
inline int8_t UnpackI4(const uint8_t* p, int64_t i) {
  uint8_t b = p[i >> 1];
  int v = (i & 1) ? (b >> 4) : (b & 0xf);
  return static_cast<int8_t>(v >= 8 ? v - 16 : v);
}
inline void PackI4(uint8_t* p, int64_t i, int v) {
  uint8_t n = static_cast<uint8_t>(v & 0xf);
  uint8_t& b = p[i >> 1];
  b = (i & 1) ? static_cast<uint8_t>((b & 0x0f) | (n << 4)) : static_cast<uint8_t>((b & 0xf0) | n);
}

// ---- symmetric quantization references ----------------------------------------
// Inputs must be finite (the packer refuses other weights). A row or group
// whose scale would be under FLT_MIN (1/scale overflows) gets scale 0 and
// zeros.
// int8 per row (output channel): scale[r] = max|w[r]| / 127, q = round(w / scale).
void QuantizeI8PerRow(const float* w, int64_t rows, int64_t cols, int8_t* q, float* scale);
// int4 per group of `group` along each row (cols % group == 0):
// scale = max|w| / 7, q = clamp(round(w / scale), -8, 7); q packed row-major.
void QuantizeI4PerGroup(const float* w, int64_t rows, int64_t cols, int64_t group, uint8_t* q,
                        float* scale);

}  // namespace hmoe
