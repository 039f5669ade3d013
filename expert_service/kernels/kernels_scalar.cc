// Plain C++ kernels over the packed layout: the fallback for CPUs without
// AVX2, and a readable statement of what each kernel computes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/dtype.h"
#include "expert_service/kernels/gemm.h"

namespace hmoe::kern {
namespace {

void GemmBf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  for (int m = 0; m < a.m; ++m) {
    const uint16_t* x =
        reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda);
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(a.w + j * g.panel_bytes);
      float acc[16] = {};
      for (int64_t kk = 0; kk < g.kp / 2; ++kk) {
        const float x0 = Bf16ToF32(x[2 * kk]), x1 = Bf16ToF32(x[2 * kk + 1]);
        for (int c = 0; c < 16; ++c)
          acc[c] += x0 * Bf16ToF32(p[kk * 32 + 2 * c]) + x1 * Bf16ToF32(p[kk * 32 + 2 * c + 1]);
      }
      std::memcpy(a.c + m * a.ldc + (j - a.nb0) * 16, acc, sizeof(acc));
    }
  }
}

void GemmI8(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  for (int m = 0; m < a.m; ++m) {
    const int8_t* x = static_cast<const int8_t*>(a.a) + m * a.lda;
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      const int8_t* p = reinterpret_cast<const int8_t*>(panel);
      const float* sc = reinterpret_cast<const float*>(panel + g.i8_scale_offset());
      int32_t acc[16] = {};
      for (int64_t q = 0; q < g.kp / 4; ++q)
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 4; ++i) acc[c] += x[4 * q + i] * p[q * 64 + 4 * c + i];
      float* out = a.c + m * a.ldc + (j - a.nb0) * 16;
      for (int c = 0; c < 16; ++c) out[c] = static_cast<float>(acc[c]) * a.a_scale[m] * sc[c];
    }
  }
}

void GemmI4I8(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  const int64_t groups = g.kp / g.group;
  for (int m = 0; m < a.m; ++m) {
    const int8_t* x = static_cast<const int8_t*>(a.a) + m * a.lda;
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      float accf[16] = {};
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* gp = panel + gi * g.i4_group_bytes();
        const float* sc = reinterpret_cast<const float*>(gp + int64_t{g.group} * 8);
        int32_t acc[16] = {};
        for (int64_t o = 0; o < g.group / 8; ++o) {
          const int64_t k0 = gi * g.group + 8 * o;
          for (int c = 0; c < 16; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t b = gp[o * 64 + 4 * c + i];
              acc[c] += x[k0 + i] * ((b & 15) - 8) + x[k0 + 4 + i] * ((b >> 4) - 8);
            }
        }
        for (int c = 0; c < 16; ++c) accf[c] += static_cast<float>(acc[c]) * sc[c];
      }
      float* out = a.c + m * a.ldc + (j - a.nb0) * 16;
      for (int c = 0; c < 16; ++c) out[c] = accf[c] * a.a_scale[m];
    }
  }
}

void GemmI4Bf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  const int64_t groups = g.kp / g.group;
  for (int m = 0; m < a.m; ++m) {
    const uint16_t* x =
        reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda);
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      float acc[16] = {};
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* gp = panel + gi * g.i4_group_bytes();
        const float* sc = reinterpret_cast<const float*>(gp + int64_t{g.group} * 8);
        for (int64_t o = 0; o < g.group / 8; ++o) {
          const int64_t k0 = gi * g.group + 8 * o;
          for (int c = 0; c < 16; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t b = gp[o * 64 + 4 * c + i];
              const float w0 = Bf16ToF32(F32ToBf16(static_cast<float>((b & 15) - 8) * sc[c]));
              const float w1 = Bf16ToF32(F32ToBf16(static_cast<float>((b >> 4) - 8) * sc[c]));
              acc[c] += Bf16ToF32(x[k0 + i]) * w0 + Bf16ToF32(x[k0 + 4 + i]) * w1;
            }
        }
      }
      std::memcpy(a.c + m * a.ldc + (j - a.nb0) * 16, acc, sizeof(acc));
    }
  }
}

// ---- native formats (packed.h native layout) ---------------------------------------
// The exact value of a code.
float NativeValue(WeightFormat f, uint8_t code) {
  switch (f) {
    case WeightFormat::kMxfp4:
      return E2M1ToF32(code);
    case WeightFormat::kInt4Bf16:
      return static_cast<float>((code ^ 8) - 8);
    default:
      return Fp8E4M3ToF32(code);
  }
}
// The code of panel-local (c, k).
uint8_t NativeCode(const PackedGeom& g, const uint8_t* panel, int c, int64_t k) {
  const uint8_t* sb = panel + (k / g.sb_k) * g.sb_bytes;
  const int64_t kk = k % g.sb_k;
  if (Traits(g.format).bits == 8) return sb[(kk / 4) * 64 + 16 * (kk % 4) + c];
  const uint8_t b = sb[(kk / 8) * 64 + 4 * c + (kk & 3)];
  return static_cast<uint8_t>((kk & 4) ? b >> 4 : b & 15);
}
// The f32 scale of panel-local group gi (k / group) of channel c.
float NativeScale(const PackedGeom& g, const uint8_t* panel, int c, int64_t gi) {
  if (g.format == WeightFormat::kFp8) {
    float v;
    std::memcpy(&v, panel + g.fp8_scale_offset + gi * 4, 4);
    return v;
  }
  const int64_t per = g.sb_k / g.group;
  const uint8_t* s = panel + (gi / per) * g.sb_bytes + g.sb_code_bytes +
                     ((gi % per) * 16 + c) * ScaleBytes(g.format);
  if (g.format == WeightFormat::kInt4Bf16) {
    uint16_t v;
    std::memcpy(&v, s, 2);
    return Bf16ToF32(v);
  }
  return std::ldexp(1.0f, static_cast<int>(*s) - 127);
}

void GemmNative(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  for (int m = 0; m < a.m; ++m) {
    const uint16_t* x =
        reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda);
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      float acc[16] = {};
      for (int64_t gi = 0; gi < g.kp / g.group; ++gi) {
        float gacc[16] = {};
        for (int64_t k = gi * g.group; k < (gi + 1) * g.group; ++k) {
          const float xv = Bf16ToF32(x[k]);
          for (int c = 0; c < 16; ++c)
            gacc[c] += xv * NativeValue(g.format, NativeCode(g, panel, c, k));
        }
        for (int c = 0; c < 16; ++c) acc[c] += gacc[c] * NativeScale(g, panel, c, gi);
      }
      std::memcpy(a.c + m * a.ldc + (j - a.nb0) * 16, acc, sizeof(acc));
    }
  }
}

void GemmNativeBf16(const GemmArgs& a) {
  const PackedGeom& g = *a.g;
  for (int m = 0; m < a.m; ++m) {
    const uint16_t* x =
        reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(a.a) + m * a.lda);
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const uint8_t* panel = a.w + j * g.panel_bytes;
      float acc[16] = {};
      for (int64_t k = 0; k < g.kp; ++k) {
        const float xv = Bf16ToF32(x[k]);
        for (int c = 0; c < 16; ++c) {
          const float w = NativeValue(g.format, NativeCode(g, panel, c, k)) *
                          NativeScale(g, panel, c, k / g.group);
          acc[c] += xv * Bf16ToF32(F32ToBf16(w));
        }
      }
      std::memcpy(a.c + m * a.ldc + (j - a.nb0) * 16, acc, sizeof(acc));
    }
  }
}

inline float Silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

void SiluMulScalar(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Silu(g[i]) * u[i];
}
void SiluMulBf16Scalar(const float* g, const float* u, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = F32ToBf16(Silu(g[i]) * u[i]);
}

// x * inv rounded and clamped to [-127, 127]; NaN (whose row's scale is
// NaN: the row's output is NaN whatever q holds) as 0, not cast undefined.
inline int8_t QuantOne(float x, float inv) {
  const float v = std::nearbyint(x * inv);
  return std::isnan(v) ? int8_t{0} : static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
}

void QuantF32Scalar(const float* x, int64_t n, int64_t kp, float inv, int8_t* q, int32_t* gsum,
                    int group) {
  for (int64_t i = 0; i < n; ++i) q[i] = QuantOne(x[i], inv);
  for (int64_t i = n; i < kp; ++i) q[i] = 0;
  if (gsum != nullptr)
    for (int64_t g = 0; g < kp / group; ++g) {
      int32_t s = 0;
      for (int64_t i = 0; i < group; ++i) s += q[g * group + i];
      gsum[g] = s;
    }
}

float AmaxF32Scalar(const float* x, int64_t n) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, std::fabs(x[i]));
    nan |= std::isnan(x[i]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

void QuantBf16Scalar(const uint16_t* x, int64_t n, int64_t kp, int8_t* q, float* scale,
                     int32_t* gsum, int group) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Bf16ToF32(x[i]);
    m = std::max(m, std::fabs(v));
    nan |= std::isnan(v);
  }
  // A NaN activation makes the row's scale NaN, so its output is NaN as
  // with bf16 weights (a max that skipped it gave a finite wrong answer).
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : m / 127.0f;
  const float inv = Int8InvScale(s);
  *scale = s;
  for (int64_t i = 0; i < n; ++i) q[i] = QuantOne(Bf16ToF32(x[i]), inv);
  for (int64_t i = n; i < kp; ++i) q[i] = 0;
  if (gsum != nullptr)
    for (int64_t g = 0; g < kp / group; ++g) {
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) sum += q[g * group + i];
      gsum[g] = sum;
    }
}

void StoreRowsScalar(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                     int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * ldd, src + r * lds, static_cast<size_t>(n) * sizeof(float));
}

void PackTiledBlockScalar(const uint8_t* const* rows, int64_t n, int64_t kbytes, uint8_t* block,
                          bool /*stream*/) {
  for (int64_t s = 0; s * 64 < kbytes; ++s)
    for (int i = 0; i < 16; ++i) {
      uint8_t* d = block + s * 1024 + i * 64;
      const int64_t c = rows[i] == nullptr ? 0 : std::clamp<int64_t>(n - s * 64, 0, 64);
      if (c > 0) std::memcpy(d, rows[i] + s * 64, static_cast<size_t>(c));
      if (c < 64) std::memset(d + c, 0, static_cast<size_t>(64 - c));
    }
}

void WeightedSumScalar(const float* const* rows, const float* w, int n, int64_t len, float* out,
                       bool /*stream*/) {
  for (int64_t i = 0; i < len; ++i) {
    float s = 0.0f;
    for (int j = 0; j < n; ++j) s = std::fma(w[j], rows[j][i], s);
    out[i] = s;
  }
}

const KernelSet& ScalarKernels() {
  static const KernelSet k = [] {
    KernelSet s{GemmBf16,
                GemmI8,
                GemmI4I8,
                GemmI4Bf16,
                SiluMulScalar,
                SiluMulBf16Scalar,
                QuantBf16Scalar,
                AmaxF32Scalar,
                QuantF32Scalar,
                StoreRowsScalar,
                PackTiledBlockScalar,
                WeightedSumScalar};
    s.native = GemmNative;
    s.native_bf16 = GemmNativeBf16;
    return s;
  }();
  return k;
}

}  // namespace hmoe::kern
