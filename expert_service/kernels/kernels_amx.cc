// AMX kernels (tdpbf16ps, tdpbssd) for experts with many tokens. Compiled
// with -mamx-{tile,bf16,int8} (+AVX-512 for epilogues); entered only after
// dispatch has seen AMX in cpuid and been granted XTILEDATA by the kernel.
//
// Blocking: C = 2x2 tiles (32 rows x 2 panels), A = 2 tiles, B = 2 tiles:
// one tile load per tile product; each k step issues its four loads, then
// its four products. A last row pair with at most 16 real rows runs as one
// row block (AmxTuning::tail16), an odd last panel as one panel. K is walked
// in chunks (1 KiB of each row by default); partial C is stored to the
// caller's c buffer between chunks. Inside a chunk the default order (1) runs
// row pairs outer, panel pairs inner: the row pair's A chunk (32 KiB) is
// reused across the task's panels from L1, and the B chunk of the task's
// panels across row pairs from L2; B tiles are loaded with tileloaddt1 so
// they do not evict A. Meanwhile the next chunk's B is prefetched into L2 a
// few lines per k step, so tile loads do not wait on DRAM.
// A call of at most AmxTuning::order0_rows rows (32: one row pair) runs
// order 0 instead: the blocks run in the same sequence, but A is the
// operand loaded with tileloaddt1 and the prefetch brings the next panel
// pair's B chunk, a few lines per k step, not the next K chunk's B of all
// the task's panels; the caller's next task (GemmArgs::next_w) is not
// prefetched there.
// int4 weights (AmxTuning::i4_stage) run order 1 over bf16 copies of the
// task's panels: one K chunk of them in half of the scratch (the layout of
// bf16 panels cut to that chunk), the next chunk dequantized into the other
// half one int4 line (four bf16 lines) per few k steps of the current one,
// with its int4 lines prefetched into L2 16 lines ahead. Unstaged (the knob
// off, calls of at most order0_rows rows, or a scratch too small) int4 runs
// order 0, each panel pair dequantized just before its blocks.
// The other knobs (tuning.h) exist for benchmarks; the defaults are the best
// of same-machine sweeps recorded in bench/results/README.md (hmoe-bench-moe
// --tune compares them in one run).
//
// A is read either row-major (stride lda) or in the tile layout (GemmArgs::
// a_tiled), where every A tile is one contiguous KiB.
//
// The kernel is written once against a tile-machine policy: HwTiles issues
// the AMX instructions; EmuTiles is a plain-C++ model of the same eight tile
// registers (tdpbf16ps / tdpbssd semantics) so CI machines without AMX run
// this exact code path (blocking, layouts, K chunks) against the reference.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/dtype.h"
#include "expert_service/kernels/amx_tile_config.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/i4_dequant_avx512.h"

namespace hmoe::kern {
namespace {

// Every tile is 16 rows x 64 bytes. GCC's tile intrinsics paste the register
// number into the asm text, so each (register) use is spelled out below.
struct HwTiles {
  static void Configure() { _tile_loadconfig(&kTileConfig); }
  template <int T>
  static void Zero();
  template <int T>
  static void Load(const void* p, int64_t stride);
  template <int T>
  static void LoadStream(const void* p, int64_t stride);  // tileloaddt1: no L1 reuse expected
  template <int T>
  static void Store(void* p, int64_t stride);
  template <int C, int A, int B>
  static void DpBf16();
  template <int C, int A, int B>
  static void DpI8();
  static void PrefetchL2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
  static void PrefetchL1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static void PrefetchNta(const void* p) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  }
};
#define HMOE_TILE_REG(T)                                              \
  template <>                                                         \
  inline void HwTiles::Zero<T>() {                                    \
    _tile_zero(T);                                                    \
  }                                                                   \
  template <>                                                         \
  inline void HwTiles::Load<T>(const void* p, int64_t stride) {       \
    _tile_loadd(T, p, stride);                                        \
  }                                                                   \
  template <>                                                         \
  inline void HwTiles::LoadStream<T>(const void* p, int64_t stride) { \
    _tile_stream_loadd(T, p, stride);                                 \
  }                                                                   \
  template <>                                                         \
  inline void HwTiles::Store<T>(void* p, int64_t stride) {            \
    _tile_stored(T, p, stride);                                       \
  }
HMOE_TILE_REG(0)
HMOE_TILE_REG(1)
HMOE_TILE_REG(2)
HMOE_TILE_REG(3)
HMOE_TILE_REG(4)
HMOE_TILE_REG(5)
HMOE_TILE_REG(6)
HMOE_TILE_REG(7)
#undef HMOE_TILE_REG
#define HMOE_TILE_DP(C, A, B)              \
  template <>                              \
  inline void HwTiles::DpBf16<C, A, B>() { \
    _tile_dpbf16ps(C, A, B);               \
  }                                        \
  template <>                              \
  inline void HwTiles::DpI8<C, A, B>() {   \
    _tile_dpbssd(C, A, B);                 \
  }
HMOE_TILE_DP(0, 4, 6)
HMOE_TILE_DP(1, 4, 7)
HMOE_TILE_DP(2, 5, 6)
HMOE_TILE_DP(3, 5, 7)
#undef HMOE_TILE_DP

// The software model: same registers, same arithmetic (fp32 sums of exact
// bf16 products; exact int32 sums of int8 products).
struct EmuTiles {
  struct alignas(64) Regs {
    uint8_t t[8][1024];
  };
  static Regs& R() {
    static thread_local Regs r;
    return r;
  }
  static void Configure() {}
  template <int T>
  static void Zero() {
    std::memset(R().t[T], 0, 1024);
  }
  template <int T>
  static void Load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(R().t[T] + r * 64, static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  static void LoadStream(const void* p, int64_t stride) {
    Load<T>(p, stride);
  }
  template <int T>
  static void Store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, R().t[T] + r * 64, 64);
  }
  template <int C, int A, int B>
  static void DpBf16() {
    float c[16][16];
    uint16_t a[16][32], b[16][32];
    std::memcpy(c, R().t[C], 1024);
    std::memcpy(a, R().t[A], 1024);
    std::memcpy(b, R().t[B], 1024);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float s = c[m][n];
        for (int p = 0; p < 16; ++p)
          s += Bf16ToF32(a[m][2 * p]) * Bf16ToF32(b[p][2 * n]) +
               Bf16ToF32(a[m][2 * p + 1]) * Bf16ToF32(b[p][2 * n + 1]);
        c[m][n] = s;
      }
    std::memcpy(R().t[C], c, 1024);
  }
  template <int C, int A, int B>
  static void DpI8() {
    int32_t c[16][16];
    int8_t a[16][64], b[16][64];
    std::memcpy(c, R().t[C], 1024);
    std::memcpy(a, R().t[A], 1024);
    std::memcpy(b, R().t[B], 1024);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t s = c[m][n];
        for (int q = 0; q < 16; ++q)
          for (int i = 0; i < 4; ++i) s += int32_t{a[m][4 * q + i]} * int32_t{b[q][4 * n + i]};
        c[m][n] = s;
      }
    std::memcpy(R().t[C], c, 1024);
  }
  static void PrefetchL2(const void*) {}
  static void PrefetchL1(const void*) {}
  static void PrefetchNta(const void*) {}
};

enum class Kind { kBf16, kInt8, kInt4Bf16 };

// Tuning: AmxTuning (tuning.h). What the measurements said:
//   kc_bytes: 1024 (bf16, int8) keeps a row pair's A chunk (32 KiB) in L1
//     while B streams past it; 256 lost to it in 11 of 12 reps of run 6.
//   edge: ds-v3 T=8192, in process (bench/results run 6): within noise of
//     off, alone or with kc 512 (+3% on average over 6 reps, not in every
//     rep): off.
// Session 8 defaults (kc 1024 for bf16 too, STREAM=1, PF_MASK=1) against
// session 7's (kc 2048 bf16 / 1024 int8, STREAM=0, PF_MASK=3): one core, the
// GEMM alone (256 rows x 16 panels x K 7168, weights from L3), interleaved
// with the register-only loop: 54% vs 46-47% of it, both formats; ds-v3
// T=8192 on the GPU machine, 16 threads, 3 interleaved reps each: int8
// 398-402 vs 420-449 ms, bf16 724-829 vs 800-900 ms (bench/results run 8).

template <class X, int T>
inline void LoadOp(const uint8_t* p, int64_t stride, bool stream) {
  if (stream)
    X::template LoadStream<T>(p, stride);
  else
    X::template Load<T>(p, stride);
}

template <Kind kKind, class X>
void AmxGemm(const GemmArgs& a) {
  constexpr bool kI8 = kKind == Kind::kInt8;
  constexpr bool kI4 = kKind == Kind::kInt4Bf16;  // int4 weights staged as bf16
  constexpr int64_t kStepK = kI8 ? 64 : 32;       // k per tile
  const AmxTuning& tune = a.tune().amx;
  const PackedGeom& g = *a.g;
  if (a.m <= 0 || a.nb1 <= a.nb0) return;  // nothing to compute (and no 0 divisors below)
  // Few rows: panel pairs outer (AmxTuning::order0_rows).
  int order = tune.order == 1 && a.m <= tune.order0_rows ? 0 : tune.order;
  const int64_t npan = a.nb1 - a.nb0;
  // int4 runs order 1 only staged (AmxTuning::i4_stage); unstaged it keeps
  // order 0, 2 KiB chunks and plain loads: its in-process comparison (run 8)
  // lost ~10% with the bf16/int8 defaults.
  // k per chunk (a multiple of 128); int4's order-0 buffers hold at most 2048 k per panel.
  auto chunk_k = [&](bool staged) {
    const int64_t kc_bytes = tune.kc_bytes > 0 ? tune.kc_bytes : (kI4 && !staged ? 2048 : 1024);
    return std::min<int64_t>(kc_bytes / (kI8 ? 1 : 2), kI4 ? 2048 : int64_t{1} << 30);
  };
  // Staged int4: two halves of the scratch, each one K chunk of the task's
  // panels as bf16 panels (panel j - nb0 at + (j - nb0) * stage_pb).
  const bool i4_stage = kI4 && tune.i4_stage && order == 1 &&
                        2 * npan * (chunk_k(true) / kStepK * 1024) <= a.scratch_bytes;
  const int64_t kChunkK = chunk_k(i4_stage);
  const int64_t stage_pb = kChunkK / kStepK * 1024;
  if (kI4 && !i4_stage) order = 0;
  const bool stream = tune.stream && (!kI4 || i4_stage);
  X::Configure();
  const int mp = (a.m + 31) / 32 * 32;
  const int64_t ldc_b = a.ldc * 4;
  const uint8_t* A = static_cast<const uint8_t*>(a.a);
  // A tile: rows at a_rs apart; consecutive k steps a_ss apart.
  const int64_t a_rs = a.a_tiled ? 64 : a.lda;
  const int64_t a_ss = a.a_tiled ? 1024 : 64;
  uint8_t* buf0 = a.scratch;
  uint8_t* buf1 = a.scratch + kGemmScratchBytes / 2;  // each half: <= 2048 k of one panel
  const bool prefetch = tune.prefetch && (!kI4 || i4_stage);
  // One 32-row x 2-panel C block over the k steps [kc0, kc0 + steps*kStepK):
  // C from c (zero on the first chunk), the products, C back to c. The
  // operand not reused from L1 (A in order 0, B in order 1) may be loaded
  // with tileloaddt1; `after_step` issues prefetches.
  // Partial C between K chunks: strided rows of c, or (ctmp) contiguous
  // tiles in the scratch, tile (row block, panel) at ((m0/16)*np + p) KiB.
  const bool ctmp = tune.ctmp && order == 1 && !kI4 && int64_t{mp} * npan * 64 <= a.scratch_bytes;
  // Edge overlap (AmxTuning::edge): a block leaves its C tiles in the registers
  // and the next block stores them one by one, each just before it
  // initializes that register, inside its first k step; so the products of
  // the new block start while the old tiles drain. `pend` is the store still
  // owed (flushed before the epilogue).
  struct Pending {
    uint8_t* p = nullptr;
    int64_t rs = 0, r1 = 0, c1 = 0;
    bool two = false, rows2 = false;
  } pend;
  // Tile register I of a 32-row x 2-panel C block at p (row stride rs, second
  // row block at +r1, second panel at +c1).
  auto tile_at = [](uint8_t* p, int64_t r1, int64_t c1, int i) {
    return p + (i >= 2 ? r1 : 0) + (i % 2 == 1 ? c1 : 0);
  };
  auto flush = [&](auto reg) {
    constexpr int kReg = decltype(reg)::value;
    if (pend.p != nullptr && (pend.two || kReg % 2 == 0) && (pend.rows2 || kReg < 2))
      X::template Store<kReg>(tile_at(pend.p, pend.r1, pend.c1, kReg), pend.rs);
  };
  auto flush_all = [&] {
    flush(std::integral_constant<int, 0>{});
    flush(std::integral_constant<int, 1>{});
    flush(std::integral_constant<int, 2>{});
    flush(std::integral_constant<int, 3>{});
    pend.p = nullptr;
  };
  auto product = [&](auto c, auto ta, auto tb) {
    if constexpr (kI8)
      X::template DpI8<decltype(c)::value, decltype(ta)::value, decltype(tb)::value>();
    else
      X::template DpBf16<decltype(c)::value, decltype(ta)::value, decltype(tb)::value>();
  };
  // int8: C rows [m0, m1) of panels [j, j + np) from int32 sums to f32,
  // times the row's activation scale and the column's weight scale.
  auto i8_scale = [&](int m0, int m1, int64_t j, int64_t np) {
    for (int64_t jj = j; jj < j + np; ++jj) {
      const __m512 sc = _mm512_loadu_ps(a.w + jj * g.panel_bytes + g.i8_scale_offset());
      for (int m = m0; m < m1; ++m) {
        float* c = a.c + m * a.ldc + (jj - a.nb0) * 16;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c));
        _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(a.a_scale[m])), sc));
      }
    }
  };
  const bool block_epi = kI8 && tune.i8_block_epi && !tune.edge;
  using R0 = std::integral_constant<int, 0>;
  using R1 = std::integral_constant<int, 1>;
  using R2 = std::integral_constant<int, 2>;
  using R3 = std::integral_constant<int, 3>;
  using RA0 = std::integral_constant<int, 4>;
  using RA1 = std::integral_constant<int, 5>;
  using RB0 = std::integral_constant<int, 6>;
  using RB1 = std::integral_constant<int, 7>;
  auto block = [&](int m0, int64_t j, const uint8_t* B0, const uint8_t* B1, bool two, int64_t kc0,
                   int64_t steps, bool stream_a, bool stream_b, auto&& after_step) {
    const bool last = kc0 + steps * kStepK >= g.kp;
    // The second row block holds real rows (else it is padding: skipped).
    const bool rows2 = !tune.tail16 || m0 + 16 < a.m;
    uint8_t* R00 = reinterpret_cast<uint8_t*>(a.c + m0 * a.ldc + (j - a.nb0) * 16);
    // Where C is loaded from (chunks after the first) and stored to.
    uint8_t* L00 = R00;
    int64_t l_rs = ldc_b, l_r1 = 16 * ldc_b, l_c1 = 64;
    if (ctmp) {
      L00 = a.scratch + ((m0 / 16) * npan + (j - a.nb0)) * 1024;
      l_rs = 64;
      l_r1 = npan * 1024;
      l_c1 = 1024;
    }
    uint8_t* S00 = last ? R00 : L00;
    const int64_t s_rs = last ? ldc_b : l_rs, s_r1 = last ? 16 * ldc_b : l_r1,
                  s_c1 = last ? 64 : l_c1;
    // C register I from its partial sums (or zero on the first chunk).
    auto init = [&](auto reg) {
      constexpr int kReg = decltype(reg)::value;
      if (kc0 == 0)
        X::template Zero<kReg>();
      else
        X::template Load<kReg>(tile_at(L00, l_r1, l_c1, kReg), l_rs);
    };
    const uint8_t* a0 = A + m0 * a.lda + kc0 / kStepK * a_ss;
    const uint8_t* a1 = a0 + 16 * a.lda;
    int64_t s = 0;
    if (tune.edge) {
      // Step 0 with the previous block's stores and this block's C inits
      // interleaved, register by register, in the order the products run.
      flush(R0{});
      init(R0{});
      LoadOp<X, 4>(a0, a_rs, stream_a);
      LoadOp<X, 6>(B0, 64, stream_b);
      product(R0{}, RA0{}, RB0{});
      flush(R1{});
      if (two) {
        init(R1{});
        LoadOp<X, 7>(B1, 64, stream_b);
        product(R1{}, RA0{}, RB1{});
      }
      flush(R2{});
      if (rows2) {
        init(R2{});
        LoadOp<X, 5>(a1, a_rs, stream_a);
        product(R2{}, RA1{}, RB0{});
      }
      flush(R3{});
      if (two && rows2) {
        init(R3{});
        product(R3{}, RA1{}, RB1{});
      }
      pend.p = nullptr;
      after_step(int64_t{0});
      s = 1;
    } else {
      init(R0{});
      if (rows2) init(R2{});
      if (two) {
        init(R1{});
        if (rows2) init(R3{});
      }
    }
    // Each k step: its tile loads (four for a full block), then its products.
    if (two && rows2) {
      for (; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 7>(B1 + s * 1024, 64, stream_b);
        LoadOp<X, 5>(a1 + s * a_ss, a_rs, stream_a);
        product(R0{}, RA0{}, RB0{});
        product(R1{}, RA0{}, RB1{});
        product(R2{}, RA1{}, RB0{});
        product(R3{}, RA1{}, RB1{});
        after_step(s);
      }
    } else if (rows2) {
      for (; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 5>(a1 + s * a_ss, a_rs, stream_a);
        product(R0{}, RA0{}, RB0{});
        product(R2{}, RA1{}, RB0{});
        after_step(s);
      }
    } else if (two) {
      for (; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 7>(B1 + s * 1024, 64, stream_b);
        product(R0{}, RA0{}, RB0{});
        product(R1{}, RA0{}, RB1{});
        after_step(s);
      }
    } else {
      for (; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        product(R0{}, RA0{}, RB0{});
        after_step(s);
      }
    }
    if (tune.edge) {
      pend = Pending{S00, s_rs, s_r1, s_c1, two, rows2};
    } else {
      if (two) {
        X::template Store<1>(S00 + s_c1, s_rs);
        if (rows2) X::template Store<3>(S00 + s_r1 + s_c1, s_rs);
      }
      X::template Store<0>(S00, s_rs);
      if (rows2) X::template Store<2>(S00 + s_r1, s_rs);
      if (block_epi && last) i8_scale(m0, std::min(m0 + 32, a.m), j, two ? 2 : 1);
    }
  };

  if (order == 1) {
    // Order 1: per K chunk, row pairs outer (A chunk reused from L1), panel
    // pairs inner (B chunk of all the task's panels reused from L2). With
    // prefetch on, the next chunk's B lines go to L2 spread over the whole
    // chunk, and (tile-layout A) each row pair's successor A lines spread
    // over the row pair, so no tile load waits on DRAM.
    const int64_t npairs = (npan + 1) / 2;
    // Staged int4: chunk 0 dequantized here; chunk c + 1 during chunk c.
    uint8_t* stage[2] = {a.scratch, a.scratch + npan * stage_pb};
    const int64_t i4_gb = kI4 ? g.i4_group_bytes() : 0;
    if constexpr (kI4) {
      const int64_t k1 = std::min(g.kp, kChunkK);
      for (int64_t j = a.nb0; j < a.nb1; ++j)
        DequantI4PanelBf16Avx512(g, a.w + j * g.panel_bytes, 0, k1,
                                 reinterpret_cast<uint16_t*>(stage[0] + (j - a.nb0) * stage_pb));
    }
    for (int64_t kc0 = 0, chunk = 0; kc0 < g.kp; kc0 += kChunkK, ++chunk) {
      const int64_t kc1 = std::min(g.kp, kc0 + kChunkK);
      const int64_t steps = (kc1 - kc0) / kStepK;
      const int64_t next_steps = (std::min(g.kp, kc1 + kChunkK) - kc1) / kStepK;
      // B cursor: panel b_p of [b_p, b_p1) at b_w (b_stride apart), byte b_off
      // within [b_start, b_end) of the panel: the next chunk's B or, in the
      // last chunk, the first chunk of the caller's next task (GemmArgs::next_w).
      const uint8_t* b_w = a.w;
      int64_t b_stride = g.panel_bytes, b_p = a.nb0, b_p1 = a.nb1;
      int64_t b_start = kc1 / kStepK * 1024, b_end = b_start + next_steps * 1024;
      if (kI4) b_end = b_start;  // the dequant cursor prefetches its own lines
      if (kc1 >= g.kp && a.next_w != nullptr && a.next_g != nullptr) {
        b_w = a.next_w;
        b_stride = a.next_g->panel_bytes;
        b_p = a.next_nb0;
        b_p1 = a.next_nb1;
        b_start = 0;
        const int64_t nk = std::min(a.next_g->kp, kChunkK);
        // int4: the int4 bytes of the groups the next call dequantizes first.
        b_end = kI4 ? nk / a.next_g->group * a.next_g->i4_group_bytes() : nk / kStepK * 1024;
      }
      int64_t b_off = b_start, b_per_step = 0;
      if (prefetch && (tune.pf_mask & 1) && b_end > b_start) {
        const int64_t lines = (b_p1 - b_p) * (b_end - b_start) / 64,
                      slots = (mp / 32) * npairs * steps;
        b_per_step = (lines + slots - 1) / slots;
      }
      // A cursor over the next row pair's chunk (two contiguous row-block runs).
      const bool pf_a = prefetch && (tune.pf_mask & 2) && a.a_tiled;
      const int64_t a_per_step =
          pf_a ? (2 * steps * 16 + npairs * steps - 1) / (npairs * steps) : 0;
      const uint8_t* a_run[2] = {nullptr, nullptr};
      int64_t a_off = 0, a_r = 2, a_len = 0;
      // Staged int4: the dequant cursor over chunk + 1's int4 lines, panel by
      // panel (d_p, line d_l of d_lines), into the other stage half; the
      // prefetch cursor (p_p, p_l) runs kI4PfLines lines ahead of it.
      constexpr int64_t kI4PfLines = 16;
      const int64_t d_lines = (std::min(g.kp, kc1 + kChunkK) - kc1) / 8;
      int64_t d_p = 0, d_l = 0, d_per_step = 0, d_gi = -1, p_p = 0, p_l = 0;
      i4::GroupScales d_s{};
      uint16_t* d_out = reinterpret_cast<uint16_t*>(stage[(chunk + 1) % 2]);
      if (kI4 && d_lines > 0) {
        d_per_step =
            (npan * d_lines + (mp / 32) * npairs * steps - 1) / ((mp / 32) * npairs * steps);
        p_p = std::min<int64_t>(kI4PfLines / d_lines, npan);
        p_l = kI4PfLines % d_lines;
      } else {
        d_p = npan;  // nothing to dequantize
      }
      auto i4_src = [&](int64_t p, int64_t l) {
        const int64_t k = kc1 + 8 * l;
        return a.w + (a.nb0 + p) * g.panel_bytes + k / g.group * i4_gb + k % g.group * 8;
      };
      // (Called for int4 only.)
      auto dequant_lines = [&](int64_t n) {
        for (int64_t q = 0; q < n && d_p < npan; ++q) {
          if (prefetch && (tune.pf_mask & 1) && p_p < npan) {
            const uint8_t* src = i4_src(p_p, p_l);
            X::PrefetchL2(src);
            // A group's last line: its scales (the 64 bytes after it) too.
            if ((kc1 + 8 * (p_l + 1)) % g.group == 0) X::PrefetchL2(src + 64);
            if (++p_l == d_lines) {
              p_l = 0;
              ++p_p;
            }
          }
          const int64_t k = kc1 + 8 * d_l;
          if (k / g.group != d_gi || d_l == 0) {
            d_gi = k / g.group;
            d_s = i4::LoadGroupScales(a.w + (a.nb0 + d_p) * g.panel_bytes + d_gi * i4_gb +
                                      int64_t{g.group} * 8);
          }
          i4::DequantLine(i4_src(d_p, d_l), d_s, d_out + d_p * (stage_pb / 2) + d_l * 128);
          if (++d_l == d_lines) {
            d_l = 0;
            ++d_p;
          }
        }
      };
      auto after_step = [&](int64_t) {
        if constexpr (kI4) dequant_lines(d_per_step);
        for (int64_t q = 0; q < b_per_step && b_p < b_p1; ++q) {
          X::PrefetchL2(b_w + b_p * b_stride + b_off);
          b_off += 64;
          if (b_off == b_end) {
            b_off = b_start;
            ++b_p;
          }
        }
        for (int64_t q = 0; q < a_per_step && a_r < 2; ++q) {
          X::PrefetchL2(a_run[a_r] + a_off);
          a_off += 64;
          if (a_off == a_len) {
            a_off = 0;
            ++a_r;
          }
        }
      };
      for (int m0 = 0; m0 < mp; m0 += 32) {
        if (pf_a) {
          // The next row pair of this chunk, or the first of the next chunk.
          const int64_t nm = m0 + 32 < mp ? m0 + 32 : 0;
          const int64_t nk = m0 + 32 < mp ? kc0 : kc1;
          a_r = nk < g.kp ? 0 : 2;
          a_off = 0;
          a_len = (nk == kc0 ? steps : next_steps) * 1024;
          a_run[0] = A + nm * a.lda + nk / kStepK * 1024;
          a_run[1] = a_run[0] + 16 * a.lda;
        }
        for (int64_t j = a.nb0; j < a.nb1; j += 2) {
          const uint8_t* B0;
          int64_t bs;  // bytes from panel j's chunk to panel j + 1's
          if (kI4) {
            B0 = stage[chunk % 2] + (j - a.nb0) * stage_pb;
            bs = stage_pb;
          } else {
            B0 = a.w + j * g.panel_bytes + kc0 / kStepK * 1024;
            bs = g.panel_bytes;
          }
          block(m0, j, B0, B0 + bs, j + 1 < a.nb1, kc0, steps, false, stream, after_step);
        }
      }
      if constexpr (kI4) dequant_lines(npan * d_lines);  // whatever the k steps left
    }
  } else {
    // Order 0: per K chunk, panel pairs outer (B chunk reused from L1), row
    // pairs inner (A chunk reused from L2).
    for (int64_t kc0 = 0; kc0 < g.kp; kc0 += kChunkK) {
      const int64_t kc1 = std::min(g.kp, kc0 + kChunkK);
      const int64_t steps = (kc1 - kc0) / kStepK;
      for (int64_t j = a.nb0; j < a.nb1; j += 2) {
        const bool two = j + 1 < a.nb1;
        const uint8_t* B0;
        const uint8_t* B1;
        if constexpr (kI4) {
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
        // The B chunk used after this one: the next pair, or the first pair
        // of the next K chunk. Its lines are prefetched a few per k step.
        const uint8_t* pf[2] = {nullptr, nullptr};
        int64_t pf_lines = 0, pf_per_step = 0, pf_done = 0, pf_panel_lines = 0;
        if (prefetch) {
          int64_t nj = j + 2, nk = kc0;
          if (nj >= a.nb1) {
            nj = a.nb0;
            nk = kc1;
          }
          if (nk < g.kp) {
            const int64_t nsteps = (std::min(g.kp, nk + kChunkK) - nk) / kStepK;
            pf[0] = a.w + nj * g.panel_bytes + nk / kStepK * 1024;
            pf[1] = nj + 1 < a.nb1 ? pf[0] + g.panel_bytes : nullptr;
            pf_panel_lines = nsteps * 16;
            pf_lines = pf_panel_lines * (pf[1] != nullptr ? 2 : 1);
            const int64_t slots = (mp / 32) * steps;
            pf_per_step = (pf_lines + slots - 1) / slots;
          }
        }
        for (int m0 = 0; m0 < mp; m0 += 32) {
          // After step s: A tiles kPfDist steps on (running into the next row
          // pair) into L1, and some lines of the next B chunk into L2.
          auto after_step = [&](int64_t s) {
            constexpr int64_t kPfDist = 2;
            if (tune.pf_a != 0) {
              int64_t t = s + kPfDist, mm = m0;
              if (t >= steps) {
                t -= steps;
                mm += 32;
              }
              if (mm < mp) {
                const uint8_t* p0 = A + mm * a.lda + (kc0 / kStepK + t) * a_ss;
                const uint8_t* p1 = p0 + 16 * a.lda;
                for (int r = 0; r < 16; ++r) {
                  if (tune.pf_a == 1) {
                    X::PrefetchL1(p0 + r * a_rs);
                    X::PrefetchL1(p1 + r * a_rs);
                  } else {
                    X::PrefetchNta(p0 + r * a_rs);
                    X::PrefetchNta(p1 + r * a_rs);
                  }
                }
              }
            }
            for (int64_t q = 0; q < pf_per_step && pf_done < pf_lines; ++q, ++pf_done)
              X::PrefetchL2(pf_done < pf_panel_lines ? pf[0] + pf_done * 64
                                                     : pf[1] + (pf_done - pf_panel_lines) * 64);
          };
          block(m0, j, B0, B1, two, kc0, steps, stream, false, after_step);
        }
      }
    }
  }
  flush_all();
  if (kI8 && !block_epi) i8_scale(0, a.m, a.nb0, a.nb1 - a.nb0);
}

}  // namespace

void AmxPeakLoop(int64_t iters, bool int8) {
  alignas(64) static const uint8_t zeros[1024] = {};
  HwTiles::Configure();
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
    s.bf16 = AmxGemm<Kind::kBf16, HwTiles>;
    s.i8 = AmxGemm<Kind::kInt8, HwTiles>;
    s.i4_bf16 = AmxGemm<Kind::kInt4Bf16, HwTiles>;
    return s;
  }();
  return k;
}

const KernelSet& AmxEmulatedKernels() {
  static const KernelSet k = [] {
    KernelSet s = Avx512Kernels();
    s.bf16 = AmxGemm<Kind::kBf16, EmuTiles>;
    s.i8 = AmxGemm<Kind::kInt8, EmuTiles>;
    s.i4_bf16 = AmxGemm<Kind::kInt4Bf16, EmuTiles>;
    return s;
  }();
  return k;
}

}  // namespace hmoe::kern
