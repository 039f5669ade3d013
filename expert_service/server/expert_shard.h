// One expert-service shard: its routed experts (loaded from a checkpoint, our
// packed files, or generated), quantized and packed once into the kernels'
// layout (expert_service/kernels/moe.h), and the validated MoE call on them.
// No gRPC here: the front ends (gRPC stream, shared memory, UCX) all call
// ExpertShard::Handle.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/load_progress.h"
#include "common/runtime/thread_pool.h"
#include "common/transport/moe_call.h"
#include "expert_service/kernels/moe.h"

namespace hmoe {

// Weight formats the shard serves in: the kernels' formats. Weights are
// quantized once at load (from bf16/f32/fp8) exactly as the kernels' Pack
// does, or loaded already quantized from `hmoe convert` output.
using ServeFormat = WeightFormat;

struct ShardOptions {
  std::string model_dir;   // Hugging Face checkpoint (bf16/f32/fp8 safetensors)
  std::string packed_dir;  // or: `hmoe convert` output (then model_dir gives config.json)
  // or: random weights "hidden=H,intermediate=I,experts=E,top_k=K,layers=L
  // [,first_dense=D][,seed=S][,alias=N]": L decoder layers of which the first
  // D (default 0, D < L) are dense, so the MoE layers are D..L-1 as in
  // DeepSeek's first_k_dense_replace; alias=N: every expert of every layer
  // one of N distinct weight sets held once (SyntheticExperts::alias: memory
  // for N experts, a fit check and not a speed figure)
  std::string synthetic;
  int shard_index = 0;
  int num_shards = 1;
  SplitMode split = SplitMode::kTp;
  ServeFormat format = ServeFormat::kBf16;
  int group = 64;  // int4 group along K
  // With packed_dir the files' format is served; when the format was asked
  // for explicitly (--format), files in another are refused (not silently
  // served at 2-4x the memory).
  bool format_explicit = false;
  int64_t max_tokens = 256;  // capacity of one request (sizes shm slots and the workspace)
  // Compute threads: 0 = one per core the process may run on (so bind the
  // process with --cores / --numa-node before Load); virtual_nodes as in
  // ThreadPoolOptions (hmoe-expert-service takes both, when 0, from
  // HMOE_THREADS / HMOE_VIRTUAL_NUMA: ThreadCountsFromEnv). Shards loaded in
  // one process with the same counts share one pool.
  int threads = 0;
  int virtual_nodes = 0;
  // The kernels' ISA at most (--isa, default $HMOE_ISA: read by the binary);
  // nullopt: the best this CPU has.
  std::optional<Isa> isa;
  // Benchmark seam: validate every call but answer zeros without computing,
  // so that transport overhead can be measured apart from the experts.
  bool null_compute = false;
  // Speed knobs of the CPU kernels (kernels/tuning.h); the defaults are the
  // measured best. hmoe-expert-service reads them once from HMOE_AMX_*,
  // HMOE_FEW_*, HMOE_MOE_* and HMOE_PROFILE at start-up and logs those it
  // changes (and, with HMOE_PROFILE=1, RunMoe's phase times when it stops).
  KernelTuning tuning;
  // Before packing, refuse (RESOURCE_EXHAUSTED) weights that exceed their
  // NUMA node's, the machine's or the cgroup's memory (CheckMemoryFits)
  // against `memory_limits`, or this machine's (ReadMemoryLimits) when unset.
  bool check_memory = true;
  std::optional<MemoryLimits> memory_limits;
  // Load-time warnings (e.g. MemoryAvailableWarning), one line each; unset:
  // not reported. hmoe-expert-service passes its log.
  std::function<void(const std::string&)> log;

  absl::Status Validate() const;
  std::string ToString() const;
};

// The process-wide compute pool for `threads` (0: one per allowed core) and
// `virtual_nodes` (0: the real NUMA nodes), created on first use and kept
// until exit.
absl::StatusOr<ThreadPool*> SharedThreadPool(int threads, int virtual_nodes);

class ExpertShard : public MoeHandler {
 public:
  struct LoadProgress {
    std::atomic<int64_t> layers_loaded{0};
    std::atomic<int64_t> layers_total{0};
    std::atomic<int64_t> weight_bytes{0};
    // Set by another thread to stop the load: Load returns CANCELLED once
    // the experts being packed at that moment are done (no new one starts).
    std::atomic<bool> cancel{false};
    // Borrowed, may be null: the packed bytes, its total set before the
    // first expert and each expert added as it is taken (Finish is the
    // caller's).
    LoadProgressReporter* bytes = nullptr;
  };

  // Packs every MoE layer of the shard (checkpoints stream expert by expert;
  // no unpacked copy of the weights is kept).
  static absl::StatusOr<std::unique_ptr<ExpertShard>> Load(const ShardOptions& opts,
                                                           LoadProgress* progress = nullptr);

  const ShardInfo& info() const override { return info_; }
  // Validates the call, then RunMoe on the layer. Calls are serialized (one
  // workspace; the pool runs one call at a time anyway).
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override;
  void Refused(const absl::Status& status) override;

  // New calls fail UNAVAILABLE ("draining"); in-flight ones finish.
  void SetDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }

  struct Counters {
    std::atomic<uint64_t> requests{0}, failed{0}, invalid{0}, tokens{0}, compute_ns{0},
        in_flight{0};
  };
  const Counters& counters() const { return counters_; }
  int64_t weight_bytes() const { return weight_bytes_; }  // packed bytes held, all layers
  // Synthetic alias=N: the distinct expert weight sets every layer shares
  // (a fit check, not a speed figure); 0: unaliased.
  int64_t aliased_experts() const { return aliased_experts_; }
  Isa isa() const { return isa_; }  // what RunMoe dispatches to
  const ThreadPool& pool() const { return *pool_; }
  // RunMoe's phase times since the last take (calls == 0 unless the shard
  // was loaded with tuning.moe.profile, HMOE_PROFILE=1).
  MoePhaseProfile TakeProfile();

  // The packed experts of one layer (index into info().moe_layers).
  const PackedMoeLayer& layer(int layer_slot) const {
    return layers_[static_cast<size_t>(layer_slot)];
  }

 private:
  ExpertShard() = default;

  ShardInfo info_;
  bool null_compute_ = false;
  Isa isa_ = Isa::kScalar;
  RunOptions run_opts_;                      // the tuning of ShardOptions
  ThreadPool* pool_ = nullptr;               // SharedThreadPool: outlives every shard
  std::vector<int> slot_of_layer_;           // layer -> slot or -1
  std::vector<PackedMoeLayer> layers_;       // [slot]
  std::unique_ptr<MoeWorkspace> workspace_;  // guarded by compute_mu_
  int64_t weight_bytes_ = 0;
  int64_t aliased_experts_ = 0;
  std::mutex compute_mu_;
  std::atomic<bool> draining_{false};
  Counters counters_;
};

}  // namespace hmoe
