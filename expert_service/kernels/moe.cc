// RunMoe: a call is planned, then run. The plan (moe_plan.h: PlanMoe, on the
// caller's thread) routes the slots to rows per expert, picks each expert's
// regime and lays out the work below; MoeCall runs it in one pool.Run:
//   xquant   (int8 activations, T >= 32) each token quantized once
//   gather   rows of x per expert (bf16, or int8 quantized per token); the
//            AMX experts' rows in the tile layout (gemm.h GemmArgs::a_tiled)
//   gate_up  tasks (part, expert, panel-pair chunk, row chunk) -> h = SiLU(g)*u
//   hquant   (int8 activations) per-row scale over all parts' h, quantize
//   down     tasks (part, expert, panel chunk, row chunk) -> y_part[row]
//   reduce   out[t] = sum_j w[t][j] * sum_part y_part[row(t, j)], one
//            weighted_sum over all of a token's rows, out written once
// A spin barrier among the pool's workers follows xquant and precedes
// reduce. In between, gather, gate_up, hquant and down run as one stage
// ordered by per-expert dependencies (an expert's rows gathered before its
// gate_up tasks; all its gate_up tasks, then its hquant, before its down
// tasks), so the memory-bound steps of one expert overlap the GEMMs of
// others.
#include "expert_service/kernels/moe.h"

#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/moe_plan.h"

namespace hmoe {

using kern::AnyInt8Act;
using kern::Int8Act;
using kern::MoePlan;
using kern::RowItem;
using kern::Task;

namespace {

constexpr int64_t kCbufFloats = kern::kMaxRowChunk * MoeTuning::kMaxTaskPanels * 16;
constexpr int64_t kGatherAhead = 2;  // gather this many experts past the one needed

// The kernel sets of one call: "few" (GEMV) and "many" experts, and whether
// the many kernels read A in the AMX tile layout.
struct Dispatch {
  const kern::KernelSet* few;
  const kern::KernelSet* many;
  bool tiled;
  const kern::KernelSet& For(bool m) const { return m ? *many : *few; }
};

Dispatch DispatchFor(Isa isa, bool emulate_amx) {
  switch (isa) {
    case Isa::kAmx:
      return {&kern::Avx512Kernels(), &kern::AmxKernels(), true};
    case Isa::kAvx512:
      if (emulate_amx) return {&kern::Avx512Kernels(), &kern::AmxEmulatedKernels(), true};
      return {&kern::Avx512Kernels(), &kern::Avx512Kernels(), false};
    case Isa::kAvx2:
      return {&kern::Avx2Kernels(), &kern::Avx2Kernels(), false};
    case Isa::kScalar:
      break;
  }
  return {&kern::ScalarKernels(), &kern::ScalarKernels(), false};
}

// Row r of a tile-layout buffer (blocks of 16 rows counted from `row0`, the
// expert's first row; `ld` bytes per row): where k step 0 of that row lives.
// Step s is at +1024 s.
inline uint8_t* TiledRow(uint8_t* buf, int64_t ld, int64_t row0, int64_t r) {
  const int64_t i = (r - row0) % 16;
  return buf + (r - i) * ld + i * 64;
}

kern::GemmFn GemmFor(const kern::KernelSet& k, WeightFormat f, bool many) {
  switch (f) {
    case WeightFormat::kBf16:
      return k.bf16;
    case WeightFormat::kInt8:
      return k.i8;
    case WeightFormat::kInt4:
      return many ? k.i4_bf16 : k.i4_i8;
    case WeightFormat::kMxfp4:
    case WeightFormat::kInt4Bf16:
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8:
      return many ? k.native_bf16 : k.native;
  }
  return nullptr;
}

class SpinBarrier {
 public:
  void Reset(int n) {
    n_ = n;
    count_.store(0);
    gen_.store(0);
  }
  void Wait() {
    const uint32_t g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(g + 1, std::memory_order_release);
      return;
    }
    while (gen_.load(std::memory_order_acquire) == g) __builtin_ia32_pause();
  }

 private:
  int n_ = 0;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<uint32_t> gen_{0};
};

// Work counters (MoeWorkspace::Impl::counters): gather items, reduce items,
// xquant tokens, and part p's stage tasks at kPartTasks + 2 p.
enum Counter : size_t { kGatherItems = 0, kReduceItems = 2, kXquantTokens = 3, kPartTasks = 8 };

// Scheduling knobs: MoeTuning (tuning.h). What the measurements said:
//   HMOE_MOE_TASK_PANELS = 2..32: panels per gate_up / down task at most
//     (default 16). More panels: fewer re-reads of an expert's rows from L3,
//     larger B chunks and C blocks in L2. Run 6: 32 lost to 16 in 6 of 6
//     reps; 32 with kc 512 was mixed.
//   HMOE_MOE_GATHER_STREAM = 0 | 1: 1 (default) writes the gathered
//     activations (tile layout) with streaming stores; 0 with ordinary
//     stores, so the gate_up tasks of the expert find them in L2 / L3
//     instead of DRAM.
//   HMOE_MOE_LOOKAHEAD = 0 | 1: gate_up / down workers claim one task ahead
//     and pass it to the kernel, which prefetches its first K chunk into L2
//     during the current task's last chunk (the one chunk no other prefetch
//     covers: half of an int8 down task's weights; calls of <= 32 rows, which
//     run the AMX kernel's order 0, do not use it). Default 1: run 6 (slow
//     grants) within noise; run 9 (a grant where the GEMMs ran fastest),
//     ds-v3 int8 T=8192, 3 interleaved reps: 224-227 ms vs 248-268 off.
// Measured slower and removed (bench/results/README.md): a barrier after
// each step instead of the dependency-driven stage (run 7), the reduce
// overlapped with the down tasks in column waves (run 9), down tasks storing
// C straight into y (runs 6 and 9).
inline double Secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

const char* MoePhaseProfile::Name(int phase) {
  static const char* const kNames[kPhases] = {"route", "wake", "xquant", "stage", "reduce", "join"};
  return phase >= 0 && phase < kPhases ? kNames[phase] : "?";
}

std::string MoePhaseProfile::ToString() const {
  if (calls == 0) return "no calls";
  std::string s = absl::StrCat(calls, " calls, us per call:");
  for (int i = 0; i < kPhases; ++i)
    absl::StrAppend(
        &s, " ", Name(i), " ",
        static_cast<int64_t>(std::lround(seconds[i] / static_cast<double>(calls) * 1e6)));
  return s;
}

struct MoeWorkspace::Impl {
  int64_t max_tokens = 0;
  int max_top_k = 0;
  int64_t hidden = 0, kp_h = 0, n_local = 0, max_rows = 0, gmax = 0;
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
  int nparts = 0;
  int64_t threads = 0;
  std::vector<int> node_threads;                    // the pool's threads per node
  int64_t scratch_bytes = kern::kGemmScratchBytes;  // per thread
  MoePhaseProfile profile;                          // MoeTuning::profile

  MoePlan plan;  // the current call's
  // The stage's dependencies, per local expert: row items not yet gathered,
  // gate_up tasks not yet done (all parts), whether its down tasks may run.
  std::vector<std::atomic<int32_t>> gather_left, gu_left, down_ready;
  // x, gathered per row: bf16 or int8 rows of kp_h (row stride kp_h * 2 bytes)
  NumaBuffer xa;
  std::vector<float> xa_scale;
  std::vector<int32_t> xa_gsum;  // [row][kp_h / group]
  // x quantized once per token (int8 activations, large T): [token][kp_h]
  NumaBuffer xt;
  std::vector<float> xt_scale;
  std::vector<int32_t> xt_gsum;  // [token][kp_h / group]
  struct PartBufs {
    int64_t kp_i = 0, groups = 0;
    NumaBuffer h;   // [row][kp_i] f32 (bf16 rows use the first half)
    NumaBuffer hq;  // [row][kp_i] int8
    std::vector<int32_t> hgsum;
    NumaBuffer y;  // [row][hidden] f32
  };
  std::vector<PartBufs> parts;
  std::vector<float> h_scale;             // per row (shared by parts)
  std::vector<NumaBuffer> cbuf, scratch;  // per thread
  // reduce: a token's y rows and weights, [thread][max_top_k * nparts]
  std::vector<const float*> sum_rows;
  std::vector<float> sum_wts;
  // memory nodes of the buffers (node_bytes)
  int node0 = 0;
  std::vector<int> part_node, thread_node;
  std::vector<std::atomic<int64_t>> counters;  // Counter
  SpinBarrier barrier;
};

MoeWorkspace::~MoeWorkspace() = default;

MoePhaseProfile MoeWorkspace::TakeProfile() {
  MoePhaseProfile p = impl_->profile;
  impl_->profile = MoePhaseProfile();
  return p;
}

std::map<int, int64_t> MoeWorkspace::NodeBytes(const PackedMoeLayer& layer, int64_t max_tokens,
                                               int max_top_k, const ThreadPool& pool) {
  // The NumaBuffers Create allocates (page-rounded), by memory node.
  std::map<int, int64_t> out;
  auto add = [&](int node, int64_t bytes) {
    if (bytes > 0) out[node] += (bytes + 4095) / 4096 * 4096;
  };
  if (layer.parts().empty() || max_tokens <= 0 || max_top_k <= 0) return out;
  const int64_t slots = max_tokens * max_top_k;
  const int64_t R = slots + 32 * std::min<int64_t>(layer.num_local_experts(), slots);
  const int64_t kp_h = layer.parts()[0].gu.kp;
  add(pool.mem_node(0), R * kp_h * 2);
  const bool i8 = AnyInt8Act(layer.format());  // xt and hq: int8 activations only
  if (i8) add(pool.mem_node(0), max_tokens * kp_h);
  int64_t scratch = kern::kGemmScratchBytes;
  for (size_t p = 0; p < layer.parts().size(); ++p) {
    const int64_t kp_i = layer.parts()[p].down.kp;
    scratch = std::max({scratch, 16 * kp_i, kCbufFloats * 4});
    const int node = pool.mem_node(static_cast<int>(p));
    add(node, R * kp_i * 4);
    if (i8) add(node, R * kp_i);
    add(node, R * layer.hidden() * 4);
  }
  for (int p = 0; p < pool.num_nodes(); ++p)
    for (int i = 0; i < pool.node_threads(p); ++i) {
      add(pool.mem_node(p), kCbufFloats * 4);
      add(pool.mem_node(p), scratch);
    }
  return out;
}

std::map<int, int64_t> MoeWorkspace::node_bytes() const {
  const Impl& w = *impl_;
  std::map<int, int64_t> out;
  auto add = [&](const NumaBuffer& b, int node) {
    if (b.size() > 0) out[node] += static_cast<int64_t>(b.size());
  };
  add(w.xa, w.node0);
  add(w.xt, w.node0);
  for (size_t p = 0; p < w.parts.size(); ++p) {
    add(w.parts[p].h, w.part_node[p]);
    add(w.parts[p].hq, w.part_node[p]);
    add(w.parts[p].y, w.part_node[p]);
  }
  for (size_t t = 0; t < w.cbuf.size(); ++t) {
    add(w.cbuf[t], w.thread_node[t]);
    add(w.scratch[t], w.thread_node[t]);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MoeWorkspace>> MoeWorkspace::Create(const PackedMoeLayer& layer,
                                                                   int64_t max_tokens,
                                                                   int max_top_k,
                                                                   ThreadPool& pool) {
  if (max_tokens <= 0 || max_top_k <= 0)
    return absl::InvalidArgumentError("max_tokens and max_top_k must be > 0");
  if (static_cast<int>(layer.parts().size()) != pool.num_nodes())
    return absl::InvalidArgumentError(absl::StrCat("layer has ", layer.parts().size(),
                                                   " node parts but the pool has ",
                                                   pool.num_nodes(), " nodes"));
  std::unique_ptr<MoeWorkspace> ws(new MoeWorkspace());
  ws->impl_ = std::make_unique<Impl>();
  Impl& w = *ws->impl_;
  w.max_tokens = max_tokens;
  w.max_top_k = max_top_k;
  w.hidden = layer.hidden();
  w.format = layer.format();
  w.group = layer.group();
  w.n_local = layer.num_local_experts();
  w.nparts = static_cast<int>(layer.parts().size());
  w.threads = pool.num_threads();
  for (int n = 0; n < pool.num_nodes(); ++n) w.node_threads.push_back(pool.node_threads(n));
  const int64_t slots = max_tokens * max_top_k;
  w.max_rows = slots + 32 * std::min<int64_t>(w.n_local, slots);  // + padding to 32 rows
  const auto& p0 = layer.parts()[0];
  w.kp_h = p0.gu.kp;
  w.gmax = IsGrouped(w.format) ? w.kp_h / w.group : 0;
  const size_t E = static_cast<size_t>(w.n_local), R = static_cast<size_t>(w.max_rows);
  w.plan.Reserve(layer, slots, w.max_rows);
  w.gather_left = std::vector<std::atomic<int32_t>>(E);
  w.gu_left = std::vector<std::atomic<int32_t>>(E);
  w.down_ready = std::vector<std::atomic<int32_t>>(E);
  w.node0 = pool.mem_node(0);
  ASSIGN_OR_RETURN(w.xa,
                   NumaBuffer::Allocate(R * static_cast<size_t>(w.kp_h) * 2, pool.mem_node(0)));
  // The int8 activations' rows, scales and group sums: only for the formats
  // whose calls take them (bf16 and the native formats never do).
  const bool i8 = AnyInt8Act(w.format);
  if (i8) {
    w.xa_scale.resize(R);
    w.xa_gsum.resize(R * static_cast<size_t>(std::max<int64_t>(w.gmax, 1)));
    ASSIGN_OR_RETURN(
        w.xt, NumaBuffer::Allocate(static_cast<size_t>(max_tokens * w.kp_h), pool.mem_node(0)));
    w.xt_scale.resize(static_cast<size_t>(max_tokens));
    w.xt_gsum.resize(static_cast<size_t>(max_tokens * std::max<int64_t>(w.gmax, 1)));
    w.h_scale.resize(R);
  }
  w.parts.resize(static_cast<size_t>(w.nparts));
  for (int p = 0; p < w.nparts; ++p) {
    const auto& lp = layer.parts()[static_cast<size_t>(p)];
    auto& b = w.parts[static_cast<size_t>(p)];
    b.kp_i = lp.down.kp;
    // hquant stages 16 int8 rows; staged int4 "many" tasks keep two K chunks
    // of up to kMaxTaskPanels bf16 panels (2 x 32 x 16 KiB, kernels_amx.cc).
    w.scratch_bytes = std::max({w.scratch_bytes, 16 * b.kp_i, kCbufFloats * 4});
    b.groups = IsGrouped(w.format) ? b.kp_i / w.group : 0;
    const int node = pool.mem_node(p);
    w.part_node.push_back(node);
    ASSIGN_OR_RETURN(b.h, NumaBuffer::Allocate(R * static_cast<size_t>(b.kp_i) * 4, node));
    if (i8) {
      ASSIGN_OR_RETURN(b.hq, NumaBuffer::Allocate(R * static_cast<size_t>(b.kp_i), node));
      b.hgsum.resize(R * static_cast<size_t>(std::max<int64_t>(b.groups, 1)));
    }
    ASSIGN_OR_RETURN(b.y, NumaBuffer::Allocate(R * static_cast<size_t>(w.hidden) * 4, node));
  }
  w.cbuf.resize(static_cast<size_t>(w.threads));
  w.scratch.resize(static_cast<size_t>(w.threads));
  w.sum_rows.resize(static_cast<size_t>(w.threads * w.max_top_k * w.nparts));
  w.sum_wts.resize(w.sum_rows.size());
  int t = 0;
  for (int p = 0; p < pool.num_nodes(); ++p)
    for (int i = 0; i < pool.node_threads(p); ++i, ++t) {
      w.thread_node.push_back(pool.mem_node(p));
      ASSIGN_OR_RETURN(w.cbuf[static_cast<size_t>(t)],
                       NumaBuffer::Allocate(kCbufFloats * 4, pool.mem_node(p)));
      ASSIGN_OR_RETURN(
          w.scratch[static_cast<size_t>(t)],
          NumaBuffer::Allocate(static_cast<size_t>(w.scratch_bytes), pool.mem_node(p)));
    }
  w.counters = std::vector<std::atomic<int64_t>>(static_cast<size_t>(8 + 2 * w.nparts));
  // Fault the large buffers in now (in parallel; placement follows each
  // buffer's node binding), not on the first calls: at ds-v3 T=8192 the y
  // buffers alone are ~1.9 GB, and profiles that include the first calls
  // averaged ~1.7x the steady-state call time.
  std::vector<NumaBuffer*> big = {&w.xa, &w.xt};
  for (auto& b : w.parts) big.insert(big.end(), {&b.h, &b.hq, &b.y});
  constexpr int64_t kTouch = int64_t{2} << 20;
  std::vector<std::pair<NumaBuffer*, int64_t>> pieces;
  for (NumaBuffer* b : big)
    for (int64_t off = 0; off < static_cast<int64_t>(b->size()); off += kTouch)
      pieces.emplace_back(b, off);
  pool.ParallelFor(static_cast<int64_t>(pieces.size()), [&](int64_t i, const Worker&) {
    auto [b, off] = pieces[static_cast<size_t>(i)];
    std::memset(
        b->data() + off, 0,
        static_cast<size_t>(std::min<int64_t>(kTouch, static_cast<int64_t>(b->size()) - off)));
  });
  return ws;
}

namespace {

// The workspace's buffers are sized and strided for one layer shape and one
// pool layout; anything else would overrun them.
absl::Status CheckWorkspaceFits(const PackedMoeLayer& layer, const ThreadPool& pool,
                                const MoeWorkspace::Impl& w) {
  auto mismatch = [](std::string_view what, int64_t layer_or_pool, int64_t made_for) {
    return absl::InvalidArgumentError(absl::StrCat("workspace was made for a differently shaped ",
                                                   std::string(what), ": ", layer_or_pool,
                                                   " here, ", made_for, " in the workspace"));
  };
  if (layer.hidden() != w.hidden) return mismatch("layer (hidden)", layer.hidden(), w.hidden);
  if (layer.format() != w.format || layer.group() != w.group)
    return absl::InvalidArgumentError(
        absl::StrCat("workspace was made for a differently shaped layer (format/group): ",
                     std::string(WeightFormatName(layer.format())), "/", layer.group(), " here, ",
                     std::string(WeightFormatName(w.format)), "/", w.group, " in the workspace"));
  if (layer.num_local_experts() != w.n_local)
    return mismatch("layer (local experts)", layer.num_local_experts(), w.n_local);
  if (static_cast<int>(layer.parts().size()) != w.nparts)
    return mismatch("layer (node parts)", static_cast<int64_t>(layer.parts().size()), w.nparts);
  for (int p = 0; p < w.nparts; ++p) {
    const auto& lp = layer.parts()[static_cast<size_t>(p)];
    if (lp.gu.kp != w.kp_h) return mismatch("layer (padded hidden)", lp.gu.kp, w.kp_h);
    const int64_t kp_i = w.parts[static_cast<size_t>(p)].kp_i;
    if (lp.down.kp != kp_i) return mismatch("layer (padded intermediate slice)", lp.down.kp, kp_i);
  }
  if (pool.num_nodes() != w.nparts) return mismatch("pool (nodes)", pool.num_nodes(), w.nparts);
  for (int n = 0; n < pool.num_nodes(); ++n)
    if (pool.node_threads(n) != w.node_threads[static_cast<size_t>(n)])
      return mismatch("pool (threads per node)", pool.node_threads(n),
                      w.node_threads[static_cast<size_t>(n)]);
  return absl::OkStatus();
}

}  // namespace

int ManyThreshold(WeightFormat f, const RunOptions& opts) {
  return f == WeightFormat::kInt4 || IsNativeFormat(f) ? opts.many_threshold_int4
                                                       : opts.many_threshold;
}

absl::StatusOr<Isa> EffectiveIsa(const RunOptions& opts) {
  return ResolveIsa(opts.isa, opts.strict_isa);
}

namespace {

// One call's execution: the plan's items and tasks, run by every worker of
// the pool (Work). Only the workspace's buffers and counters change while
// it runs.
class MoeCall {
 public:
  MoeCall(const PackedMoeLayer& layer, const MoeInput& in, float* out, MoeWorkspace::Impl& w,
          const RunOptions& opts, const Dispatch& dsp)
      : layer_(layer),
        in_(in),
        out_(out),
        w_(w),
        plan_(w.plan),
        opts_(opts),
        tuning_(opts.tuning.moe),
        dsp_(dsp),
        kfew_(*dsp.few),
        fmt_(layer.format()),
        G_(layer.group()),
        H_(layer.hidden()),
        T_(in.tokens),
        K_(in.top_k),
        kp_h_(w.kp_h),
        xa_ld_(w.kp_h * 2),
        gsum_ld_(std::max<int64_t>(w.gmax, 1)) {}

  // Sets the counters, the barrier and the stage's dependencies for a run of
  // the (planned) call; on the caller's thread, before pool.Run.
  void Reset(int nthreads) {
    for (size_t pos = 0; pos < plan_.active.size(); ++pos) {
      const size_t e = static_cast<size_t>(plan_.active[pos]);
      const int64_t items = plan_.item_end[pos] - (pos == 0 ? 0 : plan_.item_end[pos - 1]);
      w_.gather_left[e].store(static_cast<int32_t>(items), std::memory_order_relaxed);
      w_.gu_left[e].store(plan_.gu_tasks_of[e], std::memory_order_relaxed);
      w_.down_ready[e].store(0, std::memory_order_relaxed);
    }
    for (auto& c : w_.counters) c.store(0, std::memory_order_relaxed);
    w_.barrier.Reset(nthreads);
  }

  // One worker's share: xquant, the stage (gather, gate_up, hquant, down), reduce.
  void Work(const Worker& wk) {
    Mark(wk, 2);
    const Local l = LocalOf(wk);
    if (plan_.prequant) {
      Xquant();
      w_.barrier.Wait();
    }
    Mark(wk, 3);
    Stage(l);
    w_.barrier.Wait();
    Mark(wk, 4);
    for (int64_t it; (it = w_.counters[kReduceItems].fetch_add(1, std::memory_order_relaxed)) <
                     plan_.red_items;)
      ReduceItem(l, it);
    Mark(wk, 5);
  }

  double ts[MoePhaseProfile::kPhases + 1] =
      {};  // phase boundaries (MoeTuning::profile, worker 0's view)

 private:
  // A worker's NUMA part and own buffers.
  struct Local {
    int p;
    MoeWorkspace::Impl::PartBufs& b;
    const PackedMoeLayer::Part& lp;
    const MoePlan::PartTasks& tasks;
    float* cbuf;
    uint8_t* scratch;
    const float** yrows;  // reduce: a token's y rows and weights
    float* ywts;
  };
  Local LocalOf(const Worker& wk) const {
    const size_t p = static_cast<size_t>(wk.node);
    const size_t sum_off = static_cast<size_t>(wk.global * w_.max_top_k * w_.nparts);
    return Local{wk.node,
                 w_.parts[p],
                 layer_.parts()[p],
                 plan_.parts[p],
                 reinterpret_cast<float*>(w_.cbuf[static_cast<size_t>(wk.global)].data()),
                 w_.scratch[static_cast<size_t>(wk.global)].data(),
                 w_.sum_rows.data() + sum_off,
                 w_.sum_wts.data() + sum_off};
  }
  void Mark(const Worker& wk, int i) {
    if (tuning_.profile && wk.global == 0) ts[i] = Secs();
  }
  static int64_t Claim(std::atomic<int64_t>& c) {
    return c.fetch_add(1, std::memory_order_relaxed);
  }

  void Stage(const Local& l);
  void GatherAhead(int32_t e);
  void FinishExpert(int32_t e, uint8_t* scratch);
  void Xquant();
  void GatherItem(const RowItem& ri);
  void HquantItem(const RowItem& ri, uint8_t* scratch);
  kern::GemmArgs TaskArgs(const Local& l, const Task& tk, const PackedGeom& g,
                          const uint8_t* weights) const;
  void GateUpTask(const Local& l, const Task& tk, const Task* tn);
  void StoreH(const Local& l, const Task& tk, const float* c, int64_t ldc);
  void DownTask(const Local& l, const Task& tk, const Task* tn);
  void ReduceItem(const Local& l, int64_t it);

  const PackedMoeLayer& layer_;
  const MoeInput& in_;
  float* const out_;
  MoeWorkspace::Impl& w_;
  const MoePlan& plan_;
  const RunOptions& opts_;
  const MoeTuning& tuning_;
  const Dispatch dsp_;
  const kern::KernelSet& kfew_;
  const WeightFormat fmt_;
  const int G_;
  const int64_t H_, T_;
  const int K_;
  const int64_t kp_h_, xa_ld_, gsum_ld_;
};

// The stage: one list per part, gate_up tasks then down tasks, claimed with
// one counter; no barrier between the steps. Gather items are claimed just
// ahead of the gate_up tasks that need them (kGatherAhead experts ahead),
// the worker finishing an expert's last gate_up task (over all parts) runs
// its hquant and marks it ready, and a down task waits only for its own
// expert. Memory-bound gather and hquant so overlap other workers' GEMMs.
// Waits are only ever on items already claimed by running workers, and no
// item waits on a later one: no deadlock. With HMOE_MOE_LOOKAHEAD a worker
// holds the task after its current one (`nxt`) so the kernel can prefetch
// that task's first K chunk (GemmArgs::next_w).
void MoeCall::Stage(const Local& l) {
  const int64_t n_gu = l.lp.empty() ? 0 : static_cast<int64_t>(l.tasks.gu.size());
  const int64_t n = n_gu + (l.lp.empty() ? 0 : static_cast<int64_t>(l.tasks.down.size()));
  std::atomic<int64_t>& c = w_.counters[kPartTasks + 2 * static_cast<size_t>(l.p)];
  for (int64_t it = Claim(c), nxt; it < n; it = tuning_.lookahead ? nxt : Claim(c)) {
    nxt = tuning_.lookahead ? Claim(c) : -1;
    const int64_t next = nxt < n ? nxt : -1;
    if (it < n_gu) {
      const Task& tk = l.tasks.gu[static_cast<size_t>(it)];
      GatherAhead(tk.e);
      GateUpTask(l, tk,
                 next >= 0 && next < n_gu ? &l.tasks.gu[static_cast<size_t>(next)] : nullptr);
      if (w_.gu_left[static_cast<size_t>(tk.e)].fetch_sub(1, std::memory_order_acq_rel) == 1)
        FinishExpert(tk.e, l.scratch);
    } else {
      const Task& tk = l.tasks.down[static_cast<size_t>(it - n_gu)];
      while (w_.down_ready[static_cast<size_t>(tk.e)].load(std::memory_order_acquire) == 0)
        __builtin_ia32_pause();
      DownTask(l, tk, next >= n_gu ? &l.tasks.down[static_cast<size_t>(next - n_gu)] : nullptr);
    }
  }
}

// Gathers row items up to kGatherAhead experts past e, then waits until all
// of e's rows are gathered.
void MoeCall::GatherAhead(int32_t e) {
  const int64_t n_items = static_cast<int64_t>(plan_.row_items.size());
  const int64_t last = static_cast<int64_t>(plan_.active.size()) - 1;
  const int64_t pos = plan_.active_pos[static_cast<size_t>(e)];
  const int64_t want = plan_.item_end[static_cast<size_t>(std::min(pos + kGatherAhead, last))];
  std::atomic<int64_t>& g = w_.counters[kGatherItems];
  while (g.load(std::memory_order_relaxed) < want) {
    const int64_t it = g.fetch_add(1, std::memory_order_relaxed);
    if (it >= n_items) break;
    const RowItem& ri = plan_.row_items[static_cast<size_t>(it)];
    GatherItem(ri);
    _mm_sfence();  // the streaming stores are visible before the count drops
    w_.gather_left[static_cast<size_t>(ri.e)].fetch_sub(1, std::memory_order_release);
  }
  while (w_.gather_left[static_cast<size_t>(e)].load(std::memory_order_acquire) > 0)
    __builtin_ia32_pause();
}

// After e's last gate_up task: its hquant (HquantItem skips rows without int8
// activations), then its down tasks may run.
void MoeCall::FinishExpert(int32_t e, uint8_t* scratch) {
  const int64_t pos = plan_.active_pos[static_cast<size_t>(e)];
  for (int64_t it = pos == 0 ? 0 : plan_.item_end[static_cast<size_t>(pos - 1)];
       it < plan_.item_end[static_cast<size_t>(pos)]; ++it)
    HquantItem(plan_.row_items[static_cast<size_t>(it)], scratch);
  w_.down_ready[static_cast<size_t>(e)].store(1, std::memory_order_release);
}

// xquant: every token once (int8 activations).
void MoeCall::Xquant() {
  for (int64_t t; (t = Claim(w_.counters[kXquantTokens])) < T_;)
    kfew_.quant_bf16(in_.x + t * H_, H_, kp_h_, reinterpret_cast<int8_t*>(w_.xt.data() + t * kp_h_),
                     &w_.xt_scale[static_cast<size_t>(t)],
                     w_.gmax ? &w_.xt_gsum[static_cast<size_t>(t * gsum_ld_)] : nullptr, G_);
}

// Rows of x for one row item (tile layout: one 16-row block, front to back).
void MoeCall::GatherItem(const RowItem& ri) {
  const bool i8 = Int8Act(fmt_, plan_.many[static_cast<size_t>(ri.e)]);
  if (plan_.tiled(ri.e)) {
    const uint8_t* src[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t r = ri.r0 + i;
      const int32_t t = plan_.row_token[static_cast<size_t>(r)];
      src[i] = t < 0 ? nullptr
               : i8  ? w_.xt.data() + int64_t{t} * kp_h_
                     : reinterpret_cast<const uint8_t*>(in_.x + int64_t{t} * H_);
      if (i8)
        w_.xa_scale[static_cast<size_t>(r)] = t < 0 ? 0.0f : w_.xt_scale[static_cast<size_t>(t)];
    }
    kfew_.pack_tiled_block(src, i8 ? kp_h_ : H_ * 2, i8 ? kp_h_ : xa_ld_,
                           w_.xa.data() + int64_t{ri.r0} * xa_ld_, tuning_.gather_stream);
    return;
  }
  for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
    const int32_t t = plan_.row_token[static_cast<size_t>(r)];
    uint8_t* dst = w_.xa.data() + r * xa_ld_;
    const int64_t kbytes = i8 ? kp_h_ : xa_ld_;
    int32_t* gsum = i8 && w_.gmax ? &w_.xa_gsum[static_cast<size_t>(r * gsum_ld_)] : nullptr;
    if (t < 0) {
      std::memset(dst, 0, static_cast<size_t>(kbytes));
      if (i8) w_.xa_scale[static_cast<size_t>(r)] = 0.0f;
      if (gsum) std::memset(gsum, 0, sizeof(int32_t) * static_cast<size_t>(w_.gmax));
    } else if (!i8) {
      std::memcpy(dst, in_.x + int64_t{t} * H_, static_cast<size_t>(H_) * 2);
      std::memset(dst + H_ * 2, 0, static_cast<size_t>(xa_ld_ - H_ * 2));
    } else if (plan_.prequant) {
      std::memcpy(dst, w_.xt.data() + int64_t{t} * kp_h_, static_cast<size_t>(kp_h_));
      w_.xa_scale[static_cast<size_t>(r)] = w_.xt_scale[static_cast<size_t>(t)];
      if (gsum)
        std::memcpy(gsum, &w_.xt_gsum[static_cast<size_t>(int64_t{t} * gsum_ld_)],
                    sizeof(int32_t) * static_cast<size_t>(w_.gmax));
    } else {
      kfew_.quant_bf16(in_.x + int64_t{t} * H_, H_, kp_h_, reinterpret_cast<int8_t*>(dst),
                       &w_.xa_scale[static_cast<size_t>(r)], gsum, G_);
    }
  }
}

// hquant of one row item: int8 activations of down, one scale per row over
// all parts' h.
void MoeCall::HquantItem(const RowItem& ri, uint8_t* scratch) {
  if (!Int8Act(fmt_, plan_.many[static_cast<size_t>(ri.e)])) return;
  for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
    float amax = 0.0f;
    for (int q = 0; q < w_.nparts; ++q) {
      const auto& lq = layer_.parts()[static_cast<size_t>(q)];
      if (lq.empty()) continue;
      const auto& bq = w_.parts[static_cast<size_t>(q)];
      const float a = kfew_.amax_f32(reinterpret_cast<const float*>(bq.h.data() + r * bq.kp_i * 4),
                                     lq.i1 - lq.i0);
      amax = std::isnan(a) || std::isnan(amax) ? a + amax : std::max(amax, a);  // NaN sticks
    }
    w_.h_scale[static_cast<size_t>(r)] = amax / 127.0f;
  }
  for (int q = 0; q < w_.nparts; ++q) {
    const auto& lq = layer_.parts()[static_cast<size_t>(q)];
    if (lq.empty()) continue;
    auto& bq = w_.parts[static_cast<size_t>(q)];
    const bool tl = plan_.tiled(ri.e);
    const uint8_t* rows16[16] = {};
    for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
      const float sc = w_.h_scale[static_cast<size_t>(r)], inv = Int8InvScale(sc);
      int8_t* dst = reinterpret_cast<int8_t*>(tl ? scratch + (r - ri.r0) * bq.kp_i
                                                 : bq.hq.data() + r * bq.kp_i);
      kfew_.quant_f32(reinterpret_cast<const float*>(bq.h.data() + r * bq.kp_i * 4), lq.i1 - lq.i0,
                      bq.kp_i, inv, dst,
                      bq.groups ? &bq.hgsum[static_cast<size_t>(r * bq.groups)] : nullptr, G_);
      rows16[r - ri.r0] = reinterpret_cast<const uint8_t*>(dst);
    }
    if (tl)
      kfew_.pack_tiled_block(rows16, bq.kp_i, bq.kp_i, bq.hq.data() + int64_t{ri.r0} * bq.kp_i,
                             /*stream=*/false);
  }
}

// The GemmArgs fields every task sets the same way: its matrix, panels,
// rows, and this worker's C buffer and scratch.
kern::GemmArgs MoeCall::TaskArgs(const Local& l, const Task& tk, const PackedGeom& g,
                                 const uint8_t* weights) const {
  kern::GemmArgs a;
  a.g = &g;
  a.w = weights;
  a.nb0 = tk.nb0;
  a.nb1 = tk.nb1;
  a.m = tk.m;
  a.c = l.cbuf;
  a.ldc = (tk.nb1 - tk.nb0) * 16;
  a.scratch = l.scratch;
  a.scratch_bytes = w_.scratch_bytes;
  a.tuning = &opts_.tuning;
  return a;
}

// The caller's next task (GemmArgs::next_w), for the kernel to prefetch.
void HintNext(kern::GemmArgs& a, const PackedGeom& g, const uint8_t* weights, const Task& tn) {
  a.next_g = &g;
  a.next_w = weights;
  a.next_nb0 = tn.nb0;
  a.next_nb1 = tn.nb1;
}

// One gate_up task: the GEMM, then h (StoreH).
void MoeCall::GateUpTask(const Local& l, const Task& tk, const Task* tn) {
  const bool many = plan_.many[static_cast<size_t>(tk.e)];
  const int64_t r0 = plan_.row_off[static_cast<size_t>(tk.e)] + tk.m0;
  kern::GemmArgs a = TaskArgs(l, tk, l.lp.gu, l.lp.gate_up(tk.e));
  a.a = w_.xa.data() + r0 * xa_ld_;
  a.lda = xa_ld_;
  a.a_tiled = plan_.tiled(tk.e);
  if (Int8Act(fmt_, many)) {
    a.a_scale = &w_.xa_scale[static_cast<size_t>(r0)];
    a.a_gsum = w_.gmax ? &w_.xa_gsum[static_cast<size_t>(r0 * gsum_ld_)] : nullptr;
  }
  a.gsum_stride = gsum_ld_;
  if (tn != nullptr) HintNext(a, l.lp.gu, l.lp.gate_up(tn->e), *tn);
  GemmFor(dsp_.For(many), fmt_, many)(a);
  StoreH(l, tk, l.cbuf, a.ldc);
}

// h = SiLU(g) * u of a gate_up task's C (g and u interleaved per panel
// pair): f32 rows for int8 activations (quantized by hquant), else bf16 rows
// (tiled for the AMX down); padding rows and columns zero.
void MoeCall::StoreH(const Local& l, const Task& tk, const float* c, int64_t ldc) {
  const int64_t h_ld = l.b.kp_i * 4;
  const int64_t np_i = l.lp.gu.np / 2;
  const bool many = plan_.many[static_cast<size_t>(tk.e)];
  const bool i8 = Int8Act(fmt_, many);
  const bool tl = plan_.tiled(tk.e);
  const kern::KernelSet& ks = dsp_.For(many);
  const int64_t row0 = plan_.row_off[static_cast<size_t>(tk.e)];
  const int64_t r0 = row0 + tk.m0;
  const int64_t rows_alloc = many ? RoundUp(tk.m, 32) : tk.m;
  for (int64_t m = 0; m < rows_alloc; ++m) {
    uint8_t* hrow =
        tl && !i8 ? TiledRow(l.b.h.data(), h_ld, row0, r0 + m) : l.b.h.data() + (r0 + m) * h_ld;
    auto bf16_at = [&](int64_t col) {
      return reinterpret_cast<uint16_t*>(hrow +
                                         (tl ? (col / 32) * 1024 + (col % 32) * 2 : col * 2));
    };
    for (int64_t j = tk.nb0; j < tk.nb1; j += 2) {
      const int64_t col = (j / 2) * 16;
      const float* gc = c + m * ldc + (j - tk.nb0) * 16;
      if (m >= tk.m) {
        if (i8)
          std::memset(reinterpret_cast<float*>(hrow) + col, 0, 64);
        else
          std::memset(bf16_at(col), 0, 32);
      } else if (i8) {
        ks.silu_mul(gc, gc + 16, 16, reinterpret_cast<float*>(hrow) + col);
      } else {
        ks.silu_mul_bf16(gc, gc + 16, 16, bf16_at(col));
      }
    }
    if (tk.nb1 == l.lp.gu.nblocks && l.b.kp_i > np_i) {
      if (i8)
        std::memset(reinterpret_cast<float*>(hrow) + np_i, 0,
                    static_cast<size_t>(l.b.kp_i - np_i) * 4);
      else if (tl)
        for (int64_t col = np_i; col < l.b.kp_i; col += 16) std::memset(bf16_at(col), 0, 32);
      else
        std::memset(bf16_at(np_i), 0, static_cast<size_t>(l.b.kp_i - np_i) * 2);
    }
  }
}

// One down task: the GEMM over h (or hq), C rows to y (streaming copy).
void MoeCall::DownTask(const Local& l, const Task& tk, const Task* tn) {
  const int64_t hg_ld = std::max<int64_t>(l.b.groups, 1);
  const bool many = plan_.many[static_cast<size_t>(tk.e)];
  const int64_t r0 = plan_.row_off[static_cast<size_t>(tk.e)] + tk.m0;
  kern::GemmArgs a = TaskArgs(l, tk, l.lp.down, l.lp.down_w(tk.e));
  const int64_t c0 = int64_t{tk.nb0} * 16, c1 = std::min<int64_t>(int64_t{tk.nb1} * 16, H_);
  if (Int8Act(fmt_, many)) {
    a.a = l.b.hq.data() + r0 * l.b.kp_i;
    a.lda = l.b.kp_i;
    a.a_scale = &w_.h_scale[static_cast<size_t>(r0)];
    a.a_gsum = l.b.groups ? &l.b.hgsum[static_cast<size_t>(r0 * hg_ld)] : nullptr;
  } else {
    a.a = l.b.h.data() + r0 * l.b.kp_i * 4;
    a.lda = l.b.kp_i * 4;
  }
  a.a_tiled = plan_.tiled(tk.e);
  a.gsum_stride = hg_ld;
  if (tn != nullptr) HintNext(a, l.lp.down, l.lp.down_w(tn->e), *tn);
  GemmFor(dsp_.For(many), fmt_, many)(a);
  kfew_.store_rows(l.cbuf, a.ldc, reinterpret_cast<float*>(l.b.y.data()) + r0 * H_ + c0, H_, tk.m,
                   c1 - c0);
}

// One reduce item, hchunk columns of one token: out[t] = sum over (slot j,
// part q) of w[t][j] * y_q[row(t, j)], one weighted_sum of all the token's
// rows, written once (streaming).
void MoeCall::ReduceItem(const Local& l, int64_t it) {
  const int64_t t = it / plan_.hchunks;
  const int64_t c0 = (it % plan_.hchunks) * plan_.hchunk, c1 = std::min(H_, c0 + plan_.hchunk);
  int n = 0;
  for (int j = 0; j < K_; ++j) {
    const int32_t r = plan_.slot_row[static_cast<size_t>(t * K_ + j)];
    if (r < 0) continue;
    for (int q = 0; q < w_.nparts; ++q) {
      if (layer_.parts()[static_cast<size_t>(q)].empty()) continue;
      l.yrows[n] = reinterpret_cast<const float*>(w_.parts[static_cast<size_t>(q)].y.data()) +
                   int64_t{r} * H_ + c0;
      l.ywts[n++] = in_.weights[t * K_ + j];
    }
  }
  kfew_.weighted_sum(l.yrows, l.ywts, n, c1 - c0, out_ + t * H_ + c0, /*stream=*/true);
}

}  // namespace

absl::Status RunMoe(const PackedMoeLayer& layer, const MoeInput& in, float* out, ThreadPool& pool,
                    MoeWorkspace& ws, const RunOptions& opts) {
  MoeWorkspace::Impl& w = *ws.impl();
  const int64_t T = in.tokens;
  const int K = in.top_k;
  if (T < 0 || T > w.max_tokens || K < 0 || K > w.max_top_k)
    return absl::InvalidArgumentError(absl::StrCat("tokens ", T, " x top_k ", K,
                                                   " exceed the workspace (", w.max_tokens, " x ",
                                                   w.max_top_k, ")"));
  RETURN_IF_ERROR(CheckWorkspaceFits(layer, pool, w));
  RETURN_IF_ERROR(ValidateKernelTuning(opts.tuning));
  if (T == 0) return absl::OkStatus();
  if (in.x == nullptr || out == nullptr || (K > 0 && (in.ids == nullptr || in.weights == nullptr)))
    return absl::InvalidArgumentError("null input or output");
  ASSIGN_OR_RETURN(const Isa isa, EffectiveIsa(opts));
  const bool prof = opts.tuning.moe.profile;
  const Dispatch dsp = DispatchFor(isa, opts.emulate_amx);
  MoeCall call(layer, in, out, w, opts, dsp);
  if (prof) call.ts[0] = Secs();
  kern::PlanMoe(layer, in, opts, dsp.tiled, pool, w.plan);
  call.Reset(pool.num_threads());
  if (prof) call.ts[1] = Secs();
  pool.Run([&](const Worker& wk) { call.Work(wk); });
  if (prof) {
    call.ts[MoePhaseProfile::kPhases] = Secs();
    for (int i = 0; i < MoePhaseProfile::kPhases; ++i)
      w.profile.seconds[i] += call.ts[i + 1] - call.ts[i];
    ++w.profile.calls;
  }
  return absl::OkStatus();
}

}  // namespace hmoe
