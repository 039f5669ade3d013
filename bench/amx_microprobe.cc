// hmoe-amx-microprobe: AMX micro-kernel schedules measured alone, operands
// in L1 or L2, one thread and all threads. Used to choose the schedule of
// the AMX GEMM in expert_service/kernels/kernels_amx.cc; prints each
// schedule's rate as % of the register-only loop (4 independent
// accumulators, the "AMX peak" hmoe-bench-moe reports).
//
// Every variant runs `steps` k steps per rep over tiled operands (1 KiB per
// tile): A tile of row block r at step s lives at A + ((r * sa) + s % sa) KiB,
// B tile of panel p at B + ((p * sb) + s % sb) KiB, so sa / sb pick the
// working set (sa = 8 -> 16 KiB of A for two row blocks: L1; 256 -> 512 KiB:
// L2).
//
// Measurement: every thread alternates the register-only loop and the
// variant in short rounds and keeps, per round, the variant's rate against
// the faster of the two loop timings around it; the figure is the median
// over rounds and threads. On a shared host the AMX rate of a core moves
// for seconds at a time (other tenants); both sides of a round see the same
// conditions, so the ratio repeats where separately timed rates do not.
// After each timing the thread also times a chain of 512 dependent imuls
// (3 cycles each: the core clock in TSC ticks, whatever the AMX unit does);
// "clk" is the median of the clock after the variant over the clock after
// the loop. A schedule that loses rate at an equal clock loses it in the
// core (loads and products sharing the AMX unit, cache misses); one whose
// clock drops with it loses it to the power / frequency limit.
//
// Flags and positional arguments: amx_microprobe_main.cc (--help;
// docs/FLAGS.md). This file is compiled with the AMX flags; the flag parsing
// is not, so that --help runs on any CPU.
//
// --rows asks whether a tile product over fewer rows (C and A tiles
// configured with M < 16 rows, B unchanged) takes less time: the
// register-only loop with M rows against M = 16, adjacent rounds as above,
// one thread and `threads`. Prints the median time per product as a
// fraction of M = 16's (1.00: the rows cost nothing; M/16: proportional).
//
// --pairs finds which logical CPUs share one AMX unit (hyperthread siblings a
// VM may not report): the register-only loop on CPU 0 alone, then on CPU 0
// and CPU c together for every c (and the same from CPU 1); a pair of one
// core runs at ~1x the single rate, two cores at ~2x. Then the loop on one
// CPU per core found vs all CPUs.
//
#include "bench/amx_microprobe.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "expert_service/kernels/amx_tile_config.h"

namespace {

void Configure() { _tile_loadconfig(&hmoe::kern::kTileConfig); }

struct Ops {
  const uint8_t* A;
  const uint8_t* B;
  int64_t sa, sb;  // k steps held per row block / per panel (powers of two)
  int64_t steps;
};

inline const uint8_t* At(const Ops& o, int r, int64_t s) {
  return o.A + (r * o.sa + (s & (o.sa - 1))) * 1024;
}
inline const uint8_t* Bt(const Ops& o, int p, int64_t s) {
  return o.B + (p * o.sb + (s & (o.sb - 1))) * 1024;
}

alignas(64) thread_local uint8_t sink[8][1024];

void ZeroC() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void StoreC() {
  _tile_stored(0, sink[0], 64);
  _tile_stored(1, sink[1], 64);
  _tile_stored(2, sink[2], 64);
  _tile_stored(3, sink[3], 64);
}

// One tile product in the calling template's format: tdpbssd when kI8,
// else tdpbf16ps (the intrinsics need literal register numbers).
#define DP(c, a, b)            \
  do {                         \
    if constexpr (kI8)         \
      _tile_dpbssd(c, a, b);   \
    else                       \
      _tile_dpbf16ps(c, a, b); \
  } while (0)

// Peak: 4 accumulators, no loads.
template <bool kI8>
void Peak4(const Ops& o) {
  ZeroC();
  _tile_loadd(4, o.A, 64);
  _tile_loadd(5, o.A, 64);
  _tile_loadd(6, o.B, 64);
  _tile_loadd(7, o.B, 64);
  for (int64_t s = 0; s < o.steps; ++s) {
    DP(0, 4, 6);
    DP(1, 4, 7);
    DP(2, 5, 6);
    DP(3, 5, 7);
  }
  StoreC();
}

// 6 accumulators, no loads: shows whether 4 chains are latency bound.
void Peak6(const Ops& o) {
  ZeroC();
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(6, o.A, 64);
  _tile_loadd(7, o.B, 64);
  for (int64_t s = 0; s < o.steps; s += 4) {  // 6 per 4 "steps" ~ keep 4 TDP/step
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
  }
  StoreC();
}

// The old kernel step: loads interleaved just before their first use.
template <bool kI8>
void Cur(const Ops& o) {
  ZeroC();
  for (int64_t s = 0; s < o.steps; ++s) {
    _tile_loadd(4, At(o, 0, s), 64);
    _tile_loadd(6, Bt(o, 0, s), 64);
    DP(0, 4, 6);
    _tile_loadd(7, Bt(o, 1, s), 64);
    DP(1, 4, 7);
    _tile_loadd(5, At(o, 1, s), 64);
    DP(2, 5, 6);
    DP(3, 5, 7);
  }
  StoreC();
}

// One k step with its loads grouped at the top; kT1: B loaded by
// tileloaddt1 (kernels_amx.cc HMOE_AMX_STREAM=1).
template <bool kT1>
inline void TopStep(const Ops& o, int64_t s) {
  _tile_loadd(4, At(o, 0, s), 64);
  if constexpr (kT1) {
    _tile_stream_loadd(6, Bt(o, 0, s), 64);
    _tile_stream_loadd(7, Bt(o, 1, s), 64);
  } else {
    _tile_loadd(6, Bt(o, 0, s), 64);
    _tile_loadd(7, Bt(o, 1, s), 64);
  }
  _tile_loadd(5, At(o, 1, s), 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Loads grouped at the top of the step.
template <bool kT1>
void Top(const Ops& o) {
  ZeroC();
  for (int64_t s = 0; s < o.steps; ++s) TopStep<kT1>(o, s);
  StoreC();
}

// Software pipelined: each operand register is reloaded for step s+1 right
// after the last product of step s that reads it.
template <bool kI8>
void Pipe(const Ops& o) {
  ZeroC();
  _tile_loadd(4, At(o, 0, 0), 64);
  _tile_loadd(6, Bt(o, 0, 0), 64);
  _tile_loadd(7, Bt(o, 1, 0), 64);
  _tile_loadd(5, At(o, 1, 0), 64);
  for (int64_t s = 0; s < o.steps; ++s) {
    const int64_t n = s + 1;  // one extra load round at the end: harmless
    DP(0, 4, 6);
    DP(1, 4, 7);
    _tile_loadd(4, At(o, 0, n), 64);
    DP(2, 5, 6);
    _tile_loadd(6, Bt(o, 0, n), 64);
    DP(3, 5, 7);
    _tile_loadd(5, At(o, 1, n), 64);
    _tile_loadd(7, Bt(o, 1, n), 64);
  }
  StoreC();
}

// Pipe with a zig-zag product order so each reloaded register has two
// products between its last read and its next use: step order alternates
// (0,4,6)(1,4,7)(3,5,7)(2,5,6) and (2,5,6)(3,5,7)... handled by unrolling 2.
void Zig(const Ops& o) {
  ZeroC();
  _tile_loadd(4, At(o, 0, 0), 64);
  _tile_loadd(6, Bt(o, 0, 0), 64);
  _tile_loadd(7, Bt(o, 1, 0), 64);
  _tile_loadd(5, At(o, 1, 0), 64);
  for (int64_t s = 0; s < o.steps; s += 2) {
    // even step: A0B0, A0B1 | A0 free; A1B1 | B1 free; A1B0 | A1, B0 free
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(4, At(o, 0, s + 1), 64);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(7, Bt(o, 1, s + 1), 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(5, At(o, 1, s + 1), 64);
    _tile_loadd(6, Bt(o, 0, s + 1), 64);
    // odd step: A0B1 (A0, B1 loaded first), A0B0 | A0 free, A1B0, A1B1
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(4, At(o, 0, s + 2), 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(6, Bt(o, 0, s + 2), 64);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(5, At(o, 1, s + 2), 64);
    _tile_loadd(7, Bt(o, 1, s + 2), 64);
  }
  StoreC();
}

// 1 x 2 C (2 accumulators) with double-buffered A and B: 1.5 loads per
// product, but no load ever waits on a product of the same step.
void Db12(const Ops& o) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(2, At(o, 0, 0), 64);
  _tile_loadd(4, Bt(o, 0, 0), 64);
  _tile_loadd(5, Bt(o, 1, 0), 64);
  for (int64_t s = 0; s < o.steps; s += 2) {
    _tile_loadd(3, At(o, 0, s + 1), 64);
    _tile_loadd(6, Bt(o, 0, s + 1), 64);
    _tile_loadd(7, Bt(o, 1, s + 1), 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
    _tile_loadd(2, At(o, 0, s + 2), 64);
    _tile_loadd(4, Bt(o, 0, s + 2), 64);
    _tile_loadd(5, Bt(o, 1, s + 2), 64);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(1, 3, 7);
  }
  StoreC();
}

// 2x2 with A from L1 only (B loaded, A registers fixed): isolates B loads.
void OnlyB(const Ops& o) {
  ZeroC();
  _tile_loadd(4, At(o, 0, 0), 64);
  _tile_loadd(5, At(o, 1, 0), 64);
  for (int64_t s = 0; s < o.steps; ++s) {
    _tile_loadd(6, Bt(o, 0, s), 64);
    _tile_loadd(7, Bt(o, 1, s), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  StoreC();
}

// The step's four tile loads alone (A, B from the working set), no products:
// the tile-load rate, in k steps, against the loop's product rate.
void Ld4(const Ops& o) {
  for (int64_t s = 0; s < o.steps; ++s) {
    _tile_loadd(4, At(o, 0, s), 64);
    _tile_loadd(6, Bt(o, 0, s), 64);
    _tile_loadd(7, Bt(o, 1, s), 64);
    _tile_loadd(5, At(o, 1, s), 64);
  }
  _tile_stored(4, sink[4], 64);
}

// Top with the C block reloaded every kKc steps, as in the real kernel's K
// chunks: C stored to and loaded back from a 4 KiB buffer (L1). kEdge: the
// stores and reloads interleaved register by register with the first step's
// loads and products (the kernel's former HMOE_AMX_EDGE, removed: a tie).
template <int64_t kKc, bool kEdge>
void Blk(const Ops& o) {
  alignas(64) static thread_local float cbuf[4][256];
  ZeroC();
  for (int64_t s0 = 0; s0 < o.steps; s0 += kKc) {
    int64_t s = s0;
    if (s0 > 0 && kEdge) {
      _tile_stored(0, cbuf[0], 64);
      _tile_loadd(0, cbuf[0], 64);
      _tile_loadd(4, At(o, 0, s), 64);
      _tile_loadd(6, Bt(o, 0, s), 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_stored(1, cbuf[1], 64);
      _tile_loadd(1, cbuf[1], 64);
      _tile_loadd(7, Bt(o, 1, s), 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_stored(2, cbuf[2], 64);
      _tile_loadd(2, cbuf[2], 64);
      _tile_loadd(5, At(o, 1, s), 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_stored(3, cbuf[3], 64);
      _tile_loadd(3, cbuf[3], 64);
      _tile_dpbf16ps(3, 5, 7);
      ++s;
    } else if (s0 > 0) {
      _tile_stored(1, cbuf[1], 64);
      _tile_stored(3, cbuf[3], 64);
      _tile_stored(0, cbuf[0], 64);
      _tile_stored(2, cbuf[2], 64);
      _tile_loadd(0, cbuf[0], 64);
      _tile_loadd(1, cbuf[1], 64);
      _tile_loadd(2, cbuf[2], 64);
      _tile_loadd(3, cbuf[3], 64);
    }
    for (; s < s0 + kKc; ++s) TopStep<false>(o, s);
  }
  StoreC();
}

// One shared 1 GiB region beyond the LLC, for prefetch-pressure variants
// (each thread walks it from a start of its own).
constexpr int64_t kFarBytes = int64_t{1} << 30;
uint8_t* FarRegion() {
  static uint8_t* const far = [] {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, kFarBytes));
    std::memset(p, 1, kFarBytes);
    return p;
  }();
  return far;
}

// Top<true> with the C block stored and reloaded every kKc steps as the kernel
// does at K-chunk boundaries. kLay: 0 C rows strided (1 KiB apart, a
// 16-panel task's C) in a 256 KiB ring (L2); 1 contiguous tiles in one 4 KiB
// buffer (L1); 2 contiguous tiles in the ring (the removed HMOE_AMX_CTMP's). kPf
// software prefetches (T1) per step of lines from FarRegion(): the
// fill-buffer pressure of prefetching the next chunk. kPfC: the next block's
// 64 C lines prefetched into L1 (T0) over the block's steps.
template <int64_t kKc, int kLay, int kPf, bool kPfC = false>
void Chunked(const Ops& o) {
  constexpr int64_t kRing = 8, kSlot = 32 * 256;  // floats: 32 rows x 1 KiB
  alignas(64) static thread_local float ring[kRing * kSlot];
  uint8_t* const far = kPf > 0 ? FarRegion() : nullptr;
  static thread_local int64_t far_off =
      static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()) %
                           (kFarBytes / 64)) *
      64;
  // Tile i of the C block at `base`, and its row stride in bytes.
  constexpr int64_t kStride = kLay == 0 ? 1024 : 64;
  auto tile = [](float* base, int i) {
    return kLay == 0 ? base + (i >= 2 ? 16 * 256 : 0) + (i % 2 == 1 ? 16 : 0) : base + i * 256;
  };
  auto slot = [&](int64_t b) { return kLay == 1 ? ring : ring + (b % kRing) * kSlot; };
  ZeroC();
  int64_t blk = 0;
  for (int64_t s0 = 0; s0 < o.steps; s0 += kKc, ++blk) {
    if (s0 > 0) {
      float* c = slot(blk);
      float* d = slot(blk + 1);
      _tile_stored(0, tile(c, 0), kStride);
      _tile_stored(1, tile(c, 1), kStride);
      _tile_stored(2, tile(c, 2), kStride);
      _tile_stored(3, tile(c, 3), kStride);
      _tile_loadd(0, tile(d, 0), kStride);
      _tile_loadd(1, tile(d, 1), kStride);
      _tile_loadd(2, tile(d, 2), kStride);
      _tile_loadd(3, tile(d, 3), kStride);
    }
    float* const nc = slot(blk + 2);  // C loaded at the next boundary
    for (int64_t s = s0; s < s0 + kKc && s < o.steps; ++s) {
      TopStep<true>(o, s);
      if constexpr (kPfC) {
        // 64 lines over kKc steps, tile by tile, rows in order.
        for (int64_t l = (s - s0) * 64 / kKc; l < (s - s0 + 1) * 64 / kKc; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(tile(nc, static_cast<int>(l / 16))) +
                           (l % 16) * kStride,
                       _MM_HINT_T0);
      }
      for (int q = 0; q < kPf; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(far + far_off), _MM_HINT_T1);
        far_off = (far_off + 64) % kFarBytes;
      }
    }
  }
  StoreC();
}

struct Variant {
  const char* name;
  void (*fn)(const Ops&);
  double tdp_per_step;
};

// One probe thread's setup: pinned to `cpu`, its own A and B (sa / sb k
// steps per row block / panel, see Ops), tiles configured; released on exit.
class ThreadOperands {
 public:
  ThreadOperands(int cpu, int seed, int64_t sa, int64_t sb, int64_t steps) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    const int64_t abytes = 2 * (sa + 2) * 1024, bbytes = 2 * (sb + 2) * 1024;
    a_ = static_cast<uint8_t*>(std::aligned_alloc(4096, (abytes + 4095) / 4096 * 4096));
    b_ = static_cast<uint8_t*>(std::aligned_alloc(4096, (bbytes + 4095) / 4096 * 4096));
    for (int64_t i = 0; i < abytes; ++i) a_[i] = static_cast<uint8_t>((i * 7 + seed) & 0x3f);
    for (int64_t i = 0; i < bbytes; ++i) b_[i] = static_cast<uint8_t>((i * 13 + seed) & 0x3f);
    Configure();
    ops_ = Ops{a_, b_, sa, sb, steps};
  }
  ~ThreadOperands() {
    _tile_release();
    std::free(a_);
    std::free(b_);
  }
  ThreadOperands(const ThreadOperands&) = delete;
  ThreadOperands& operator=(const ThreadOperands&) = delete;
  const Ops& ops() const { return ops_; }

 private:
  uint8_t* a_ = nullptr;
  uint8_t* b_ = nullptr;
  Ops ops_{};
};

// Core clock over TSC: 512 dependent 3-cycle imuls timed with rdtsc, fenced
// so the chain starts after what came before has issued.
double ClockPerTsc() {
  uint64_t x = 3;
  _mm_lfence();
  const uint64_t t0 = __rdtsc();
  _mm_lfence();
  for (int i = 0; i < 64; ++i)
    asm volatile(
        "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
        "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0"
        : "+r"(x));
  _mm_lfence();
  const uint64_t t1 = __rdtsc();
  return 1536.0 / static_cast<double>(t1 - t0);
}

// Rates summed over threads; *clock (if set): the mean core clock over TSC
// measured just after each thread's last rep.
double RunOnCpus(const std::vector<int>& cpus, const Variant& v, int64_t sa, int64_t sb,
                 double seconds, double* clock = nullptr) {
  const int nthreads = static_cast<int>(cpus.size());
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> rate(nthreads), clk(nthreads);
  std::vector<std::thread> th;
  for (int t = 0; t < nthreads; ++t) {
    th.emplace_back([&, t] {
      const ThreadOperands to(cpus[static_cast<size_t>(t)], t, sa, sb, 4096);
      const Ops& o = to.ops();
      v.fn(o);  // warm
      ready.fetch_add(1);
      while (!go.load()) {
      }
      int64_t reps = 0;
      const auto t0 = std::chrono::steady_clock::now();
      double el = 0;
      do {
        for (int i = 0; i < 8; ++i) v.fn(o);
        reps += 8;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } while (el < seconds);
      clk[t] = ClockPerTsc();
      // One tile product: 16x16x32 bf16 MACs or 16x16x64 int8 MACs.
      const double ops = std::string(v.name).find("i8") != std::string::npos ? 32768.0 : 16384.0;
      rate[t] = reps * o.steps * v.tdp_per_step * ops / el;
    });
  }
  while (ready.load() < nthreads) {
  }
  go.store(true);
  for (auto& x : th) x.join();
  double sum = 0;
  for (double r : rate) sum += r;
  if (clock != nullptr) {
    *clock = 0;
    for (double c : clk) *clock += c / nthreads;
  }
  return sum;
}

double RunThreads(int nthreads, const Variant& v, int64_t sa, int64_t sb, double seconds,
                  double* clock = nullptr) {
  std::vector<int> cpus(static_cast<size_t>(nthreads));
  for (int t = 0; t < nthreads; ++t) cpus[static_cast<size_t>(t)] = t;
  return RunOnCpus(cpus, v, sa, sb, seconds, clock);
}

struct Adjacent {
  double rate = 0, clock = 0;  // medians: variant / loop
};

// The adjacent-round measurement (see the header): median over rounds and
// threads of the variant's rate against the faster of the reference loop's
// timings just before and after it (same k steps, rates per tile product).
Adjacent RunAdjacent(int nthreads, const Variant& v, const Variant& ref, int64_t sa, int64_t sb,
                     double seconds) {
  std::vector<std::vector<double>> ratios(static_cast<size_t>(nthreads)),
      clocks(static_cast<size_t>(nthreads));
  std::vector<std::thread> th;
  for (int t = 0; t < nthreads; ++t) {
    th.emplace_back([&, t] {
      const ThreadOperands to(t, t, sa, sb, 2048);
      const Ops& o = to.ops();
      v.fn(o);  // warm
      // Seconds per tile product of x, and the clock just after it.
      auto timed = [&](const Variant& x, double* clock) {
        const auto t0 = std::chrono::steady_clock::now();
        x.fn(o);
        const double el =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        *clock = ClockPerTsc();
        return el / x.tdp_per_step;
      };
      std::vector<double>& out = ratios[static_cast<size_t>(t)];
      std::vector<double>& clk = clocks[static_cast<size_t>(t)];
      const auto start = std::chrono::steady_clock::now();
      double c_before = 0, c_v = 0, c_after = 0;
      double before = timed(ref, &c_before);
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
                 seconds ||
             out.size() < 20) {
        const double tv = timed(v, &c_v);
        const double after = timed(ref, &c_after);
        out.push_back(std::min(before, after) / tv);
        clk.push_back(c_v / std::max(c_before, c_after));
        before = after;
        c_before = c_after;
      }
    });
  }
  for (auto& x : th) x.join();
  auto median = [](const std::vector<std::vector<double>>& per_thread) {
    std::vector<double> all;
    for (const auto& r : per_thread) all.insert(all.end(), r.begin(), r.end());
    std::sort(all.begin(), all.end());
    return all[all.size() / 2];
  };
  return Adjacent{median(ratios), median(clocks)};
}

// --pairs: see the header.
int Pairs(const Variant& peak, double secs) {
  const int n = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  std::vector<int> seen(static_cast<size_t>(n), -1);  // seen[c]: a CPU sharing c's AMX unit
  for (int base : {0, 1}) {
    if (base >= n) break;
    const double one = RunOnCpus({base}, peak, 4, 4, secs);
    std::printf("## CPU %d alone: %.2f TFLOP/s; with CPU c (ratio to alone):", base, one / 1e12);
    for (int c = 0; c < n; ++c) {
      if (c == base) continue;
      const double two = RunOnCpus({base, c}, peak, 4, 4, secs);
      std::printf(" %d:%.2f", c, two / one);
      if (two / one < 1.5 && seen[static_cast<size_t>(c)] < 0) seen[static_cast<size_t>(c)] = base;
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  // One CPU per core, for the two layouts hypervisors use: siblings adjacent
  // (0,1), (2,3), ... or half the count apart (0,n/2), (1,n/2+1), ...
  int partner = -1;
  for (int c = 1; c < n; ++c)
    if (seen[static_cast<size_t>(c)] == 0) partner = c;
  std::vector<int> picks;
  for (int c = 0; c < n; ++c)
    if (partner < 0 || (partner == 1 && c % 2 == 0) || (partner == n / 2 && c < n / 2))
      picks.push_back(c);
  std::vector<int> all(static_cast<size_t>(n));
  for (int c = 0; c < n; ++c) all[static_cast<size_t>(c)] = c;
  const double r_all = RunOnCpus(all, peak, 4, 4, secs),
               r_picks = RunOnCpus(picks, peak, 4, 4, secs);
  std::printf("## register loop on all %d CPUs: %.2f TFLOP/s; on %zu CPUs (", n, r_all / 1e12,
              picks.size());
  for (size_t i = 0; i < picks.size(); ++i) std::printf("%s%d", i ? "," : "", picks[i]);
  std::printf("): %.2f TFLOP/s\n", r_picks / 1e12);
  return 0;
}

// --rows: the register-only loop with the C and A tiles (registers 0-5)
// configured to M rows; M = 16 is the usual configuration.
constexpr hmoe::kern::TileConfig RowsConfig(int m) {
  hmoe::kern::TileConfig c = hmoe::kern::MakeTileConfig();
  for (int t = 0; t < 6; ++t) c.rows[t] = static_cast<uint8_t>(m);
  return c;
}
template <int M, bool kI8>
void Peak4Rows(const Ops& o) {
  alignas(64) static constexpr hmoe::kern::TileConfig kCfg = RowsConfig(M);
  _tile_loadconfig(&kCfg);
  Peak4<kI8>(o);
}

// --rows: see the header. Adjacent rounds (RunAdjacent) of M rows against
// M = 16; the printed figure is the time per product over M = 16's.
int Rows(int max_threads, double secs) {
  struct Case {
    int m;
    Variant v, ref;
  };
  const Case cases[] = {
      {8, {"peak4", Peak4Rows<8, false>, 4}, {"peak4", Peak4Rows<16, false>, 4}},
      {8, {"peak4-i8", Peak4Rows<8, true>, 4}, {"peak4-i8", Peak4Rows<16, true>, 4}},
      {4, {"peak4", Peak4Rows<4, false>, 4}, {"peak4", Peak4Rows<16, false>, 4}},
      {4, {"peak4-i8", Peak4Rows<4, true>, 4}, {"peak4-i8", Peak4Rows<16, true>, 4}},
      {1, {"peak4", Peak4Rows<1, false>, 4}, {"peak4", Peak4Rows<16, false>, 4}},
      {1, {"peak4-i8", Peak4Rows<1, true>, 4}, {"peak4-i8", Peak4Rows<16, true>, 4}},
  };
  for (const int nthreads : {1, max_threads}) {
    for (const Case& c : cases) {
      const Adjacent r = RunAdjacent(nthreads, c.v, c.ref, 4, 4, secs);
      std::printf("rows  threads %2d  %-9s M=%2d: time per product %.3f of M=16's (M/16 = %.3f)\n",
                  nthreads, c.v.name, c.m, 1.0 / r.rate, c.m / 16.0);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int hmoe::amx_probe::Run(Mode mode, int nthreads, double secs) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "no XTILEDATA permission\n");
    return 1;
  }
  const Variant peak{"peak4", Peak4<false>, 4}, peak6{"peak6", Peak6, 4},
      peaki8{"peak4-i8", Peak4<true>, 4};
  if (mode == Mode::kPairs) return Pairs(peak, secs);
  if (mode == Mode::kRows) return Rows(nthreads, secs);
  const Variant vs[] = {{"cur", Cur<false>, 4},
                        {"top", Top<false>, 4},
                        {"pipe", Pipe<false>, 4},
                        {"zig", Zig, 4},
                        {"db12", Db12, 2},
                        {"onlyB", OnlyB, 4},
                        {"ld4", Ld4, 4},
                        {"pipe-i8", Pipe<true>, 4},
                        {"cur-i8", Cur<true>, 4},
                        {"blk8", Blk<8, false>, 4},
                        {"blk16", Blk<16, false>, 4},
                        {"blk32", Blk<32, false>, 4},
                        {"blkE8", Blk<8, true>, 4},
                        {"blkE16", Blk<16, true>, 4},
                        {"blkE32", Blk<32, true>, 4},
                        {"topT1", Top<true>, 4},
                        {"ch16", Chunked<16, 0, 0>, 4},
                        {"ch16L1", Chunked<16, 1, 0>, 4},
                        {"ch16ct", Chunked<16, 2, 0>, 4},
                        {"ch32", Chunked<32, 0, 0>, 4},
                        {"ch16pf4", Chunked<16, 0, 4>, 4},
                        {"ch16pf9", Chunked<16, 0, 9>, 4},
                        {"ch16pc", Chunked<16, 0, 0, true>, 4},
                        {"ch16ctpc", Chunked<16, 2, 0, true>, 4}};
  struct Ws {
    const char* name;
    int64_t sa, sb;
  } ws[] = {
      {"A L1 B L1", 4, 4}, {"A L2 B L1", 256, 4}, {"A L1 B L2", 4, 256}, {"A L2 B L2", 128, 128}};
  for (int nt : {1, nthreads}) {
    double clk = 0;
    const double p4 = RunThreads(nt, peak, 4, 4, secs, &clk);
    const double p6 = RunThreads(nt, peak6, 4, 4, secs);
    const double pi8 = RunThreads(nt, peaki8, 4, 4, secs);
    std::printf(
        "## threads %d: peak4 %.2f TFLOP/s (%.0f GFLOP/s/core, clock %.3f x TSC), peak6 %.2f, "
        "peak4-i8 %.2f TOP/s (rates summed over threads); rows: %% of the adjacent peak4 "
        "(peak4-i8) loop, clk = clock after the row's schedule / after the loop\n",
        nt, p4 / 1e12, p4 / nt / 1e9, clk, p6 / 1e12, pi8 / 1e12);
    for (const Variant& v : vs) {
      std::printf("%-10s", v.name);
      const bool i8 = std::string(v.name).find("i8") != std::string::npos;
      for (const Ws& w : ws) {
        const Adjacent r = RunAdjacent(nt, v, i8 ? peaki8 : peak, w.sa, w.sb, secs);
        std::printf(" | %s %6.1f%% clk %5.3f", w.name, 100.0 * r.rate, r.clock);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
