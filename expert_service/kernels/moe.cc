// RunMoe: routing, the stages of one call and kernel dispatch. One pool.Run
// per call; the work:
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
// others; MoeTuning::pipeline = false restores a barrier after each step.
// With MoeTuning::overlap_reduce (from kOverlapReduceTokens tokens) the
// reduce joins that stage too: down tasks run in column waves (all experts'
// tasks of output columns [c0, c1), then the next columns), and a wave's
// reduce items, (token, wave), run once its last down task is done, a few
// after each later down task. Off by default: measured slower (see the
// knob notes below).
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

namespace hmoe {
namespace {

// Rows per task: an expert's rows are split into the fewest chunks of at most
// this many (a multiple of 32), so its weights stream from DRAM once per call.
constexpr int64_t kMaxRowChunk = 512;
constexpr int64_t kCbufFloats = kMaxRowChunk * MoeTuning::kMaxTaskPanels * 16;
constexpr int64_t kPreQuantTokens = 32;  // int8 activations: quantize tokens once from here
constexpr int64_t kGatherAhead = 2;      // pipelined: gather this many experts past the one needed
constexpr int64_t kOverlapReduceTokens = 64;  // HMOE_MOE_OVERLAP_REDUCE=1 applies from here
constexpr int64_t kReduceWaves = 8;           // column waves of the down tasks (at most)
constexpr int64_t kReduceBatch = 4;           // reduce items claimed at once

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

// Activations of an expert call: int8 for INT8 weights and INT4 "few".
bool Int8Act(WeightFormat f, bool many) {
  return f == WeightFormat::kInt8 || (f == WeightFormat::kInt4 && !many);
}

kern::GemmFn GemmFor(const kern::KernelSet& k, WeightFormat f, bool many) {
  switch (f) {
    case WeightFormat::kBf16:
      return k.bf16;
    case WeightFormat::kInt8:
      return k.i8;
    case WeightFormat::kInt4:
      return many ? k.i4_bf16 : k.i4_i8;
  }
  return nullptr;
}

// A gather / hquant work item: rows [r0, r0 + n) of expert e; a whole 16-row
// block when the expert's rows are in the tile layout, else up to 4 rows.
struct RowItem {
  int32_t e, r0, n;
};

struct Task {
  int32_t e;         // local expert
  int32_t m0, m;     // row chunk within the expert
  int32_t nb0, nb1;  // panels
};

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

// Scheduling knobs: MoeTuning (tuning.h). What the measurements said:
//   HMOE_MOE_TASK_PANELS = 2..32: panels per gate_up / down task at most
//     (default 16). More panels: fewer re-reads of an expert's rows from L3,
//     larger B chunks and C blocks in L2. Run 6: 32 lost to 16 in 6 of 6
//     reps; 32 with kc 512 was mixed.
//   HMOE_MOE_DIRECT_Y = 0 | 1: down tasks of "many" experts write their C
//     straight into y (when hidden % 16 == 0: whole panels fit in a row)
//     instead of the worker's C buffer plus a streaming copy. Measured on
//     the AMX machine (run 6): int8 down +25% (C stores to y's strided rows
//     are slower than the copy); again in run 9, with int8 scaling on L1-hot
//     blocks: ds-v3 T=8192 int8 +11%, bf16 +7%: off.
//   HMOE_MOE_PIPELINE = 0 | 1: 1 (default) runs gather, gate_up, hquant and
//     down as one dependency-driven stage (see RunMoe); 0 puts a barrier
//     after each of them.
//   HMOE_MOE_OVERLAP_REDUCE = 0 | 1: 1 overlaps the reduce with the down
//     tasks from kOverlapReduceTokens tokens (column waves, see the header);
//     0 (default) runs it after a barrier. Measured (GPU machine, 16
//     threads, T=8192, 3 interleaved reps, bench/results run 9): the reduce
//     tail drops from ~22 ms to ~4 ms but the GEMM stage grows by more
//     (reduce traffic beside the GEMMs, each expert's rows re-read per
//     wave): ds-v3 int8 403-482 vs 412-437 ms, bf16 647-772 vs 703-799,
//     qwen3-30b int8 62-67 vs 56-65, bf16 88-96 vs 82-93.
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
inline double Secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

const char* MoePhaseProfile::Name(int phase) {
  static const char* const kNames[kPhases] = {"route",  "wake", "gather", "gate_up",
                                              "hquant", "down", "reduce", "join"};
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

  // routing
  std::vector<int32_t> count, row_off, row_cnt, cursor;
  std::vector<uint8_t> many;
  std::vector<int32_t> row_token, row_expert, slot_row, active;
  std::vector<RowItem> row_items;  // by expert, in `active` order
  // Pipelined stage, per local expert: its position in `active`, row items
  // not yet gathered, gate_up tasks not yet done (all parts), whether its
  // down tasks may run; per active position, one past its last row item.
  std::vector<int32_t> active_pos;
  std::vector<int64_t> item_end;
  std::vector<std::atomic<int32_t>> gather_left, gu_left, down_ready;
  // Overlapped reduce: down tasks (all parts) of each column wave not yet done.
  std::vector<std::atomic<int32_t>> wave_left;
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
    std::vector<Task> gu_tasks, down_tasks;
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
  // phase counters
  std::vector<std::atomic<int64_t>> counters;
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
  if (layer.format() != WeightFormat::kBf16) add(pool.mem_node(0), max_tokens * kp_h);
  int64_t scratch = kern::kGemmScratchBytes;
  for (size_t p = 0; p < layer.parts().size(); ++p) {
    const int64_t kp_i = layer.parts()[p].down.kp;
    scratch = std::max({scratch, 16 * kp_i, kCbufFloats * 4});
    const int node = pool.mem_node(static_cast<int>(p));
    add(node, R * kp_i * 4);
    add(node, R * kp_i);
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
  w.gmax = w.format == WeightFormat::kInt4 ? w.kp_h / w.group : 0;
  const size_t E = static_cast<size_t>(w.n_local), R = static_cast<size_t>(w.max_rows);
  w.count.resize(E);
  w.row_off.resize(E + 1);
  w.row_cnt.resize(E);
  w.cursor.resize(E);
  w.many.resize(E);
  w.active.reserve(E);
  w.active_pos.resize(E);
  w.item_end.reserve(E);
  w.gather_left = std::vector<std::atomic<int32_t>>(E);
  w.gu_left = std::vector<std::atomic<int32_t>>(E);
  w.down_ready = std::vector<std::atomic<int32_t>>(E);
  w.wave_left = std::vector<std::atomic<int32_t>>(kReduceWaves);
  w.row_token.resize(R);
  w.row_expert.resize(R);
  w.slot_row.resize(static_cast<size_t>(slots));
  w.row_items.reserve(R / 4 + 2 * E + 1);
  w.node0 = pool.mem_node(0);
  ASSIGN_OR_RETURN(w.xa,
                   NumaBuffer::Allocate(R * static_cast<size_t>(w.kp_h) * 2, pool.mem_node(0)));
  w.xa_scale.resize(R);
  w.xa_gsum.resize(R * static_cast<size_t>(std::max<int64_t>(w.gmax, 1)));
  if (layer.format() != WeightFormat::kBf16) {
    ASSIGN_OR_RETURN(
        w.xt, NumaBuffer::Allocate(static_cast<size_t>(max_tokens * w.kp_h), pool.mem_node(0)));
    w.xt_scale.resize(static_cast<size_t>(max_tokens));
    w.xt_gsum.resize(static_cast<size_t>(max_tokens * std::max<int64_t>(w.gmax, 1)));
  }
  w.h_scale.resize(R);
  w.parts.resize(static_cast<size_t>(w.nparts));
  for (int p = 0; p < w.nparts; ++p) {
    const auto& lp = layer.parts()[static_cast<size_t>(p)];
    auto& b = w.parts[static_cast<size_t>(p)];
    b.kp_i = lp.down.kp;
    // hquant stages 16 int8 rows; the AMX kernels may keep a task's partial C.
    w.scratch_bytes = std::max({w.scratch_bytes, 16 * b.kp_i, kCbufFloats * 4});
    b.groups = w.format == WeightFormat::kInt4 ? b.kp_i / w.group : 0;
    const int node = pool.mem_node(p);
    w.part_node.push_back(node);
    ASSIGN_OR_RETURN(b.h, NumaBuffer::Allocate(R * static_cast<size_t>(b.kp_i) * 4, node));
    ASSIGN_OR_RETURN(b.hq, NumaBuffer::Allocate(R * static_cast<size_t>(b.kp_i), node));
    b.hgsum.resize(R * static_cast<size_t>(std::max<int64_t>(b.groups, 1)));
    ASSIGN_OR_RETURN(b.y, NumaBuffer::Allocate(R * static_cast<size_t>(w.hidden) * 4, node));
    // Task upper bound: per expert row chunks x panel chunks.
    const int64_t chunks = static_cast<int64_t>(E) + slots / kMaxRowChunk + 1;
    b.gu_tasks.reserve(static_cast<size_t>(chunks * (lp.gu.nblocks / 2 + 1)));
    b.down_tasks.reserve(static_cast<size_t>(chunks * (lp.down.nblocks + 1)));
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

absl::StatusOr<Isa> EffectiveIsa(const RunOptions& opts) {
  return ResolveIsa(opts.isa, opts.strict_isa);
}

absl::Status RunMoe(const PackedMoeLayer& layer, const MoeInput& in, float* out, ThreadPool& pool,
                    MoeWorkspace& ws, const RunOptions& opts) {
  MoeWorkspace::Impl& w = *ws.impl();
  const int64_t T = in.tokens, H = layer.hidden();
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
  const WeightFormat fmt = layer.format();
  const int G = layer.group();

  const MoeTuning& tuning = opts.tuning.moe;
  const bool prof = tuning.profile;
  const int64_t task_panels = tuning.task_panels;
  double ts[9] = {};
  if (prof) ts[0] = Secs();
  // ---- route (caller thread) ----
  const int64_t E = w.n_local, e_begin = layer.expert_begin();
  std::fill(w.count.begin(), w.count.end(), 0);
  // ids are read once (they may sit in memory a client can still write):
  // slot_row holds each slot's local expert (or -1) until rows are assigned.
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = static_cast<int64_t>(in.ids[s]) - e_begin;
    const bool owned = e >= 0 && e < E;
    w.slot_row[static_cast<size_t>(s)] = owned ? static_cast<int32_t>(e) : -1;
    if (owned) ++w.count[static_cast<size_t>(e)];
  }
  w.active.clear();
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t c = w.count[static_cast<size_t>(e)];
    w.many[static_cast<size_t>(e)] =
        c > (fmt == WeightFormat::kInt4 ? opts.many_threshold_int4 : opts.many_threshold);
    w.row_off[static_cast<size_t>(e)] = static_cast<int32_t>(rows);
    w.cursor[static_cast<size_t>(e)] = static_cast<int32_t>(rows);
    w.row_cnt[static_cast<size_t>(e)] = c;
    if (c > 0) w.active.push_back(static_cast<int32_t>(e));
    const int64_t alloc = w.many[static_cast<size_t>(e)] ? RoundUp(c, 32) : c;
    for (int64_t r = rows + c; r < rows + alloc; ++r) {
      w.row_token[static_cast<size_t>(r)] = -1;
      w.row_expert[static_cast<size_t>(r)] = static_cast<int32_t>(e);
    }
    rows += alloc;
  }
  w.row_off[static_cast<size_t>(E)] = static_cast<int32_t>(rows);
  for (int64_t s = 0; s < T * K; ++s) {
    const int32_t e = w.slot_row[static_cast<size_t>(s)];
    if (e < 0) continue;
    const int32_t r = w.cursor[static_cast<size_t>(e)]++;
    w.slot_row[static_cast<size_t>(s)] = r;
    w.row_token[static_cast<size_t>(r)] = static_cast<int32_t>(s / K);
    w.row_expert[static_cast<size_t>(r)] = e;
  }

  const Dispatch dsp = DispatchFor(isa, opts.emulate_amx);
  auto tiled = [&](int32_t e) { return dsp.tiled && w.many[static_cast<size_t>(e)]; };
  bool any_int8_h = false;
  for (int32_t e : w.active) any_int8_h |= Int8Act(fmt, w.many[static_cast<size_t>(e)]);
  w.row_items.clear();
  w.item_end.clear();
  for (int32_t e : w.active) {
    const int32_t r0 = w.row_off[static_cast<size_t>(e)],
                  r1 = w.row_off[static_cast<size_t>(e) + 1];
    const int32_t step = tiled(e) ? 16 : 4;
    const size_t first = w.row_items.size();
    for (int32_t r = r0; r < r1; r += step) w.row_items.push_back({e, r, std::min(step, r1 - r)});
    w.active_pos[static_cast<size_t>(e)] = static_cast<int32_t>(w.item_end.size());
    w.item_end.push_back(static_cast<int64_t>(w.row_items.size()));
    w.gather_left[static_cast<size_t>(e)].store(static_cast<int32_t>(w.row_items.size() - first),
                                                std::memory_order_relaxed);
    w.gu_left[static_cast<size_t>(e)].store(0, std::memory_order_relaxed);
    w.down_ready[static_cast<size_t>(e)].store(0, std::memory_order_relaxed);
  }
  const int64_t n_active = static_cast<int64_t>(w.active.size());

  // ---- tasks per part ----
  // Row chunks of expert e: the fewest of at most kMaxRowChunk rows, equal
  // sizes rounded up to 32 (so chunk starts stay on 32-row tile blocks).
  auto row_chunk = [&](int32_t e) {
    const int64_t c = std::max<int64_t>(w.row_cnt[static_cast<size_t>(e)], 1);
    const int64_t n = (c + kMaxRowChunk - 1) / kMaxRowChunk, size = (c + n - 1) / n;
    return w.many[static_cast<size_t>(e)] ? RoundUp(size, 32) : size;
  };
  const int64_t nthreads = pool.num_threads();
  // Overlapped reduce: down tasks in column waves of wave_panels panels
  // (every part's down matrix has the same ceil(H / 16) panels).
  bool overlap = tuning.pipeline && tuning.overlap_reduce && T >= kOverlapReduceTokens;
  int64_t wave_panels = 0;
  for (auto& c : w.wave_left) c.store(0, std::memory_order_relaxed);
  for (int p = 0; p < w.nparts; ++p) {
    auto& b = w.parts[static_cast<size_t>(p)];
    const auto& lp = layer.parts()[static_cast<size_t>(p)];
    b.gu_tasks.clear();
    b.down_tasks.clear();
    if (lp.empty()) continue;
    const int64_t target = 4 * std::max(1, pool.node_threads(p));
    int64_t gu_work = 0, dn_work = 0;
    for (int32_t e : w.active) {
      const int64_t chunks = (w.row_cnt[static_cast<size_t>(e)] + row_chunk(e) - 1) / row_chunk(e);
      gu_work += chunks * lp.gu.nblocks;
      dn_work += chunks * lp.down.nblocks;
    }
    const int64_t gu_chunk =
        std::clamp<int64_t>(RoundUp((gu_work + target - 1) / target, 2), 2, task_panels);
    const int64_t dn_chunk = std::clamp<int64_t>((dn_work + target - 1) / target, 1, task_panels);
    for (int32_t e : w.active) {
      const int64_t c = w.row_cnt[static_cast<size_t>(e)], rc = row_chunk(e);
      for (int64_t m0 = 0; m0 < c; m0 += rc) {
        const int32_t m = static_cast<int32_t>(std::min(rc, c - m0));
        for (int64_t j = 0; j < lp.gu.nblocks; j += gu_chunk) {
          b.gu_tasks.push_back({e, static_cast<int32_t>(m0), m, static_cast<int32_t>(j),
                                static_cast<int32_t>(std::min(lp.gu.nblocks, j + gu_chunk))});
          w.gu_left[static_cast<size_t>(e)].fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    // Down tasks: expert by expert, or (overlapped reduce) wave by wave, each
    // wave expert by expert; no task crosses a wave boundary. The first part
    // sets the waves: whole tasks of its chunk size, at most kReduceWaves.
    const int64_t nb = lp.down.nblocks;
    if (overlap && wave_panels == 0) {
      wave_panels = RoundUp((nb + kReduceWaves - 1) / kReduceWaves, dn_chunk);  // <= 8 waves
    }
    const int64_t wp = overlap ? wave_panels : nb;
    for (int64_t w0 = 0; w0 < nb; w0 += wp) {
      const int64_t w1 = std::min(nb, w0 + wp);
      for (int32_t e : w.active) {
        const int64_t c = w.row_cnt[static_cast<size_t>(e)], rc = row_chunk(e);
        for (int64_t m0 = 0; m0 < c; m0 += rc) {
          const int32_t m = static_cast<int32_t>(std::min(rc, c - m0));
          for (int64_t j = w0; j < w1; j += dn_chunk) {
            b.down_tasks.push_back({e, static_cast<int32_t>(m0), m, static_cast<int32_t>(j),
                                    static_cast<int32_t>(std::min(w1, j + dn_chunk))});
            if (overlap)
              w.wave_left[static_cast<size_t>(w0 / wp)].fetch_add(1, std::memory_order_relaxed);
          }
        }
      }
    }
  }
  for (auto& c : w.counters) c.store(0, std::memory_order_relaxed);
  w.barrier.Reset(static_cast<int>(nthreads));

  const int64_t kp_h = w.kp_h;
  const int64_t xa_ld = kp_h * 2;
  const int64_t gsum_ld = std::max<int64_t>(w.gmax, 1);
  // Reduce items: whole token rows when there are enough tokens (long
  // sequential streams), else row pieces of >= 256 floats so every thread
  // gets some (decode).
  overlap = overlap && wave_panels > 0;  // (no part with an intermediate slice: no waves)
  // Overlapped: one item per (token, wave), wave-major.
  const int64_t hchunk =
      overlap ? wave_panels * 16
              : std::min<int64_t>(
                    H, std::max<int64_t>(256,
                                         RoundUp((H * T + 4 * nthreads - 1) / (4 * nthreads), 16)));
  const int64_t red_items = T * ((H + hchunk - 1) / hchunk);
  int64_t n_dn_all = 0;
  for (const auto& b : w.parts) n_dn_all += static_cast<int64_t>(b.down_tasks.size());
  // Ready reduce items a worker takes after each down task, at most: twice
  // the even share, so the reduce keeps pace with the waves.
  const int64_t reduce_quota =
      overlap ? 2 * ((red_items + n_dn_all - 1) / std::max<int64_t>(n_dn_all, 1)) : 0;
  const kern::KernelSet& kfew = *dsp.few;
  // Tiled int8 rows always come from the per-token quantization.
  bool any_tiled_i8 = false;
  for (int32_t e : w.active)
    any_tiled_i8 |= tiled(e) && Int8Act(fmt, w.many[static_cast<size_t>(e)]);
  const bool prequant = any_tiled_i8 || (any_int8_h && T >= kPreQuantTokens);

  if (prof) ts[1] = Secs();
  auto mark = [&](const Worker& wk, int i) {
    if (prof && wk.global == 0) ts[i] = Secs();
  };
  pool.Run([&](const Worker& wk) {
    mark(wk, 2);
    const int p = wk.node;
    auto& b = w.parts[static_cast<size_t>(p)];
    const auto& lp = layer.parts()[static_cast<size_t>(p)];
    float* cbuf = reinterpret_cast<float*>(w.cbuf[static_cast<size_t>(wk.global)].data());
    uint8_t* scratch = w.scratch[static_cast<size_t>(wk.global)].data();
    // The GemmArgs fields every task sets the same way: its matrix, panels,
    // rows, and this worker's C buffer and scratch.
    auto task_args = [&](const Task& tk, const PackedGeom& g, const uint8_t* weights) {
      kern::GemmArgs a;
      a.g = &g;
      a.w = weights;
      a.nb0 = tk.nb0;
      a.nb1 = tk.nb1;
      a.m = tk.m;
      a.c = cbuf;
      a.ldc = (tk.nb1 - tk.nb0) * 16;
      a.scratch = scratch;
      a.scratch_bytes = w.scratch_bytes;
      a.tuning = &opts.tuning;
      return a;
    };
    // Task claiming for gate_up and down. With HMOE_MOE_LOOKAHEAD a worker
    // holds the task after its current one (`nxt`) so the kernel can
    // prefetch that task's first K chunk (GemmArgs::next_w).
    auto claim = [](std::atomic<int64_t>& c) { return c.fetch_add(1, std::memory_order_relaxed); };
    auto next_task = [&](std::atomic<int64_t>& c, int64_t held) {
      return tuning.lookahead ? held : claim(c);
    };
    auto hint_next = [](kern::GemmArgs& a, const PackedGeom& g, const uint8_t* weights,
                        const Task& tn) {
      a.next_g = &g;
      a.next_w = weights;
      a.next_nb0 = tn.nb0;
      a.next_nb1 = tn.nb1;
    };

    // ---- xquant: every token once (int8 activations) ----
    if (prequant) {
      for (int64_t t; (t = w.counters[3].fetch_add(1, std::memory_order_relaxed)) < T;)
        kfew.quant_bf16(in.x + t * H, H, kp_h, reinterpret_cast<int8_t*>(w.xt.data() + t * kp_h),
                        &w.xt_scale[static_cast<size_t>(t)],
                        w.gmax ? &w.xt_gsum[static_cast<size_t>(t * gsum_ld)] : nullptr, G);
      w.barrier.Wait();
    }

    // ---- the work items: gather, gate_up, hquant, down ----
    const int64_t n_items = static_cast<int64_t>(w.row_items.size());
    // Rows of x for one row item (tile layout: one 16-row block, front to back).
    auto gather_item = [&](const RowItem& ri) {
      const bool i8 = Int8Act(fmt, w.many[static_cast<size_t>(ri.e)]);
      if (tiled(ri.e)) {
        const uint8_t* src[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t r = ri.r0 + i;
          const int32_t t = w.row_token[static_cast<size_t>(r)];
          src[i] = t < 0 ? nullptr
                   : i8  ? w.xt.data() + int64_t{t} * kp_h
                         : reinterpret_cast<const uint8_t*>(in.x + int64_t{t} * H);
          if (i8)
            w.xa_scale[static_cast<size_t>(r)] = t < 0 ? 0.0f : w.xt_scale[static_cast<size_t>(t)];
        }
        kfew.pack_tiled_block(src, i8 ? kp_h : H * 2, i8 ? kp_h : xa_ld,
                              w.xa.data() + int64_t{ri.r0} * xa_ld, tuning.gather_stream);
        return;
      }
      for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
        const int32_t t = w.row_token[static_cast<size_t>(r)];
        uint8_t* dst = w.xa.data() + r * xa_ld;
        const int64_t kbytes = i8 ? kp_h : xa_ld;
        int32_t* gsum = w.gmax ? &w.xa_gsum[static_cast<size_t>(r * gsum_ld)] : nullptr;
        if (t < 0) {
          std::memset(dst, 0, static_cast<size_t>(kbytes));
          w.xa_scale[static_cast<size_t>(r)] = 0.0f;
          if (gsum) std::memset(gsum, 0, sizeof(int32_t) * static_cast<size_t>(w.gmax));
        } else if (!i8) {
          std::memcpy(dst, in.x + int64_t{t} * H, static_cast<size_t>(H) * 2);
          std::memset(dst + H * 2, 0, static_cast<size_t>(xa_ld - H * 2));
        } else if (prequant) {
          std::memcpy(dst, w.xt.data() + int64_t{t} * kp_h, static_cast<size_t>(kp_h));
          w.xa_scale[static_cast<size_t>(r)] = w.xt_scale[static_cast<size_t>(t)];
          if (gsum)
            std::memcpy(gsum, &w.xt_gsum[static_cast<size_t>(int64_t{t} * gsum_ld)],
                        sizeof(int32_t) * static_cast<size_t>(w.gmax));
        } else {
          kfew.quant_bf16(in.x + int64_t{t} * H, H, kp_h, reinterpret_cast<int8_t*>(dst),
                          &w.xa_scale[static_cast<size_t>(r)], gsum, G);
        }
      }
    };
    // One gate_up task: the GEMM, then h = SiLU(g) * u: f32 rows for int8
    // activations (quantized by hquant), else bf16 rows (tiled for the AMX down).
    auto gate_up_task = [&](const Task& tk, const Task* tn) {
      const int64_t h_ld = b.kp_i * 4;
      const int64_t np_i = lp.gu.np / 2;
      const bool many = w.many[static_cast<size_t>(tk.e)];
      const bool i8 = Int8Act(fmt, many);
      const bool tl = tiled(tk.e);
      const kern::KernelSet& ks = dsp.For(many);
      const int64_t row0 = w.row_off[static_cast<size_t>(tk.e)];
      const int64_t r0 = row0 + tk.m0;
      kern::GemmArgs a = task_args(tk, lp.gu, lp.gate_up(tk.e));
      a.a = w.xa.data() + r0 * xa_ld;
      a.lda = xa_ld;
      a.a_tiled = tl;
      a.a_scale = &w.xa_scale[static_cast<size_t>(r0)];
      a.a_gsum = w.gmax ? &w.xa_gsum[static_cast<size_t>(r0 * gsum_ld)] : nullptr;
      a.gsum_stride = gsum_ld;
      if (tn != nullptr) hint_next(a, lp.gu, lp.gate_up(tn->e), *tn);
      GemmFor(ks, fmt, many)(a);
      const int64_t rows_alloc = many ? RoundUp(tk.m, 32) : tk.m;
      for (int64_t m = 0; m < rows_alloc; ++m) {
        uint8_t* hrow =
            tl && !i8 ? TiledRow(b.h.data(), h_ld, row0, r0 + m) : b.h.data() + (r0 + m) * h_ld;
        auto bf16_at = [&](int64_t col) {
          return reinterpret_cast<uint16_t*>(hrow +
                                             (tl ? (col / 32) * 1024 + (col % 32) * 2 : col * 2));
        };
        for (int64_t j = tk.nb0; j < tk.nb1; j += 2) {
          const int64_t col = (j / 2) * 16;
          const float* gc = cbuf + m * a.ldc + (j - tk.nb0) * 16;
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
        if (tk.nb1 == lp.gu.nblocks && b.kp_i > np_i) {
          if (i8)
            std::memset(reinterpret_cast<float*>(hrow) + np_i, 0,
                        static_cast<size_t>(b.kp_i - np_i) * 4);
          else if (tl)
            for (int64_t col = np_i; col < b.kp_i; col += 16) std::memset(bf16_at(col), 0, 32);
          else
            std::memset(bf16_at(np_i), 0, static_cast<size_t>(b.kp_i - np_i) * 2);
        }
      }
    };
    // hquant of one row item: int8 activations of down, one scale per row
    // over all parts' h.
    auto hquant_item = [&](const RowItem& ri) {
      if (!Int8Act(fmt, w.many[static_cast<size_t>(ri.e)])) return;
      for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
        float amax = 0.0f;
        for (int q = 0; q < w.nparts; ++q) {
          const auto& lq = layer.parts()[static_cast<size_t>(q)];
          if (lq.empty()) continue;
          const auto& bq = w.parts[static_cast<size_t>(q)];
          const float a = kfew.amax_f32(
              reinterpret_cast<const float*>(bq.h.data() + r * bq.kp_i * 4), lq.i1 - lq.i0);
          amax = std::isnan(a) || std::isnan(amax) ? a + amax : std::max(amax, a);  // NaN sticks
        }
        w.h_scale[static_cast<size_t>(r)] = amax / 127.0f;
      }
      for (int q = 0; q < w.nparts; ++q) {
        const auto& lq = layer.parts()[static_cast<size_t>(q)];
        if (lq.empty()) continue;
        auto& bq = w.parts[static_cast<size_t>(q)];
        const bool tl = tiled(ri.e);
        const uint8_t* rows16[16] = {};
        for (int64_t r = ri.r0; r < ri.r0 + ri.n; ++r) {
          const float sc = w.h_scale[static_cast<size_t>(r)], inv = Int8InvScale(sc);
          int8_t* dst = reinterpret_cast<int8_t*>(tl ? scratch + (r - ri.r0) * bq.kp_i
                                                     : bq.hq.data() + r * bq.kp_i);
          kfew.quant_f32(reinterpret_cast<const float*>(bq.h.data() + r * bq.kp_i * 4),
                         lq.i1 - lq.i0, bq.kp_i, inv, dst,
                         bq.groups ? &bq.hgsum[static_cast<size_t>(r * bq.groups)] : nullptr, G);
          rows16[r - ri.r0] = reinterpret_cast<const uint8_t*>(dst);
        }
        if (tl)
          kfew.pack_tiled_block(rows16, bq.kp_i, bq.kp_i, bq.hq.data() + int64_t{ri.r0} * bq.kp_i,
                                /*stream=*/false);
      }
    };
    // One down task: the GEMM over h (or hq), C rows to y.
    auto down_task = [&](const Task& tk, const Task* tn) {
      const int64_t hg_ld = std::max<int64_t>(b.groups, 1);
      const bool many = w.many[static_cast<size_t>(tk.e)];
      const bool i8 = Int8Act(fmt, many);
      const kern::KernelSet& ks = dsp.For(many);
      const int64_t r0 = w.row_off[static_cast<size_t>(tk.e)] + tk.m0;
      kern::GemmArgs a = task_args(tk, lp.down, lp.down_w(tk.e));
      const int64_t c0 = int64_t{tk.nb0} * 16, c1 = std::min<int64_t>(int64_t{tk.nb1} * 16, H);
      // Direct: C rows are y rows (a many expert's rows are padded to 32 and
      // the kernel may leave the padding rows unwritten: y is read only
      // through slot_row, real rows; whole panels end inside a row).
      const bool direct = tuning.direct_y && many && H % 16 == 0;
      if (direct) {
        a.c = reinterpret_cast<float*>(b.y.data()) + r0 * H + c0;
        a.ldc = H;
      }
      if (i8) {
        a.a = b.hq.data() + r0 * b.kp_i;
        a.lda = b.kp_i;
      } else {
        a.a = b.h.data() + r0 * b.kp_i * 4;
        a.lda = b.kp_i * 4;
      }
      a.a_tiled = tiled(tk.e);
      a.a_scale = &w.h_scale[static_cast<size_t>(r0)];
      a.a_gsum = b.groups ? &b.hgsum[static_cast<size_t>(r0 * hg_ld)] : nullptr;
      a.gsum_stride = hg_ld;
      if (tn != nullptr) hint_next(a, lp.down, lp.down_w(tn->e), *tn);
      GemmFor(ks, fmt, many)(a);
      if (!direct)
        kfew.store_rows(cbuf, a.ldc, reinterpret_cast<float*>(b.y.data()) + r0 * H + c0, H, tk.m,
                        c1 - c0);
      if (overlap) {
        _mm_sfence();  // y's streaming stores are visible before the wave count drops
        w.wave_left[static_cast<size_t>(tk.nb0 / wave_panels)].fetch_sub(1,
                                                                         std::memory_order_release);
      }
    };
    const int64_t n_gu = lp.empty() ? 0 : static_cast<int64_t>(b.gu_tasks.size());
    const int64_t n_dn = lp.empty() ? 0 : static_cast<int64_t>(b.down_tasks.size());
    // Claims items [0, n) from c and runs run(item, next): next is the item
    // this worker holds after it (HMOE_MOE_LOOKAHEAD), else -1.
    auto run_claimed = [&](std::atomic<int64_t>& c, int64_t n, auto&& run) {
      for (int64_t it = claim(c), nxt; it < n; it = next_task(c, nxt)) {
        nxt = tuning.lookahead ? claim(c) : -1;
        run(it, nxt < n ? nxt : -1);
      }
    };

    // One reduce item: token-major pieces of hchunk columns, or (overlapped)
    // wave-major (token, wave).
    const int64_t nch = (H + hchunk - 1) / hchunk;
    const size_t sum_off = static_cast<size_t>(wk.global * w.max_top_k * w.nparts);
    const float** yrows = w.sum_rows.data() + sum_off;
    float* ywts = w.sum_wts.data() + sum_off;
    auto reduce_item = [&](int64_t it) {
      const int64_t t = overlap ? it % T : it / nch;
      const int64_t c0 = (overlap ? it / T : it % nch) * hchunk, c1 = std::min(H, c0 + hchunk);
      int n = 0;
      for (int j = 0; j < K; ++j) {
        const int32_t r = w.slot_row[static_cast<size_t>(t * K + j)];
        if (r < 0) continue;
        for (int q = 0; q < w.nparts; ++q) {
          if (layer.parts()[static_cast<size_t>(q)].empty()) continue;
          yrows[n] = reinterpret_cast<const float*>(w.parts[static_cast<size_t>(q)].y.data()) +
                     int64_t{r} * H + c0;
          ywts[n++] = in.weights[t * K + j];
        }
      }
      kfew.weighted_sum(yrows, ywts, n, c1 - c0, out + t * H + c0, /*stream=*/true);
    };
    // Overlapped: up to reduce_quota items whose wave is done, without waiting.
    auto reduce_ready = [&] {
      std::atomic<int64_t>& rc = w.counters[2];
      int64_t left = reduce_quota, v = rc.load(std::memory_order_relaxed);
      while (left > 0 && v < red_items) {
        const int64_t wave = v / T;
        if (w.wave_left[static_cast<size_t>(wave)].load(std::memory_order_acquire) > 0) return;
        const int64_t n = std::min({left, (wave + 1) * T - v, kReduceBatch});
        if (!rc.compare_exchange_weak(v, v + n, std::memory_order_relaxed)) continue;
        for (int64_t it = v; it < v + n; ++it) reduce_item(it);
        left -= n;
        v = rc.load(std::memory_order_relaxed);
      }
    };

    if (tuning.pipeline) {
      // ---- pipelined: one list per part, gate_up tasks then down tasks ----
      // No barrier between the stages: gather items are claimed just ahead
      // of the gate_up tasks that need them (kGatherAhead experts ahead), the
      // worker finishing an expert's last gate_up task (over all parts) runs
      // its hquant and marks it ready, and a down task waits only for its own
      // expert. Memory-bound gather and hquant so overlap other workers' GEMMs.
      // Waits are only ever on items already claimed by running workers, and
      // no item waits on a later one: no deadlock.
      auto gather_ahead = [&](int32_t e) {
        const int64_t pos = w.active_pos[static_cast<size_t>(e)];
        const int64_t want =
            w.item_end[static_cast<size_t>(std::min<int64_t>(pos + kGatherAhead, n_active - 1))];
        std::atomic<int64_t>& g = w.counters[0];
        while (g.load(std::memory_order_relaxed) < want) {
          const int64_t it = g.fetch_add(1, std::memory_order_relaxed);
          if (it >= n_items) break;
          const RowItem& ri = w.row_items[static_cast<size_t>(it)];
          gather_item(ri);
          _mm_sfence();  // the streaming stores are visible before the count drops
          w.gather_left[static_cast<size_t>(ri.e)].fetch_sub(1, std::memory_order_release);
        }
        while (w.gather_left[static_cast<size_t>(e)].load(std::memory_order_acquire) > 0)
          __builtin_ia32_pause();
      };
      auto finish_expert = [&](int32_t e) {  // hquant_item skips rows without int8 activations
        const int64_t pos = w.active_pos[static_cast<size_t>(e)];
        for (int64_t it = pos == 0 ? 0 : w.item_end[static_cast<size_t>(pos - 1)];
             it < w.item_end[static_cast<size_t>(pos)]; ++it)
          hquant_item(w.row_items[static_cast<size_t>(it)]);
        w.down_ready[static_cast<size_t>(e)].store(1, std::memory_order_release);
      };
      mark(wk, 3);
      run_claimed(w.counters[8 + 2 * p], n_gu + n_dn, [&](int64_t it, int64_t nxt) {
        if (it < n_gu) {
          const Task& tk = b.gu_tasks[static_cast<size_t>(it)];
          gather_ahead(tk.e);
          gate_up_task(tk,
                       nxt >= 0 && nxt < n_gu ? &b.gu_tasks[static_cast<size_t>(nxt)] : nullptr);
          if (w.gu_left[static_cast<size_t>(tk.e)].fetch_sub(1, std::memory_order_acq_rel) == 1)
            finish_expert(tk.e);
        } else {
          const Task& tk = b.down_tasks[static_cast<size_t>(it - n_gu)];
          while (w.down_ready[static_cast<size_t>(tk.e)].load(std::memory_order_acquire) == 0)
            __builtin_ia32_pause();
          down_task(tk, nxt >= n_gu ? &b.down_tasks[static_cast<size_t>(nxt - n_gu)] : nullptr);
          if (overlap) reduce_ready();
        }
      });
      if (!overlap) w.barrier.Wait();
      mark(wk, 4);
      mark(wk, 5);
      mark(wk, 6);
    } else {
      // ---- phased (HMOE_MOE_PIPELINE=0): a barrier after every stage ----
      for (int64_t it; (it = w.counters[0].fetch_add(1, std::memory_order_relaxed)) < n_items;)
        gather_item(w.row_items[static_cast<size_t>(it)]);
      w.barrier.Wait();
      mark(wk, 3);
      auto run_tasks = [&](std::atomic<int64_t>& c, const std::vector<Task>& tasks, auto&& run) {
        run_claimed(c, static_cast<int64_t>(tasks.size()), [&](int64_t it, int64_t nxt) {
          run(tasks[static_cast<size_t>(it)],
              nxt >= 0 ? &tasks[static_cast<size_t>(nxt)] : nullptr);
        });
      };
      run_tasks(w.counters[8 + 2 * p], b.gu_tasks, gate_up_task);
      w.barrier.Wait();
      mark(wk, 4);
      if (any_int8_h) {
        for (int64_t it; (it = w.counters[1].fetch_add(1, std::memory_order_relaxed)) < n_items;)
          hquant_item(w.row_items[static_cast<size_t>(it)]);
        w.barrier.Wait();
      }
      mark(wk, 5);
      run_tasks(w.counters[9 + 2 * p], b.down_tasks, down_task);
      w.barrier.Wait();
      mark(wk, 6);
    }

    // ---- reduce ----
    // out[t] = sum over (slot j, part q) of w[t][j] * y_q[row(t, j)]: one
    // weighted_sum of all the token's rows, written once (streaming).
    // Overlapped, each wave's items wait for that wave's down tasks.
    if (overlap) {
      for (int64_t v;
           (v = w.counters[2].fetch_add(kReduceBatch, std::memory_order_relaxed)) < red_items;)
        for (int64_t it = v; it < std::min(red_items, v + kReduceBatch); ++it) {
          while (w.wave_left[static_cast<size_t>(it / T)].load(std::memory_order_acquire) > 0)
            __builtin_ia32_pause();
          reduce_item(it);
        }
    } else {
      for (int64_t it; (it = w.counters[2].fetch_add(1, std::memory_order_relaxed)) < red_items;)
        reduce_item(it);
    }
    mark(wk, 7);
  });
  if (prof) {
    ts[8] = Secs();
    for (int i = 0; i < MoePhaseProfile::kPhases; ++i) w.profile.seconds[i] += ts[i + 1] - ts[i];
    ++w.profile.calls;
  }
  return absl::OkStatus();
}

}  // namespace hmoe
