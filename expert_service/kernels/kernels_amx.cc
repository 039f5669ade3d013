// AMX kernels (tdpbf16ps, tdpbssd) for experts with many tokens. Compiled
// with -mamx-{tile,bf16,int8} (+AVX-512 for epilogues); entered only after
// dispatch has seen AMX in cpuid and been granted XTILEDATA by the kernel.
//
// Blocking: C = 2x2 tiles (32 rows x 2 panels), A = 2 tiles, B = 2 tiles.
// K is walked in chunks (1 KiB of each A row) so the chunk of A (rows x 1 KiB)
// stays in L2 across the task's panel pairs and the B chunk (2 x 16 KiB) in
// L1 across row pairs; partial C lives in the caller's c buffer between chunks.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "expert_service/kernels/gemm.h"

namespace hmoe::kern {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

enum class Kind { kBf16, kInt8, kInt4Bf16 };

// Bytes of each A row per K chunk (partial C is stored and reloaded between
// chunks). 1024 measured best on Emerald Rapids (49% vs 31% of the AMX BF16
// peak at 512). HMOE_AMX_KC_BYTES = 512 | 1024 | 2048 | 4096 overrides.
int64_t ChunkBytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("HMOE_AMX_KC_BYTES");
    const int64_t b = e != nullptr ? std::atoll(e) : 1024;
    return (b == 512 || b == 2048 || b == 4096) ? b : int64_t{1024};
  }();
  return v;
}

template <Kind kKind>
void AmxGemm(const GemmArgs& a) {
  constexpr bool kI8 = kKind == Kind::kInt8;
  constexpr int64_t kStepK = kI8 ? 64 : 32;  // k per tile
  // k per chunk (a multiple of 128); int4's bf16 staging holds at most 2048 k per panel.
  const int64_t kChunkK =
      std::min<int64_t>(ChunkBytes() / (kI8 ? 1 : 2), kKind == Kind::kInt4Bf16 ? 2048 : 1 << 30);
  const PackedGeom& g = *a.g;
  ConfigureTiles();
  const int mp = (a.m + 31) / 32 * 32;
  const int64_t ldc_b = a.ldc * 4;
  const uint8_t* A = static_cast<const uint8_t*>(a.a);
  uint8_t* buf0 = a.scratch;
  uint8_t* buf1 =
      a.scratch + kGemmScratchBytes / 2;  // each half holds 2048 k of one panel  // bf16 chunk of
                                          // one panel: kChunkK/2 lines x 64 B
  for (int64_t kc0 = 0; kc0 < g.kp; kc0 += kChunkK) {
    const int64_t kc1 = std::min(g.kp, kc0 + kChunkK);
    for (int64_t j = a.nb0; j < a.nb1; j += 2) {
      const bool two = j + 1 < a.nb1;
      const uint8_t* B0;
      const uint8_t* B1;
      if constexpr (kKind == Kind::kInt4Bf16) {
        DequantI4PanelBf16Avx512(g, a.w + j * g.panel_bytes, kc0, kc1,
                                 reinterpret_cast<uint16_t*>(buf0));
        if (two)
          DequantI4PanelBf16Avx512(g, a.w + (j + 1) * g.panel_bytes, kc0, kc1,
                                   reinterpret_cast<uint16_t*>(buf1));
        B0 = buf0;
        B1 = buf1;
      } else {
        B0 = a.w + j * g.panel_bytes + kc0 / kStepK * 1024;
        B1 = B0 + g.panel_bytes;
      }
      for (int m0 = 0; m0 < mp; m0 += 32) {
        uint8_t* C00 = reinterpret_cast<uint8_t*>(a.c + m0 * a.ldc + (j - a.nb0) * 16);
        uint8_t* C10 = C00 + 16 * ldc_b;
        if (kc0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, C00, ldc_b);
          _tile_loadd(2, C10, ldc_b);
          if (two) {
            _tile_loadd(1, C00 + 64, ldc_b);
            _tile_loadd(3, C10 + 64, ldc_b);
          }
        }
        const uint8_t* a0 = A + m0 * a.lda + kc0 * (kI8 ? 1 : 2);
        const uint8_t* a1 = a0 + 16 * a.lda;
        const int64_t steps = (kc1 - kc0) / kStepK;
        if (two) {
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, a0 + s * 64, a.lda);
            _tile_loadd(6, B0 + s * 1024, 64);
            if constexpr (kI8)
              _tile_dpbssd(0, 4, 6);
            else
              _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, B1 + s * 1024, 64);
            if constexpr (kI8)
              _tile_dpbssd(1, 4, 7);
            else
              _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + s * 64, a.lda);
            if constexpr (kI8) {
              _tile_dpbssd(2, 5, 6);
              _tile_dpbssd(3, 5, 7);
            } else {
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(1, C00 + 64, ldc_b);
          _tile_stored(3, C10 + 64, ldc_b);
        } else {
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, a0 + s * 64, a.lda);
            _tile_loadd(6, B0 + s * 1024, 64);
            _tile_loadd(5, a1 + s * 64, a.lda);
            if constexpr (kI8) {
              _tile_dpbssd(0, 4, 6);
              _tile_dpbssd(2, 5, 6);
            } else {
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(2, 5, 6);
            }
          }
        }
        _tile_stored(0, C00, ldc_b);
        _tile_stored(2, C10, ldc_b);
      }
    }
  }
  if constexpr (kI8) {
    for (int64_t j = a.nb0; j < a.nb1; ++j) {
      const __m512 sc = _mm512_loadu_ps(a.w + j * g.panel_bytes + g.i8_scale_offset());
      for (int m = 0; m < a.m; ++m) {
        float* c = a.c + m * a.ldc + (j - a.nb0) * 16;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c));
        _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(a.a_scale[m])), sc));
      }
    }
  }
}

}  // namespace

void AmxPeakLoop(int64_t iters, bool int8) {
  alignas(64) static const uint8_t zeros[1024] = {};
  ConfigureTiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  if (int8) {
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
      _tile_dpbssd(0, 5, 7);
      _tile_dpbssd(1, 5, 6);
      _tile_dpbssd(2, 4, 7);
      _tile_dpbssd(3, 4, 6);
    }
  } else {
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      _tile_dpbf16ps(0, 5, 7);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) static thread_local uint8_t sink[1024];
  _tile_stored(0, sink, 64);
  _tile_release();
}

const KernelSet& AmxKernels() {
  static const KernelSet k = [] {
    KernelSet s = Avx512Kernels();
    s.bf16 = AmxGemm<Kind::kBf16>;
    s.i8 = AmxGemm<Kind::kInt8>;
    s.i4_bf16 = AmxGemm<Kind::kInt4Bf16>;
    return s;
  }();
  return k;
}

}  // namespace hmoe::kern
