#include "expert_service/server/expert_shard.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "expert_service/server/packed_file.h"

namespace hmoe {
namespace {

int64_t Part(int64_t n, int i, int parts) { return n * i / parts; }

float RoundBf16(float f) { return Bf16ToF32(F32ToBf16(f)); }

struct Geometry {
  std::string model_type;
  int64_t hidden = 0, intermediate = 0, experts = 0, top_k = 0;
  std::vector<int32_t> moe_layers;
  uint64_t seed = 1;
};

absl::StatusOr<Geometry> ParseSynthetic(const std::string& spec) {
  Geometry g;
  g.model_type = "synthetic";
  int64_t layers = 1;
  for (absl::string_view kv : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    int64_t v = 0;
    if (!absl::SimpleAtoi(p.second, &v) || v <= 0) {
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
    else if (p.first == "seed")
      g.seed = static_cast<uint64_t>(v);
    else
      return absl::InvalidArgumentError(absl::StrCat("--synthetic: unknown key ", p.first));
  }
  if (g.hidden == 0 || g.intermediate == 0 || g.experts == 0 || g.top_k == 0) {
    return absl::InvalidArgumentError(
        "--synthetic needs hidden=, intermediate=, experts=, top_k= (and optionally layers=, "
        "seed=)");
  }
  for (int64_t l = 0; l < layers; ++l) g.moe_layers.push_back(static_cast<int32_t>(l));
  return g;
}

}  // namespace

absl::StatusOr<ServeFormat> ParseServeFormat(const std::string& s, int* group) {
  if (s == "bf16") return ServeFormat::kBf16;
  if (s == "int8") return ServeFormat::kInt8;
  if (s.rfind("int4", 0) == 0) {
    int g = 64;
    if (s.size() > 4) {
      if (s.substr(4, 1) != "g" || !absl::SimpleAtoi(s.substr(5), &g) ||
          (g != 32 && g != 64 && g != 128)) {
        return absl::InvalidArgumentError(
            absl::StrCat("format: \"", s, "\"; int4 groups are int4g32, int4g64, int4g128"));
      }
    }
    if (group) *group = g;
    return ServeFormat::kInt4;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("format: \"", s, "\" is not one of bf16, int8, int4g32, int4g64, int4g128"));
}

std::string ServeFormatName(ServeFormat f, int group) {
  switch (f) {
    case ServeFormat::kBf16:
      return "bf16";
    case ServeFormat::kInt8:
      return "int8";
    case ServeFormat::kInt4:
      return absl::StrCat("int4g", group);
  }
  return "?";
}

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
  if (max_tokens < 1 || max_tokens > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-tokens: ", max_tokens, " outside [1, 2^20]"));
  }
  return absl::OkStatus();
}

std::string ShardOptions::ToString() const {
  return absl::StrCat("source=",
                      !synthetic.empty()   ? "synthetic:" + synthetic
                      : packed_dir.empty() ? model_dir
                                           : packed_dir + " (config " + model_dir + ")",
                      " shard=", shard_index, "/", num_shards, " split=", SplitModeName(split),
                      " format=", ServeFormatName(format, group), " max_tokens=", max_tokens,
                      null_compute ? " null_compute=1" : "");
}

void QuantizeInPlace(ServeFormat f, int group, int64_t rows, int64_t cols, float* w) {
  if (f == ServeFormat::kBf16) {
    for (int64_t i = 0; i < rows * cols; ++i) w[i] = RoundBf16(w[i]);
    return;
  }
  const int64_t g = f == ServeFormat::kInt8 ? cols : group;
  const float qmax = f == ServeFormat::kInt8 ? 127.f : 7.f;
  const float qmin = f == ServeFormat::kInt8 ? -127.f : -8.f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += g) {
      float* p = w + r * cols + c0;
      const int64_t n = std::min(g, cols - c0);
      float amax = 0;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(p[i]));
      const float s = amax / qmax;
      for (int64_t i = 0; i < n; ++i) {
        p[i] = s == 0 ? 0.f : std::clamp(std::nearbyint(p[i] / s), qmin, qmax) * s;
      }
    }
  }
}

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
    for (size_t l = 0; l < cfg.layers.size(); ++l) {
      if (cfg.layers[l].moe) geo.moe_layers.push_back(static_cast<int32_t>(l));
    }
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
  ServeFormat format = opts.format;
  int group = opts.group;
  if (packed) {
    format = packed->format();
    group = packed->group();
  }
  info.weight_format = ServeFormatName(format, group);
  shard->format_ = format;
  shard->null_compute_ = opts.null_compute;
  if (opts.split == SplitMode::kEp) {
    if (opts.num_shards > geo.experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shard: ", opts.num_shards, " ep shards for ", geo.experts, " experts"));
    }
    info.expert_begin = Part(geo.experts, opts.shard_index, opts.num_shards);
    info.expert_end = Part(geo.experts, opts.shard_index + 1, opts.num_shards);
    info.i_begin = 0;
    info.i_end = geo.intermediate;
  } else {
    if (opts.num_shards > geo.intermediate) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shard: ", opts.num_shards, " tp shards for intermediate size ", geo.intermediate));
    }
    info.expert_begin = 0;
    info.expert_end = geo.experts;
    info.i_begin = Part(geo.intermediate, opts.shard_index, opts.num_shards);
    info.i_end = Part(geo.intermediate, opts.shard_index + 1, opts.num_shards);
  }
  const int64_t H = geo.hidden, I = geo.intermediate, i0 = info.i_begin, i1 = info.i_end,
                is = i1 - i0;
  int max_layer = 0;
  for (int32_t l : geo.moe_layers) max_layer = std::max(max_layer, l);
  shard->slot_of_layer_.assign(static_cast<size_t>(max_layer) + 1, -1);
  if (progress) progress->layers_total = static_cast<int64_t>(geo.moe_layers.size());
  for (size_t slot = 0; slot < geo.moe_layers.size(); ++slot) {
    const int layer = geo.moe_layers[slot];
    shard->slot_of_layer_[static_cast<size_t>(layer)] = static_cast<int>(slot);
    std::vector<ExpertSlice> experts;
    for (int64_t e = info.expert_begin; e < info.expert_end; ++e) {
      std::vector<float> gate, up, down;
      if (packed) {
        ASSIGN_OR_RETURN(auto m, packed->Expert(layer, static_cast<int>(e), i0, i1));
        experts.push_back(std::move(m));
        continue;
      }
      if (ckpt) {
        const int ei = static_cast<int>(e);
        ASSIGN_OR_RETURN(gate, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kGate, I, H));
        ASSIGN_OR_RETURN(up, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kUp, I, H));
        ASSIGN_OR_RETURN(down, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kDown, H, I));
      } else {
        std::mt19937_64 rng(geo.seed * 1000003u + static_cast<uint64_t>(layer) * 7919u +
                            static_cast<uint64_t>(e));
        std::uniform_real_distribution<float> du(-1.f, 1.f);
        const float sg = 1.f / std::sqrt(static_cast<float>(H)),
                    sd = 1.f / std::sqrt(static_cast<float>(I));
        gate.resize(static_cast<size_t>(I * H));
        up.resize(gate.size());
        down.resize(gate.size());
        for (auto& v : gate) v = du(rng) * sg;
        for (auto& v : up) v = du(rng) * sg;
        for (auto& v : down) v = du(rng) * sd;
      }
      // Quantize the whole matrices, then slice: every shard count sees the same weights.
      QuantizeInPlace(format, group, I, H, gate.data());
      QuantizeInPlace(format, group, I, H, up.data());
      QuantizeInPlace(format, group, H, I, down.data());
      ExpertSlice s;
      s.gate.assign(gate.begin() + i0 * H, gate.begin() + i1 * H);
      s.up.assign(up.begin() + i0 * H, up.begin() + i1 * H);
      s.down.resize(static_cast<size_t>(H * is));
      for (int64_t h = 0; h < H; ++h) {
        std::copy(down.begin() + h * I + i0, down.begin() + h * I + i1, s.down.begin() + h * is);
      }
      experts.push_back(std::move(s));
    }
    const int64_t fmt_bytes = format == ServeFormat::kBf16 ? 2 : 1;  // int4 counted as a byte
    shard->weight_bytes_ += static_cast<int64_t>(experts.size()) * 3 * H * is * fmt_bytes;
    shard->layers_.push_back(std::move(experts));
    if (progress) {
      progress->layers_loaded = static_cast<int64_t>(slot) + 1;
      progress->weight_bytes = shard->weight_bytes_;
    }
  }
  return shard;
}

absl::Status ExpertShard::Handle(const MoeCall& call, float* out, uint64_t* compute_ns) {
  counters_.requests.fetch_add(1);
  if (draining_.load()) {
    counters_.failed.fetch_add(1);
    return absl::UnavailableError("expert service is draining (shutting down)");
  }
  absl::Status st = ValidateMoeCall(info_, call);
  if (!st.ok()) {
    counters_.invalid.fetch_add(1);
    counters_.failed.fetch_add(1);
    return st;
  }
  counters_.in_flight.fetch_add(1);
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(compute_mu_);
    st = Compute(slot_of_layer_[static_cast<size_t>(call.layer)], call, out);
  }
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  if (compute_ns) *compute_ns = ns;
  counters_.compute_ns.fetch_add(ns);
  counters_.tokens.fetch_add(static_cast<uint64_t>(call.tokens));
  counters_.in_flight.fetch_sub(1);
  if (!st.ok()) counters_.failed.fetch_add(1);
  return st;
}

absl::Status ExpertShard::Compute(int slot, const MoeCall& call, float* out) {
  const int64_t H = info_.hidden, is = info_.i_end - info_.i_begin;
  const auto& experts = layers_[static_cast<size_t>(slot)];
  std::vector<float> x(static_cast<size_t>(H)), h(static_cast<size_t>(is)),
      y(static_cast<size_t>(H));
  std::fill(out, out + call.tokens * H, 0.f);
  if (null_compute_) return absl::OkStatus();
  for (int t = 0; t < call.tokens; ++t) {
    for (int64_t c = 0; c < H; ++c) x[static_cast<size_t>(c)] = Bf16ToF32(call.hidden[t * H + c]);
    float* o = out + t * H;
    for (int j = 0; j < call.top_k; ++j) {
      const int64_t e = call.ids[t * call.top_k + j];
      if (e < info_.expert_begin || e >= info_.expert_end) continue;
      const ExpertSlice& ex = experts[static_cast<size_t>(e - info_.expert_begin)];
      for (int64_t i = 0; i < is; ++i) {
        const float* gw = ex.gate.data() + i * H;
        const float* uw = ex.up.data() + i * H;
        double g = 0, u = 0;
        for (int64_t c = 0; c < H; ++c) {
          g += static_cast<double>(gw[c]) * x[static_cast<size_t>(c)];
          u += static_cast<double>(uw[c]) * x[static_cast<size_t>(c)];
        }
        const float gf = static_cast<float>(g), uf = static_cast<float>(u);
        h[static_cast<size_t>(i)] = RoundBf16(gf / (1.f + std::exp(-gf)) * uf);
      }
      const float w = call.weights[t * call.top_k + j];
      for (int64_t c = 0; c < H; ++c) {
        const float* dw = ex.down.data() + c * is;
        double acc = 0;
        for (int64_t i = 0; i < is; ++i)
          acc += static_cast<double>(dw[i]) * h[static_cast<size_t>(i)];
        o[c] += w * static_cast<float>(acc);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace hmoe
