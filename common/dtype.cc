#include "common/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace hmoe {

int DTypeBits(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kI64:
    case DType::kU64:
      return 64;
    case DType::kF32:
    case DType::kI32:
    case DType::kU32:
      return 32;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
    case DType::kU16:
      return 16;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 8;
    case DType::kI4:
      return 4;
  }
  return 0;
}

int64_t DTypeBytes(DType t, int64_t n) { return (n * DTypeBits(t) + 7) / 8; }

namespace {
struct NameEntry {
  DType type;
  std::string_view name;
};
constexpr NameEntry kNames[] = {
    {DType::kF64, "F64"},        {DType::kF32, "F32"},        {DType::kF16, "F16"},
    {DType::kBF16, "BF16"},      {DType::kF8E4M3, "F8_E4M3"}, {DType::kF8E5M2, "F8_E5M2"},
    {DType::kI64, "I64"},        {DType::kI32, "I32"},        {DType::kI16, "I16"},
    {DType::kI8, "I8"},          {DType::kU8, "U8"},          {DType::kBool, "BOOL"},
    {DType::kU16, "U16"},        {DType::kU32, "U32"},        {DType::kU64, "U64"},
    {DType::kF8E8M0, "F8_E8M0"}, {DType::kI4, "I4"},
};
}  // namespace

const char* DTypeName(DType t) {
  for (const auto& e : kNames)
    if (e.type == t) return e.name.data();
  return "?";
}

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& e : kNames)
    if (e.name == name && e.type != DType::kI4) return e.type;
  return std::nullopt;
}

float F16ToF32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return BitsF32(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    // subnormal: man * 2^-24 is exact in f32
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return BitsF32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t F32ToF16(float f) {
  uint32_t u = F32Bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ff));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {
    // result is subnormal (or zero): value / 2^-24 rounded to nearest even
    float v = BitsF32(a);
    float q = std::nearbyint(std::ldexp(v, 24));  // default rounding mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  return static_cast<uint16_t>(sign | (((r >> 23) - 112) << 10) | ((r >> 13) & 0x3ff));
}

float Fp8E4M3ToF32(uint8_t v) {
  float sign = (v & 0x80) ? -1.0f : 1.0f;
  int exp = (v >> 3) & 0xf;
  int man = v & 0x7;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);  // 2^-6 * man/8
  return sign * std::ldexp(1.0f + man / 8.0f, exp - 7);
}

float E2M1ToF32(uint8_t code) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMag[code & 7];
  return (code & 8) ? -m : m;
}

uint8_t F32ToE2M1(float f) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const uint8_t sign = std::signbit(f) ? 8 : 0;
  const float a = std::fabs(f);
  uint8_t best = 7;  // saturates: everything from 5 up that is not nearer 4
  for (uint8_t i = 0; i < 7; ++i) {
    const float mid = 0.5f * (kMag[i] + kMag[i + 1]);
    if (a < mid || (a == mid && (i & 1) == 0)) {
      best = i;
      break;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

float E8M0ToF32(uint8_t e) {
  if (e == 0xFF) return std::nanf("");
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

uint8_t F32ToFp8E4M3(float f) {
  if (std::isnan(f)) return 0x7f;
  uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // saturate
  // Find the code whose value is nearest, ties to even mantissa, by scaling
  // into the target binade and rounding with nearbyint (ties to even).
  int e;
  std::frexp(a, &e);       // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;         // a in [2^exp, 2^(exp+1))
  if (exp < -6) exp = -6;  // subnormal range shares the 2^-6 binade's step
  float step = std::ldexp(1.0f, exp - 3);
  float q = std::nearbyint(a / step);  // multiple of step; may carry into next binade
  float r = q * step;
  if (r == 0.0f) return sign;
  int re;
  std::frexp(r, &re);
  int rexp = re - 1;
  if (rexp < -6) return static_cast<uint8_t>(sign | static_cast<uint8_t>(r / std::ldexp(1.0f, -9)));
  int man = static_cast<int>(r / std::ldexp(1.0f, rexp - 3)) - 8;
  return static_cast<uint8_t>(sign | ((rexp + 7) << 3) | man);
}

float Fp8E5M2ToF32(uint8_t v) { return F16ToF32(static_cast<uint16_t>(v) << 8); }

void DequantFp8BlockToF32(const uint8_t* w, int64_t rows, int64_t cols, const float* scale_inv,
                          int64_t block, float* out) {
  const int64_t scale_cols = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / block) * scale_cols;
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = Fp8E4M3ToF32(w[r * cols + c]) * srow[c / block];
  }
}

void QuantizeI8PerRow(const float* w, int64_t rows, int64_t cols, int8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
    // A row below FLT_MIN * 127 quantizes to zeros (1/s would overflow).
    float s = amax / 127.0f;
    if (!(s >= std::numeric_limits<float>::min())) s = 0.0f;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    scale[r] = s;
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] =
          static_cast<int8_t>(std::clamp(std::nearbyint(row[c] * inv), -127.0f, 127.0f));
  }
}

void QuantizeI4PerGroup(const float* w, int64_t rows, int64_t cols, int64_t group, uint8_t* q,
                        float* scale) {
  const int64_t groups = cols / group;
  std::memset(q, 0, static_cast<size_t>(DTypeBytes(DType::kI4, rows * cols)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = w + r * cols + g * group;
      float amax = 0.0f;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[i]));
      float s = amax / 7.0f;  // a group below FLT_MIN * 7: zeros, as above
      if (!(s >= std::numeric_limits<float>::min())) s = 0.0f;
      const float inv = s > 0.0f ? 1.0f / s : 0.0f;
      scale[r * groups + g] = s;
      for (int64_t i = 0; i < group; ++i) {
        int v = static_cast<int>(std::clamp(std::nearbyint(x[i] * inv), -8.0f, 7.0f));
        PackI4(q, r * cols + g * group + i, v);
      }
    }
  }
}

}  // namespace hmoe
