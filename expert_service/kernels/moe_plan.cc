#include "expert_service/kernels/moe_plan.h"

#include <algorithm>

namespace hmoe::kern {
namespace {

// Routes the call's slots to this shard's experts: per expert its row count,
// regime and rows ("many" experts' rows padded to 32); per slot its row.
void RouteRows(const PackedMoeLayer& layer, const MoeInput& in, const RunOptions& opts,
               MoePlan& plan) {
  const int64_t T = in.tokens, K = in.top_k;
  const int64_t E = layer.num_local_experts(), e_begin = layer.expert_begin();
  const int threshold = ManyThreshold(layer.format(), opts);
  std::fill(plan.count.begin(), plan.count.end(), 0);
  // ids are read once (they may sit in memory a client can still write):
  // slot_row holds each slot's local expert (or -1) until rows are assigned.
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = static_cast<int64_t>(in.ids[s]) - e_begin;
    const bool owned = e >= 0 && e < E;
    plan.slot_row[static_cast<size_t>(s)] = owned ? static_cast<int32_t>(e) : -1;
    if (owned) ++plan.count[static_cast<size_t>(e)];
  }
  plan.active.clear();
  int64_t rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t c = plan.count[static_cast<size_t>(e)];
    const bool many = c > threshold;
    plan.many[static_cast<size_t>(e)] = many;
    plan.row_off[static_cast<size_t>(e)] = static_cast<int32_t>(rows);
    plan.cursor[static_cast<size_t>(e)] = static_cast<int32_t>(rows);
    if (c > 0) plan.active.push_back(static_cast<int32_t>(e));
    const int64_t alloc = many ? RoundUp(c, 32) : c;
    for (int64_t r = rows + c; r < rows + alloc; ++r) plan.row_token[static_cast<size_t>(r)] = -1;
    rows += alloc;
  }
  plan.row_off[static_cast<size_t>(E)] = static_cast<int32_t>(rows);
  for (int64_t s = 0; s < T * K; ++s) {
    const int32_t e = plan.slot_row[static_cast<size_t>(s)];
    if (e < 0) continue;
    const int32_t r = plan.cursor[static_cast<size_t>(e)]++;
    plan.slot_row[static_cast<size_t>(s)] = r;
    plan.row_token[static_cast<size_t>(r)] = static_cast<int32_t>(s / K);
  }
}

// The gather / hquant row items of the active experts, expert by expert.
void PlanRowItems(WeightFormat fmt, MoePlan& plan) {
  plan.any_int8_h = false;
  plan.row_items.clear();
  plan.item_end.clear();
  for (int32_t e : plan.active) {
    plan.any_int8_h |= Int8Act(fmt, plan.many[static_cast<size_t>(e)]);
    const int32_t r0 = plan.row_off[static_cast<size_t>(e)],
                  r1 = plan.row_off[static_cast<size_t>(e) + 1];
    const int32_t step = plan.tiled(e) ? 16 : 4;
    for (int32_t r = r0; r < r1; r += step)
      plan.row_items.push_back({e, r, std::min(step, r1 - r)});
    plan.active_pos[static_cast<size_t>(e)] = static_cast<int32_t>(plan.item_end.size());
    plan.item_end.push_back(static_cast<int64_t>(plan.row_items.size()));
    plan.gu_tasks_of[static_cast<size_t>(e)] = 0;
  }
}

// Row chunks of expert e: the fewest of at most kMaxRowChunk rows, equal
// sizes rounded up to 32 (so chunk starts stay on 32-row tile blocks).
int64_t RowChunk(const MoePlan& plan, int32_t e) {
  const int64_t c = std::max<int64_t>(plan.count[static_cast<size_t>(e)], 1);
  const int64_t n = (c + kMaxRowChunk - 1) / kMaxRowChunk, size = (c + n - 1) / n;
  return plan.many[static_cast<size_t>(e)] ? RoundUp(size, 32) : size;
}

// Appends, expert by expert, the tasks of every row chunk of each active
// expert over `nblocks` panels, `chunk` panels per task.
void AddTasks(const MoePlan& plan, int64_t nblocks, int64_t chunk, std::vector<Task>& tasks) {
  for (int32_t e : plan.active) {
    const int64_t c = plan.count[static_cast<size_t>(e)], rc = RowChunk(plan, e);
    for (int64_t m0 = 0; m0 < c; m0 += rc) {
      const int32_t m = static_cast<int32_t>(std::min(rc, c - m0));
      for (int64_t j = 0; j < nblocks; j += chunk)
        tasks.push_back({e, static_cast<int32_t>(m0), m, static_cast<int32_t>(j),
                         static_cast<int32_t>(std::min(nblocks, j + chunk))});
    }
  }
}

// One part's tasks: panels per task so the part's threads get about four
// tasks each, at most `task_panels` (gate_up: whole gate/up panel pairs).
void PlanPartTasks(const PackedMoeLayer::Part& lp, int threads, int64_t task_panels, MoePlan& plan,
                   MoePlan::PartTasks& tasks) {
  tasks.gu.clear();
  tasks.down.clear();
  if (lp.empty()) return;
  const int64_t target = 4 * std::max(1, threads);
  int64_t gu_work = 0, dn_work = 0;
  for (int32_t e : plan.active) {
    const int64_t chunks =
        (plan.count[static_cast<size_t>(e)] + RowChunk(plan, e) - 1) / RowChunk(plan, e);
    gu_work += chunks * lp.gu.nblocks;
    dn_work += chunks * lp.down.nblocks;
  }
  const int64_t gu_chunk =
      std::clamp<int64_t>(RoundUp((gu_work + target - 1) / target, 2), 2, task_panels);
  const int64_t dn_chunk = std::clamp<int64_t>((dn_work + target - 1) / target, 1, task_panels);
  AddTasks(plan, lp.gu.nblocks, gu_chunk, tasks.gu);
  for (const Task& tk : tasks.gu) ++plan.gu_tasks_of[static_cast<size_t>(tk.e)];
  AddTasks(plan, lp.down.nblocks, dn_chunk, tasks.down);
}

}  // namespace

void MoePlan::Reserve(const PackedMoeLayer& layer, int64_t slots, int64_t max_rows) {
  const size_t E = static_cast<size_t>(layer.num_local_experts());
  const size_t R = static_cast<size_t>(max_rows);
  count.resize(E);
  row_off.resize(E + 1);
  cursor.resize(E);
  many.resize(E);
  row_token.resize(R);
  slot_row.resize(static_cast<size_t>(slots));
  active.reserve(E);
  active_pos.resize(E);
  row_items.reserve(R / 4 + 2 * E + 1);
  item_end.reserve(E);
  gu_tasks_of.resize(E);
  parts.resize(layer.parts().size());
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& lp = layer.parts()[p];
    // Per expert row chunks x panel chunks, at most.
    const int64_t chunks = static_cast<int64_t>(E) + slots / kMaxRowChunk + 1;
    parts[p].gu.reserve(static_cast<size_t>(chunks * (lp.gu.nblocks / 2 + 1)));
    parts[p].down.reserve(static_cast<size_t>(chunks * (lp.down.nblocks + 1)));
  }
}

void PlanMoe(const PackedMoeLayer& layer, const MoeInput& in, const RunOptions& opts,
             bool tiled_layout, const ThreadPool& pool, MoePlan& plan) {
  const WeightFormat fmt = layer.format();
  plan.tiled_layout = tiled_layout;
  RouteRows(layer, in, opts, plan);
  PlanRowItems(fmt, plan);
  for (size_t p = 0; p < plan.parts.size(); ++p)
    PlanPartTasks(layer.parts()[p], pool.node_threads(static_cast<int>(p)),
                  opts.tuning.moe.task_panels, plan, plan.parts[p]);
  // Tiled int8 rows always come from the per-token quantization.
  bool any_tiled_i8 = false;
  for (int32_t e : plan.active)
    any_tiled_i8 |= plan.tiled(e) && Int8Act(fmt, plan.many[static_cast<size_t>(e)]);
  plan.prequant = any_tiled_i8 || (plan.any_int8_h && in.tokens >= kPreQuantTokens);
  // Reduce items: whole token rows when there are enough tokens (long
  // sequential streams), else row pieces of >= 256 floats so every thread
  // gets some (decode).
  const int64_t H = layer.hidden(), T = in.tokens, nthreads = pool.num_threads();
  plan.hchunk = std::min<int64_t>(
      H, std::max<int64_t>(256, RoundUp((H * T + 4 * nthreads - 1) / (4 * nthreads), 16)));
  plan.hchunks = (H + plan.hchunk - 1) / plan.hchunk;
  plan.red_items = T * plan.hchunks;
}

}  // namespace hmoe::kern
