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
// A call is planned, then run: PlanAmx fixes its tiling (loop order, K chunk,
// int4 staging, streaming and prefetch: an AmxPlan) from the tuning and the
// call's shape; AmxRun walks the blocks of that plan.
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
};

enum class Kind { kBf16, kInt8, kInt4Bf16, kNativeBf16 };

// Tuning: AmxTuning (tuning.h). What the measurements said:
//   kc_bytes: 1024 (bf16, int8) keeps a row pair's A chunk (32 KiB) in L1
//     while B streams past it; 256 lost to it in 11 of 12 reps of run 6.
// Session 8 defaults (kc 1024 for bf16 too, tileloaddt1 B, only B
// prefetched) against session 7's (kc 2048 bf16 / 1024 int8, plain loads, A
// prefetched too): one core, the GEMM alone (256 rows x 16 panels x K 7168,
// weights from L3), interleaved with the register-only loop: 54% vs 46-47%
// of it, both formats; ds-v3 T=8192 on the GPU machine, 16 threads, 3
// interleaved reps each: int8 398-402 vs 420-449 ms, bf16 724-829 vs
// 800-900 ms (bench/results run 8).

// The tiling of one call, fixed before any tile is touched (PlanAmx);
// AmxRun executes it.
struct AmxPlan {
  int order = 1;          // per K chunk: 1 row pairs outer, 0 panel pairs outer
  bool i4_stage = false;  // int4: order 1 over bf16 chunks staged in the scratch
  bool stream = false;    // tileloaddt1 for the operand not reused from L1
  bool prefetch = false;  // B lines of what comes next into L2
  bool tail16 = false;    // a padding-only second row block is skipped
  int64_t chunk_k = 0;    // k per K chunk (a multiple of 128)
  int64_t stage_pb = 0;   // staged int4: bytes of one panel's chunk as bf16
  int64_t npan = 0;       // the task's panels
  int mp = 0;             // rows padded to 32
  int64_t a_rs = 0;       // A tile: bytes between its rows
  int64_t a_ss = 0;       // A: bytes between consecutive k steps
};

template <Kind kKind>
constexpr int64_t kStepK = kKind == Kind::kInt8 ? 64 : 32;  // k per tile

template <Kind kKind>
AmxPlan PlanAmx(const GemmArgs& a) {
  constexpr bool kI8 = kKind == Kind::kInt8;
  // int4 and native weights are dequantized to bf16; only int4 is ever staged
  // (native formats run order 0, each panel pair dequantized before its blocks).
  constexpr bool kI4 = kKind == Kind::kInt4Bf16 || kKind == Kind::kNativeBf16;
  const AmxTuning& tune = a.tune().amx;
  AmxPlan p;
  // Few rows: panel pairs outer (AmxTuning::order0_rows).
  p.order = tune.order == 1 && a.m <= tune.order0_rows ? 0 : tune.order;
  p.npan = a.nb1 - a.nb0;
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
  p.i4_stage = kKind == Kind::kInt4Bf16 && tune.i4_stage && p.order == 1 &&
               2 * p.npan * (chunk_k(true) / kStepK<kKind> * 1024) <= a.scratch_bytes;
  p.chunk_k = chunk_k(p.i4_stage);
  p.stage_pb = p.chunk_k / kStepK<kKind> * 1024;
  if (kI4 && !p.i4_stage) p.order = 0;
  p.stream = tune.stream && (!kI4 || p.i4_stage);
  p.prefetch = tune.prefetch && (!kI4 || p.i4_stage);
  p.tail16 = tune.tail16;
  p.mp = (a.m + 31) / 32 * 32;
  p.a_rs = a.a_tiled ? 64 : a.lda;
  p.a_ss = a.a_tiled ? 1024 : 64;
  return p;
}

template <class X, int T>
inline void LoadOp(const uint8_t* p, int64_t stride, bool stream) {
  if (stream)
    X::template LoadStream<T>(p, stride);
  else
    X::template Load<T>(p, stride);
}

// A prefetch stream into L2, `per_step` lines per k step: bytes [start, end)
// of panels [p, p1) at w (stride apart), from `off` of panel p.
struct LineCursor {
  const uint8_t* w = nullptr;
  int64_t stride = 0, p = 0, p1 = 0, start = 0, end = 0, off = 0, per_step = 0;
  template <class X>
  void Step() {
    for (int64_t q = 0; q < per_step && p < p1; ++q) {
      X::PrefetchL2(w + p * stride + off);
      off += 64;
      if (off == end) {
        off = start;
        ++p;
      }
    }
  }
};

// Staged int4: the dequant cursor over the int4 lines of the chunk at kc1,
// panel by panel (panel p, line l of `lines`), into `out`; the prefetch
// cursor (pp, pl) runs kI4PfLines lines ahead of it.
struct I4Cursor {
  static constexpr int64_t kI4PfLines = 16;
  int64_t kc1 = 0, lines = 0, per_step = 0;
  int64_t p = 0, l = 0, gi = -1, pp = 0, pl = 0;
  i4::GroupScales s{};
  uint16_t* out = nullptr;
};

// Executes an AmxPlan: the 32-row x 2-panel C blocks of every K chunk in
// the plan's order, partial C kept in the caller's c between chunks.
template <Kind kKind, class X>
class AmxRun {
 public:
  AmxRun(const GemmArgs& a, const AmxPlan& p)
      : a_(a), g_(*a.g), p_(p), A_(static_cast<const uint8_t*>(a.a)) {}

  void Run() {
    X::Configure();
    if (p_.order == 1)
      Order1();
    else
      Order0();
  }

 private:
  static constexpr bool kI8 = kKind == Kind::kInt8;
  static constexpr bool kI4 = kKind == Kind::kInt4Bf16;
  static constexpr bool kNative = kKind == Kind::kNativeBf16;
  static constexpr int64_t kStep = kStepK<kKind>;

  template <int C, int TA, int TB>
  static void Product() {
    if constexpr (kI8)
      X::template DpI8<C, TA, TB>();
    else
      X::template DpBf16<C, TA, TB>();
  }
  // C register kReg from its partial sums at p, or zero on the first chunk.
  template <int kReg>
  static void InitC(const uint8_t* p, int64_t rs, bool first) {
    if (first)
      X::template Zero<kReg>();
    else
      X::template Load<kReg>(p, rs);
  }

  // int8: C rows [m0, m1) of panels [j, j + np) from int32 sums to f32,
  // times the row's activation scale and the column's weight scale.
  void I8Scale(int m0, int m1, int64_t j, int64_t np) const {
    for (int64_t jj = j; jj < j + np; ++jj) {
      const __m512 sc = _mm512_loadu_ps(a_.w + jj * g_.panel_bytes + g_.i8_scale_offset());
      for (int m = m0; m < m1; ++m) {
        float* c = a_.c + m * a_.ldc + (jj - a_.nb0) * 16;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c));
        _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(a_.a_scale[m])), sc));
      }
    }
  }

  // One 32-row x 2-panel C block over the k steps [kc0, kc0 + steps*kStep):
  // C from c (zero on the first chunk), the products, C back to c (int8:
  // scaled to f32 after the last chunk, while the block is in L1). The
  // operand not reused from L1 (A in order 0, B in order 1) may be loaded
  // with tileloaddt1; `after_step` issues prefetches.
  template <class AfterStep>
  void Block(int m0, int64_t j, const uint8_t* B0, const uint8_t* B1, bool two, int64_t kc0,
             int64_t steps, bool stream_a, bool stream_b, AfterStep&& after_step) const {
    const bool last = kc0 + steps * kStep >= g_.kp;
    // The second row block holds real rows (else it is padding: skipped).
    const bool rows2 = !p_.tail16 || m0 + 16 < a_.m;
    uint8_t* C = reinterpret_cast<uint8_t*>(a_.c + m0 * a_.ldc + (j - a_.nb0) * 16);
    const int64_t rs = a_.ldc * 4, r1 = 16 * rs;  // second row block at +r1, panel at +64
    InitC<0>(C, rs, kc0 == 0);
    if (rows2) InitC<2>(C + r1, rs, kc0 == 0);
    if (two) {
      InitC<1>(C + 64, rs, kc0 == 0);
      if (rows2) InitC<3>(C + r1 + 64, rs, kc0 == 0);
    }
    const uint8_t* a0 = A_ + m0 * a_.lda + kc0 / kStep * p_.a_ss;
    const uint8_t* a1 = a0 + 16 * a_.lda;
    const int64_t a_rs = p_.a_rs, a_ss = p_.a_ss;
    // Each k step: its tile loads (four for a full block), then its products.
    if (two && rows2) {
      for (int64_t s = 0; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 7>(B1 + s * 1024, 64, stream_b);
        LoadOp<X, 5>(a1 + s * a_ss, a_rs, stream_a);
        Product<0, 4, 6>();
        Product<1, 4, 7>();
        Product<2, 5, 6>();
        Product<3, 5, 7>();
        after_step(s);
      }
    } else if (rows2) {
      for (int64_t s = 0; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 5>(a1 + s * a_ss, a_rs, stream_a);
        Product<0, 4, 6>();
        Product<2, 5, 6>();
        after_step(s);
      }
    } else if (two) {
      for (int64_t s = 0; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        LoadOp<X, 7>(B1 + s * 1024, 64, stream_b);
        Product<0, 4, 6>();
        Product<1, 4, 7>();
        after_step(s);
      }
    } else {
      for (int64_t s = 0; s < steps; ++s) {
        LoadOp<X, 4>(a0 + s * a_ss, a_rs, stream_a);
        LoadOp<X, 6>(B0 + s * 1024, 64, stream_b);
        Product<0, 4, 6>();
        after_step(s);
      }
    }
    if (two) {
      X::template Store<1>(C + 64, rs);
      if (rows2) X::template Store<3>(C + r1 + 64, rs);
    }
    X::template Store<0>(C, rs);
    if (rows2) X::template Store<2>(C + r1, rs);
    if (kI8 && last) I8Scale(m0, std::min(m0 + 32, a_.m), j, two ? 2 : 1);
  }

  // Order 1: per K chunk, row pairs outer (A chunk reused from L1), panel
  // pairs inner (B chunk of all the task's panels reused from L2). With
  // prefetch on, the next chunk's B lines go to L2 spread over the whole
  // chunk, so no tile load waits on DRAM. Staged int4: chunk 0 dequantized
  // here; chunk c + 1 during chunk c.
  void Order1() {
    uint8_t* stage[2] = {a_.scratch, a_.scratch + p_.npan * p_.stage_pb};
    if constexpr (kI4) {
      const int64_t k1 = std::min(g_.kp, p_.chunk_k);
      for (int64_t j = a_.nb0; j < a_.nb1; ++j)
        DequantI4PanelBf16Avx512(
            g_, a_.w + j * g_.panel_bytes, 0, k1,
            reinterpret_cast<uint16_t*>(stage[0] + (j - a_.nb0) * p_.stage_pb));
    }
    for (int64_t kc0 = 0, chunk = 0; kc0 < g_.kp; kc0 += p_.chunk_k, ++chunk)
      Order1Chunk(kc0, chunk, stage);
  }

  void Order1Chunk(int64_t kc0, int64_t chunk, uint8_t* const stage[2]) {
    const int64_t npairs = (p_.npan + 1) / 2;
    const int64_t kc1 = std::min(g_.kp, kc0 + p_.chunk_k);
    const int64_t steps = (kc1 - kc0) / kStep;
    const int64_t slots = (p_.mp / 32) * npairs * steps;  // k steps of the chunk
    LineCursor b = NextB(kc1, slots);
    I4Cursor d;
    if constexpr (kI4) d = FirstI4Line(kc1, slots, stage[(chunk + 1) % 2]);
    auto after_step = [&](int64_t) {
      if constexpr (kI4) DequantLines(d, d.per_step);
      b.Step<X>();
    };
    for (int m0 = 0; m0 < p_.mp; m0 += 32) {
      for (int64_t j = a_.nb0; j < a_.nb1; j += 2) {
        const uint8_t* B0;
        int64_t bs;  // bytes from panel j's chunk to panel j + 1's
        if (kI4) {
          B0 = stage[chunk % 2] + (j - a_.nb0) * p_.stage_pb;
          bs = p_.stage_pb;
        } else {
          B0 = a_.w + j * g_.panel_bytes + kc0 / kStep * 1024;
          bs = g_.panel_bytes;
        }
        Block(m0, j, B0, B0 + bs, j + 1 < a_.nb1, kc0, steps, false, p_.stream, after_step);
      }
    }
    if constexpr (kI4) DequantLines(d, p_.npan * d.lines);  // whatever the k steps left
  }

  // Order 1's B prefetch over a chunk of `slots` k steps: the next chunk's
  // B or, in the last chunk, the first chunk of the caller's next task
  // (GemmArgs::next_w). Staged int4 prefetches its own int4 lines, only the
  // next task's (the int4 bytes of the groups it dequantizes first).
  LineCursor NextB(int64_t kc1, int64_t slots) const {
    const int64_t next_steps = (std::min(g_.kp, kc1 + p_.chunk_k) - kc1) / kStep;
    LineCursor b{a_.w, g_.panel_bytes, a_.nb0, a_.nb1, kc1 / kStep * 1024, 0, 0, 0};
    b.end = kI4 ? b.start : b.start + next_steps * 1024;
    if (kc1 >= g_.kp && a_.next_w != nullptr && a_.next_g != nullptr) {
      b.w = a_.next_w;
      b.stride = a_.next_g->panel_bytes;
      b.p = a_.next_nb0;
      b.p1 = a_.next_nb1;
      b.start = 0;
      const int64_t nk = std::min(a_.next_g->kp, p_.chunk_k);
      b.end = kI4 ? nk / a_.next_g->group * a_.next_g->i4_group_bytes() : nk / kStep * 1024;
    }
    b.off = b.start;
    if (p_.prefetch && b.end > b.start) {
      const int64_t lines = (b.p1 - b.p) * (b.end - b.start) / 64;
      b.per_step = (lines + slots - 1) / slots;
    }
    return b;
  }

  // Staged int4: the cursor at the first int4 line of the chunk at kc1,
  // spread over `slots` k steps, dequantizing into `out`.
  I4Cursor FirstI4Line(int64_t kc1, int64_t slots, uint8_t* out) const {
    I4Cursor d;
    d.kc1 = kc1;
    d.lines = (std::min(g_.kp, kc1 + p_.chunk_k) - kc1) / 8;
    d.out = reinterpret_cast<uint16_t*>(out);
    if (d.lines > 0) {
      d.per_step = (p_.npan * d.lines + slots - 1) / slots;
      d.pp = std::min<int64_t>(I4Cursor::kI4PfLines / d.lines, p_.npan);
      d.pl = I4Cursor::kI4PfLines % d.lines;
    } else {
      d.p = p_.npan;  // nothing to dequantize
    }
    return d;
  }
  const uint8_t* I4Src(int64_t kc1, int64_t p, int64_t l) const {
    const int64_t k = kc1 + 8 * l;
    return a_.w + (a_.nb0 + p) * g_.panel_bytes + k / g_.group * g_.i4_group_bytes() +
           k % g_.group * 8;
  }
  // Dequantizes the next n int4 lines of d (each four bf16 lines of the stage).
  void DequantLines(I4Cursor& d, int64_t n) const {
    for (int64_t q = 0; q < n && d.p < p_.npan; ++q) {
      if (p_.prefetch && d.pp < p_.npan) {
        const uint8_t* src = I4Src(d.kc1, d.pp, d.pl);
        X::PrefetchL2(src);
        // A group's last line: its scales (the 64 bytes after it) too.
        if ((d.kc1 + 8 * (d.pl + 1)) % g_.group == 0) X::PrefetchL2(src + 64);
        if (++d.pl == d.lines) {
          d.pl = 0;
          ++d.pp;
        }
      }
      const int64_t k = d.kc1 + 8 * d.l;
      if (k / g_.group != d.gi || d.l == 0) {
        d.gi = k / g_.group;
        d.s = i4::LoadGroupScales(a_.w + (a_.nb0 + d.p) * g_.panel_bytes +
                                  d.gi * g_.i4_group_bytes() + int64_t{g_.group} * 8);
      }
      i4::DequantLine(I4Src(d.kc1, d.p, d.l), d.s, d.out + d.p * (p_.stage_pb / 2) + d.l * 128);
      if (++d.l == d.lines) {
        d.l = 0;
        ++d.p;
      }
    }
  }

  // Order 0: per K chunk, panel pairs outer (B chunk reused from L1), row
  // pairs inner (A chunk reused from L2).
  void Order0() {
    for (int64_t kc0 = 0; kc0 < g_.kp; kc0 += p_.chunk_k) {
      const int64_t kc1 = std::min(g_.kp, kc0 + p_.chunk_k);
      for (int64_t j = a_.nb0; j < a_.nb1; j += 2) Order0Pair(kc0, kc1, j);
    }
  }

  void Order0Pair(int64_t kc0, int64_t kc1, int64_t j) {
    const int64_t steps = (kc1 - kc0) / kStep;
    const bool two = j + 1 < a_.nb1;
    const uint8_t* B0;
    const uint8_t* B1;
    if constexpr (kI4 || kNative) {
      uint8_t* buf0 = a_.scratch;
      uint8_t* buf1 = a_.scratch + kGemmScratchBytes / 2;  // each half: <= 2048 k of one panel
      const auto dequant = kI4 ? DequantI4PanelBf16Avx512 : DequantNativePanelBf16Avx512;
      dequant(g_, a_.w + j * g_.panel_bytes, kc0, kc1, reinterpret_cast<uint16_t*>(buf0));
      if (two)
        dequant(g_, a_.w + (j + 1) * g_.panel_bytes, kc0, kc1, reinterpret_cast<uint16_t*>(buf1));
      B0 = buf0;
      B1 = buf1;
    } else {
      B0 = a_.w + j * g_.panel_bytes + kc0 / kStep * 1024;
      B1 = B0 + g_.panel_bytes;
    }
    // The B chunk used after this one: the next pair, or the first pair of
    // the next K chunk. Its lines go to L2, a few after each k step.
    const uint8_t* pf[2] = {nullptr, nullptr};
    int64_t pf_lines = 0, pf_per_step = 0, pf_done = 0, pf_panel_lines = 0;
    if (p_.prefetch) {
      int64_t nj = j + 2, nk = kc0;
      if (nj >= a_.nb1) {
        nj = a_.nb0;
        nk = kc1;
      }
      if (nk < g_.kp) {
        const int64_t nsteps = (std::min(g_.kp, nk + p_.chunk_k) - nk) / kStep;
        pf[0] = a_.w + nj * g_.panel_bytes + nk / kStep * 1024;
        pf[1] = nj + 1 < a_.nb1 ? pf[0] + g_.panel_bytes : nullptr;
        pf_panel_lines = nsteps * 16;
        pf_lines = pf_panel_lines * (pf[1] != nullptr ? 2 : 1);
        const int64_t slots = (p_.mp / 32) * steps;
        pf_per_step = (pf_lines + slots - 1) / slots;
      }
    }
    auto after_step = [&](int64_t) {
      for (int64_t q = 0; q < pf_per_step && pf_done < pf_lines; ++q, ++pf_done)
        X::PrefetchL2(pf_done < pf_panel_lines ? pf[0] + pf_done * 64
                                               : pf[1] + (pf_done - pf_panel_lines) * 64);
    };
    for (int m0 = 0; m0 < p_.mp; m0 += 32)
      Block(m0, j, B0, B1, two, kc0, steps, p_.stream, false, after_step);
  }

  const GemmArgs& a_;
  const PackedGeom& g_;
  const AmxPlan& p_;
  const uint8_t* A_;
};

template <Kind kKind, class X>
void AmxGemm(const GemmArgs& a) {
  if (a.m <= 0 || a.nb1 <= a.nb0) return;  // nothing to compute (and no 0 divisors below)
  const AmxPlan plan = PlanAmx<kKind>(a);
  AmxRun<kKind, X>(a, plan).Run();
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
    s.native_bf16 = AmxGemm<Kind::kNativeBf16, HwTiles>;
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
    s.native_bf16 = AmxGemm<Kind::kNativeBf16, EmuTiles>;
    return s;
  }();
  return k;
}

}  // namespace hmoe::kern
