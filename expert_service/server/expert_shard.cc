#include "expert_service/server/expert_shard.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/experts/synthetic_source.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "expert_service/convert/packed_file.h"

namespace hmoe {
namespace {

struct Geometry {
  std::string model_type;
  int64_t hidden = 0, intermediate = 0, experts = 0, top_k = 0;
  std::vector<int32_t> moe_layers;
  uint64_t seed = 1;
  int64_t alias = 0;  // synthetic: distinct expert weight sets (0: unaliased)
};

absl::StatusOr<Geometry> ParseSynthetic(const std::string& spec) {
  Geometry g;
  g.model_type = "synthetic";
  int64_t layers = 1, first_dense = 0;
  for (absl::string_view kv : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    int64_t v = 0;
    // first_dense may be 0; every other value is positive.
    if (!absl::SimpleAtoi(p.second, &v) || v < 0 || (v == 0 && p.first != "first_dense")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--synthetic: bad value in \"", std::string(kv), "\""));
    }
    if (p.first == "hidden")
      g.hidden = v;
    else if (p.first == "intermediate")
      g.intermediate = v;
    else if (p.first == "experts")
      g.experts = v;
    else if (p.first == "top_k")
      g.top_k = v;
    else if (p.first == "layers")
      layers = v;
    else if (p.first == "first_dense")
      first_dense = v;
    else if (p.first == "seed")
      g.seed = static_cast<uint64_t>(v);
    else if (p.first == "alias")
      g.alias = v;
    else
      return absl::InvalidArgumentError(absl::StrCat("--synthetic: unknown key ", p.first));
  }
  if (g.hidden == 0 || g.intermediate == 0 || g.experts == 0 || g.top_k == 0) {
    return absl::InvalidArgumentError(
        "--synthetic needs hidden=, intermediate=, experts=, top_k= (and optionally layers=, "
        "first_dense=, seed=, alias=)");
  }
  if (first_dense >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("--synthetic: first_dense=", first_dense,
                                                   " leaves no MoE layer of layers=", layers));
  }
  if (g.alias > (layers - first_dense) * g.experts || g.alias > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--synthetic: alias=", g.alias, " is more than the ", layers - first_dense,
                     " MoE layers x ", g.experts, " experts it aliases"));
  }
  // layers= counts the decoder layers; the first `first_dense` are dense
  // (DeepSeek's first_k_dense_replace), the rest MoE.
  for (int64_t l = first_dense; l < layers; ++l) g.moe_layers.push_back(static_cast<int32_t>(l));
  return g;
}

SyntheticExperts SyntheticSpec(const Geometry& g) {
  return {g.hidden, g.intermediate, g.experts, g.seed, g.alias};
}

}  // namespace

absl::Status ShardOptions::Validate() const {
  int sources = !model_dir.empty() + !synthetic.empty();
  if (sources != 1) {
    return absl::InvalidArgumentError("exactly one of --model-dir and --synthetic is required");
  }
  if (!packed_dir.empty() && model_dir.empty()) {
    return absl::InvalidArgumentError("--packed-dir needs --model-dir (for config.json)");
  }
  if (num_shards < 1 || shard_index < 0 || shard_index >= num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard: ", shard_index, "/", num_shards, " is not i/n with 0 <= i < n"));
  }
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--threads: ", threads, " is negative"));
  }
  if (max_tokens < 1 || max_tokens > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-tokens: ", max_tokens, " outside [1, 2^20]"));
  }
  return ValidateKernelTuning(tuning);
}

std::string ShardOptions::ToString() const {
  const std::string tuned = KernelTuningToString(tuning);
  return absl::StrCat("source=",
                      !synthetic.empty()   ? "synthetic:" + synthetic
                      : packed_dir.empty() ? model_dir
                                           : packed_dir + " (config " + model_dir + ")",
                      " shard=", shard_index, "/", num_shards, " split=", SplitModeName(split),
                      " format=", WeightFormatName(format, group), " max_tokens=", max_tokens,
                      " threads=", threads == 0 ? std::string("all") : absl::StrCat(threads),
                      isa ? absl::StrCat(" isa<=", std::string(IsaName(*isa))) : "",
                      null_compute ? " null_compute=1" : "", check_memory ? "" : " memory_check=0",
                      tuned.empty() ? "" : " tuning: ", tuned);
}

absl::StatusOr<ThreadPool*> SharedThreadPool(int threads, int virtual_nodes) {
  static std::mutex mu;
  static auto* pools = new std::map<std::pair<int, int>, std::unique_ptr<ThreadPool>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& p = (*pools)[{threads, virtual_nodes}];
  if (!p) {
    ThreadPoolOptions o;
    o.max_threads = threads;
    o.virtual_nodes = virtual_nodes;
    ASSIGN_OR_RETURN(p, ThreadPool::Create(o));
  }
  return p.get();
}

namespace {
absl::Status CancelledLoad() { return absl::CancelledError("loading cancelled"); }
}  // namespace

absl::StatusOr<std::unique_ptr<ExpertShard>> ExpertShard::Load(const ShardOptions& opts,
                                                               LoadProgress* progress) {
  RETURN_IF_ERROR(opts.Validate());
  auto shard = std::unique_ptr<ExpertShard>(new ExpertShard());
  Geometry geo;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<PackedExperts> packed;
  ModelConfig cfg;
  if (!opts.synthetic.empty()) {
    ASSIGN_OR_RETURN(geo, ParseSynthetic(opts.synthetic));
  } else {
    ASSIGN_OR_RETURN(cfg, LoadModelConfig(opts.model_dir));
    geo.model_type = cfg.model_type;
    geo.hidden = cfg.hidden_size;
    geo.intermediate = cfg.moe.intermediate_size;
    geo.experts = cfg.moe.num_experts;
    geo.top_k = cfg.moe.experts_per_token;
    geo.moe_layers = cfg.moe_layer_indices();
    if (geo.moe_layers.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(opts.model_dir, ": model has no MoE layers"));
    }
    if (!opts.packed_dir.empty()) {
      ASSIGN_OR_RETURN(packed, PackedExperts::Open(opts.packed_dir, cfg, opts.split,
                                                   opts.shard_index, opts.num_shards));
    } else {
      ASSIGN_OR_RETURN(ckpt, Checkpoint::Open(opts.model_dir));
    }
  }
  if (opts.split == SplitMode::kEp && opts.num_shards > geo.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard: ", opts.num_shards, " ep shards for ", geo.experts, " experts"));
  }
  if (opts.split == SplitMode::kTp && opts.num_shards > geo.intermediate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard: ", opts.num_shards, " tp shards for intermediate size ", geo.intermediate));
  }
  ServeFormat format = opts.format;
  int group = opts.group;
  if (packed) {
    format = packed->format();
    group = packed->group();
    if (opts.format_explicit &&
        WeightFormatName(format, group) != WeightFormatName(opts.format, opts.group))
      return absl::FailedPreconditionError(absl::StrCat(
          "--format ", WeightFormatName(opts.format, opts.group), ", but ", opts.packed_dir,
          " holds ", WeightFormatName(format, group),
          " (as hmoe convert wrote it): give that --format, or none, or convert again"));
  }
  const PackOptions po = ShardPackOptions(geo.intermediate, geo.experts, opts.split,
                                          opts.shard_index, opts.num_shards, format, group);
  // Aliased synthetic experts: one base layer of geo.alias experts (this
  // shard's intermediate slice of each), every layer's experts views of it.
  const bool aliased = geo.alias > 0;
  PackOptions alias_po = po;
  alias_po.expert_begin = 0;
  alias_po.expert_end = geo.alias;
  if (packed &&
      (packed->i_begin() != po.i_begin || packed->i_end() != po.i_end ||
       packed->expert_begin() != po.expert_begin || packed->expert_end() != po.expert_end)) {
    return absl::FailedPreconditionError(
        absl::StrCat(opts.packed_dir, ": packed slice (experts [", packed->expert_begin(), ", ",
                     packed->expert_end(), "), intermediate [", packed->i_begin(), ", ",
                     packed->i_end(), ")) is not this shard's"));
  }
  ShardInfo& info = shard->info_;
  info.model_type = geo.model_type;
  info.hidden = geo.hidden;
  info.intermediate = geo.intermediate;
  info.num_experts = geo.experts;
  info.top_k = geo.top_k;
  info.moe_layers = geo.moe_layers;
  info.shard_index = opts.shard_index;
  info.num_shards = opts.num_shards;
  info.split = opts.split;
  info.max_tokens = opts.max_tokens;
  info.pid = ::getpid();
  info.weight_format = WeightFormatName(format, group);
  if (packed) {
    info.conversion_id = packed->conversion_id();
    info.source_fingerprint = packed->source_fingerprint();
    // Packed from this --model-dir's checkpoint? (R1's config fits V3's
    // packed files.) A model dir without the routed experts (config only,
    // as on an expert-only host) cannot say.
    if (!info.source_fingerprint.empty()) {
      auto here = Checkpoint::Open(opts.model_dir);
      absl::StatusOr<std::string> fp =
          here.ok() ? RoutedExpertsFingerprint(**here, cfg) : here.status();
      if (fp.ok() && *fp != info.source_fingerprint)
        return absl::FailedPreconditionError(
            absl::StrCat(opts.packed_dir, " was converted from another checkpoint (routed experts ",
                         info.source_fingerprint, ") than --model-dir ", opts.model_dir, " (", *fp,
                         "): convert this model, or point --model-dir at the one converted"));
    }
  } else if (ckpt) {
    ASSIGN_OR_RETURN(info.source_fingerprint, RoutedExpertsFingerprint(*ckpt, cfg));
  }
  info.expert_begin = po.expert_begin;
  info.expert_end = po.expert_end;
  info.i_begin = po.i_begin;
  info.i_end = po.i_end;
  shard->null_compute_ = opts.null_compute;
  shard->run_opts_.tuning = opts.tuning;
  shard->run_opts_.isa = opts.isa;
  ASSIGN_OR_RETURN(shard->isa_, EffectiveIsa(shard->run_opts_));
  ASSIGN_OR_RETURN(shard->pool_, SharedThreadPool(opts.threads, opts.virtual_nodes));
  ThreadPool& pool = *shard->pool_;
  if (opts.check_memory) {
    // Refuse a shard that cannot fit before packing for minutes and being
    // killed for memory part-way: the packed weights and the workspace on
    // their nodes, and (from a checkpoint) each thread's f32 copy of the
    // expert it quantizes.
    ASSIGN_OR_RETURN(PackedMoeLayer plan,
                     PackedMoeLayer::Plan(geo.hidden, geo.intermediate, geo.experts, po, pool));
    // Aliased: the base layer's experts once, shared by every layer.
    ASSIGN_OR_RETURN(
        PackedMoeLayer held,
        aliased ? PackedMoeLayer::Plan(geo.hidden, geo.intermediate, geo.alias, alias_po, pool)
                : PackedMoeLayer::Plan(geo.hidden, geo.intermediate, geo.experts, po, pool));
    std::map<int, int64_t> need = held.NodeBytes(pool);
    int64_t weights = 0, workspace = 0;
    for (auto& [node, bytes] : need) {
      if (!aliased) bytes *= static_cast<int64_t>(geo.moe_layers.size());
      weights += bytes;
    }
    for (const auto& [node, bytes] :
         MoeWorkspace::NodeBytes(plan, opts.max_tokens, static_cast<int>(geo.top_k), pool)) {
      need[node] += bytes;
      workspace += bytes;
    }
    // Each worker allocates its own (first touch: on its node's memory).
    const int64_t staging_per_thread = packed ? 0 : int64_t{3} * geo.hidden * geo.intermediate * 4;
    const int64_t staging = int64_t{pool.num_threads()} * staging_per_thread;
    if (staging > 0) {
      for (int n = 0; n < pool.num_nodes(); ++n)
        need[pool.mem_node(n)] += int64_t{pool.node_threads(n)} * staging_per_thread;
    }
    const MemoryLimits limits = opts.memory_limits ? *opts.memory_limits : ReadMemoryLimits();
    const std::string what = absl::StrCat(
        "this shard's packed weights (", HumanBytes(weights), ": ",
        aliased ? absl::StrCat(geo.alias, " aliased experts for ") : "", geo.moe_layers.size(),
        " MoE layers x ", plan.num_local_experts(), " experts, ", WeightFormatName(format, group),
        "), workspace (", HumanBytes(workspace), " for --max-tokens ", opts.max_tokens, ")",
        staging > 0
            ? absl::StrCat(" and packing buffers (", HumanBytes(staging), " for ",
                           pool.num_threads(), pool.num_threads() == 1 ? " thread)" : " threads)")
            : "");
    absl::Status fits = CheckMemoryFits(need, limits, what);
    if (fits.ok() && opts.log) {
      if (std::string warning = MemoryAvailableWarning(need, limits, what); !warning.empty())
        opts.log(warning);
    }
    if (!fits.ok())
      return absl::ResourceExhaustedError(
          absl::StrCat(fits.message(),
                       ": use more shards (--shard i/n), a smaller --format or --max-tokens, or "
                       "other nodes (--no-memory-check loads anyway)"));
  }

  auto cancelled = [progress] { return progress != nullptr && progress->cancel.load(); };
  LoadProgressReporter* reporter = progress ? progress->bytes : nullptr;
  int64_t expert_bytes = 0;  // packed, per local expert
  if (reporter) {
    ASSIGN_OR_RETURN(PackedMoeLayer plan,
                     PackedMoeLayer::Plan(geo.hidden, geo.intermediate, geo.experts, po, pool));
    expert_bytes = plan.expert_bytes();
    reporter->SetTotal(expert_bytes * (aliased ? geo.alias
                                               : plan.num_local_experts() *
                                                     static_cast<int64_t>(geo.moe_layers.size())));
  }
  std::shared_ptr<const PackedMoeLayer> alias_base;
  if (aliased) {
    MoeWeightsSource src = SyntheticAliasSet(SyntheticSpec(geo));
    src.expert = [inner = std::move(src.expert), &cancelled, reporter,
                  expert_bytes](int64_t e) -> absl::StatusOr<ExpertWeights> {
      if (cancelled()) return CancelledLoad();
      absl::StatusOr<ExpertWeights> w = inner(e);
      if (w.ok() && reporter) reporter->Add(expert_bytes);
      return w;
    };
    absl::StatusOr<PackedMoeLayer> base = Pack(src, alias_po, pool);
    if (absl::IsCancelled(base.status()) && cancelled()) return CancelledLoad();
    if (!base.ok()) return Annotate(base.status(), "aliased experts");
    shard->weight_bytes_ = base->expert_bytes() * base->num_local_experts();
    shard->aliased_experts_ = geo.alias;
    alias_base = std::make_shared<const PackedMoeLayer>(std::move(*base));
  }
  int max_layer = 0;
  for (int32_t l : geo.moe_layers) max_layer = std::max(max_layer, l);
  shard->slot_of_layer_.assign(static_cast<size_t>(max_layer) + 1, -1);
  if (progress) progress->layers_total = static_cast<int64_t>(geo.moe_layers.size());
  for (size_t slot = 0; slot < geo.moe_layers.size(); ++slot) {
    if (cancelled()) return CancelledLoad();
    const int layer = geo.moe_layers[slot];
    shard->slot_of_layer_[static_cast<size_t>(layer)] = static_cast<int>(slot);
    absl::StatusOr<PackedMoeLayer> packed_layer;
    if (aliased) {
      std::vector<int32_t> alias;
      for (int64_t e = po.expert_begin; e < po.expert_end; ++e)
        alias.push_back(static_cast<int32_t>(SyntheticAliasIndex(SyntheticSpec(geo), layer, e)));
      packed_layer = PackedMoeLayer::Aliased(alias_base, geo.intermediate, geo.experts, po, pool,
                                             std::move(alias));
    } else if (packed) {
      // Already quantized: unpack each expert from the file and pack it.
      packed_layer = PackedMoeLayer::Allocate(geo.hidden, geo.intermediate, geo.experts, po, pool);
      if (packed_layer.ok()) {
        std::mutex mu;
        absl::Status st;
        PackedMoeLayer& L = *packed_layer;
        pool.ParallelFor(L.num_local_experts(), [&](int64_t e, const Worker&) {
          if (cancelled()) {
            std::lock_guard<std::mutex> lock(mu);
            if (st.ok()) st = CancelledLoad();
            return;
          }
          absl::StatusOr<QuantExpert> q = packed->Expert(layer, po.expert_begin + e);
          absl::Status s = q.ok() ? PackExpert(*q, e, L) : q.status();
          if (s.ok() && reporter) reporter->Add(expert_bytes);
          std::lock_guard<std::mutex> lock(mu);
          if (st.ok() && !s.ok()) st = s;
        });
        if (!st.ok()) packed_layer = st;
      }
    } else {
      MoeWeightsSource src = ckpt ? CheckpointSource(*ckpt, cfg, layer)
                                  : SyntheticExpertSource(SyntheticSpec(geo), layer);
      // Every expert is fetched through here: a cancel stops the next one.
      src.expert = [inner = std::move(src.expert), &cancelled, reporter,
                    expert_bytes](int64_t e) -> absl::StatusOr<ExpertWeights> {
        if (cancelled()) return CancelledLoad();
        absl::StatusOr<ExpertWeights> w = inner(e);
        if (w.ok() && reporter) reporter->Add(expert_bytes);
        return w;
      };
      packed_layer = Pack(src, po, pool);
    }
    if (absl::IsCancelled(packed_layer.status()) && cancelled()) return CancelledLoad();
    if (!packed_layer.ok()) {
      return Annotate(packed_layer.status(), absl::StrCat("MoE layer ", layer));
    }
    if (!aliased)
      shard->weight_bytes_ += packed_layer->expert_bytes() * packed_layer->num_local_experts();
    shard->layers_.push_back(std::move(*packed_layer));
    if (progress) {
      progress->layers_loaded = static_cast<int64_t>(slot) + 1;
      progress->weight_bytes = shard->weight_bytes_;
    }
  }
  ASSIGN_OR_RETURN(shard->workspace_, MoeWorkspace::Create(shard->layers_.front(), opts.max_tokens,
                                                           static_cast<int>(geo.top_k), pool));
  return shard;
}

MoePhaseProfile ExpertShard::TakeProfile() {
  std::lock_guard<std::mutex> lock(compute_mu_);
  return workspace_->TakeProfile();
}

void ExpertShard::Refused(const absl::Status& status) {
  counters_.requests.fetch_add(1);
  counters_.failed.fetch_add(1);
  if (absl::IsInvalidArgument(status)) counters_.invalid.fetch_add(1);
}

absl::Status ExpertShard::Handle(const MoeCall& call, float* out, uint64_t* compute_ns) {
  counters_.requests.fetch_add(1);
  // Counted in flight before the draining check: a drain that sees zero in
  // flight has no call left that could still start computing.
  counters_.in_flight.fetch_add(1);
  if (draining_.load()) {
    counters_.in_flight.fetch_sub(1);
    counters_.failed.fetch_add(1);
    return absl::UnavailableError("expert service is draining (shutting down)");
  }
  absl::Status st = ValidateMoeCall(info_, call);
  if (!st.ok()) {
    counters_.in_flight.fetch_sub(1);
    counters_.invalid.fetch_add(1);
    counters_.failed.fetch_add(1);
    return st;
  }
  // compute_ns is this call's compute, timed inside the compute lock: not
  // the wait for another call's.
  auto since = [](std::chrono::steady_clock::time_point t0) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  };
  uint64_t ns = 0;
  if (null_compute_) {
    const auto t0 = std::chrono::steady_clock::now();
    std::fill(out, out + int64_t{call.tokens} * info_.hidden, 0.f);
    ns = since(t0);
  } else {
    MoeInput in;
    in.tokens = call.tokens;
    in.top_k = call.top_k;
    in.x = call.hidden;
    in.ids = call.ids;
    in.weights = call.weights;
    std::lock_guard<std::mutex> lock(compute_mu_);
    const auto t0 = std::chrono::steady_clock::now();
    st = RunMoe(layers_[static_cast<size_t>(slot_of_layer_[static_cast<size_t>(call.layer)])], in,
                out, *pool_, *workspace_, run_opts_);
    ns = since(t0);
  }
  if (compute_ns) *compute_ns = ns;
  counters_.compute_ns.fetch_add(ns);
  counters_.tokens.fetch_add(static_cast<uint64_t>(call.tokens));
  counters_.in_flight.fetch_sub(1);
  if (!st.ok()) counters_.failed.fetch_add(1);
  return st;
}

}  // namespace hmoe
