// Internal: the plan of one RunMoe call, computed on the caller's thread
// before any worker starts (moe.cc's header comment describes the stages it
// feeds): which rows each local expert gets and in which regime, the gather /
// hquant row items, each NUMA part's gate_up and down tasks and how the
// reduce is split. Plain data; Reserve sizes it once (MoeWorkspace::Create),
// so PlanMoe allocates nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "expert_service/kernels/moe.h"

namespace hmoe::kern {

// Rows per task: an expert's rows are split into the fewest chunks of at most
// this many (a multiple of 32), so its weights stream from DRAM once per call.
inline constexpr int64_t kMaxRowChunk = 512;
// int8 activations: every token is quantized once (xquant) from this many tokens.
inline constexpr int64_t kPreQuantTokens = 32;

// Activations of an expert call: int8 for INT8 weights and INT4 "few".
inline bool Int8Act(WeightFormat f, bool many) {
  return f == WeightFormat::kInt8 || (f == WeightFormat::kInt4 && !many);
}
// Whether any call of format `f` takes int8 activations (Int8Act for some
// `many`): only then does a workspace hold the int8 rows, scales and sums.
inline bool AnyInt8Act(WeightFormat f) { return Int8Act(f, false) || Int8Act(f, true); }

// A gather / hquant work item: rows [r0, r0 + n) of expert e; a whole 16-row
// block when the expert's rows are in the tile layout, else up to 4 rows.
struct RowItem {
  int32_t e, r0, n;
};

// A gate_up or down task: rows [m0, m0 + m) of expert e's rows, panels [nb0, nb1).
struct Task {
  int32_t e;         // local expert
  int32_t m0, m;     // row chunk within the expert
  int32_t nb0, nb1;  // panels
};

struct MoePlan {
  // Sizes the vectors for calls of up to `slots` (tokens x top_k) routed rows
  // on `layer` (`max_rows`: slots plus each expert's padding to 32 rows).
  void Reserve(const PackedMoeLayer& layer, int64_t slots, int64_t max_rows);

  // ---- routing, per local expert ----
  std::vector<int32_t> count;    // rows routed here
  std::vector<int32_t> row_off;  // first row ([E + 1]: the rows in all)
  std::vector<int32_t> cursor;   // (while routing) next free row
  std::vector<uint8_t> many;     // "many" regime: rows padded to 32
  bool tiled_layout = false;     // the "many" kernels read A in the AMX tile layout
  // Expert e's rows are in the tile layout (16-row blocks).
  bool tiled(int32_t e) const { return tiled_layout && many[static_cast<size_t>(e)]; }
  // ---- per row / slot ----
  std::vector<int32_t> row_token;  // the token of a row; -1: padding
  std::vector<int32_t> slot_row;   // the row of slot t * top_k + j; -1: not this shard's
  // ---- work items ----
  std::vector<int32_t> active;       // experts with rows, in order
  std::vector<int32_t> active_pos;   // an active expert's position in `active`
  std::vector<RowItem> row_items;    // by expert, in `active` order
  std::vector<int64_t> item_end;     // per active position: one past its last row item
  std::vector<int32_t> gu_tasks_of;  // per expert: gate_up tasks over all parts
  struct PartTasks {
    std::vector<Task> gu, down;  // expert by expert, in `active` order
  };
  std::vector<PartTasks> parts;
  bool any_int8_h = false;  // some expert's down takes int8 activations (hquant)
  bool prequant = false;    // xquant runs: int8 activations per token, once
  // ---- reduce: items of hchunk output columns of one token, token-major ----
  int64_t hchunk = 0;
  int64_t hchunks = 0;    // items per token
  int64_t red_items = 0;  // tokens x hchunks
};

// Plans one call of `in` on `layer` (in.tokens x in.top_k within what `plan`
// was reserved for) for a pool of `pool`'s shape. `tiled_layout`: the "many"
// kernels read A in the tile layout (AMX).
void PlanMoe(const PackedMoeLayer& layer, const MoeInput& in, const RunOptions& opts,
             bool tiled_layout, const ThreadPool& pool, MoePlan& plan);

}  // namespace hmoe::kern
