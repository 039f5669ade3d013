#include "expert_service/convert/packed_file.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "nlohmann/json.hpp"

namespace hmoe {
namespace {

// 2: slices quantized by QuantizeExpert (scales per slice).
constexpr const char* kVersion = "2";

int64_t Part(int64_t n, int i, int parts) { return n * i / parts; }

// One shard's output file, written expert by expert, and its checksums.
struct ShardOut {
  std::unique_ptr<SafetensorsStreamWriter> w;
  nlohmann::json sums = nlohmann::json::object();
  absl::Status Add(const TensorSpec& t, const void* data, size_t n) {
    sums[t.name] = absl::StrCat(Fnv1a64(data, n));
    return w->Append(t, data, n);
  }
};

// The tensors AddMatrix writes for a [rows][cols] matrix `name`.
std::vector<TensorSpec> MatrixSpecs(const std::string& name, WeightFormat f, int group,
                                    int64_t rows, int64_t cols) {
  switch (f) {
    case WeightFormat::kBf16:
      return {{name + ".q", DType::kBF16, {rows, cols}}};
    case WeightFormat::kInt8:
      return {{name + ".q", DType::kI8, {rows, cols}},
              {name + ".s", DType::kF32, {rows, ScalesPerRow(f, group, cols)}}};
    case WeightFormat::kInt4:
      break;
    case WeightFormat::kMxfp4:
    case WeightFormat::kInt4Bf16:
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8: {
      // The codes as stored, and the scales in their own type (e8m0 as U8).
      const ScaleType st = Traits(f).scale_type;
      const DType sd = st == ScaleType::kF32    ? DType::kF32
                       : st == ScaleType::kBf16 ? DType::kBF16
                                                : DType::kU8;
      return {{name + ".q", DType::kU8, {rows, RowBytes(f, cols)}},
              {name + ".s", sd, {ScaleRows(f, group, rows), ScalesPerRow(f, group, cols)}}};
    }
  }
  return {{name + ".q", DType::kU8, {rows, (cols + 1) / 2}},
          {name + ".s", DType::kF32, {rows, ScalesPerRow(f, group, cols)}}};
}

absl::Status AddMatrix(ShardOut& out, const std::string& name, const QuantMatrix& m) {
  const std::vector<TensorSpec> specs = MatrixSpecs(name, m.format, m.group, m.rows, m.cols);
  if (m.format == WeightFormat::kBf16) return out.Add(specs[0], m.bf16.data(), m.bf16.size() * 2);
  if (!m.packed.empty()) {
    RETURN_IF_ERROR(out.Add(specs[0], m.packed.data(), m.packed.size()));
    switch (Traits(m.format).scale_type) {
      case ScaleType::kBf16:
        return out.Add(specs[1], m.scale_bf16.data(), m.scale_bf16.size() * 2);
      case ScaleType::kE8M0:
        return out.Add(specs[1], m.scale_e8m0.data(), m.scale_e8m0.size());
      case ScaleType::kF32:
      case ScaleType::kNone:
        break;
    }
    return out.Add(specs[1], m.scale.data(), m.scale.size() * 4);
  }
  if (m.format == WeightFormat::kInt8) {
    RETURN_IF_ERROR(out.Add(specs[0], m.q.data(), m.q.size()));
  } else {
    const int64_t rows = m.rows, cols = m.cols, nb = (cols + 1) / 2;
    std::vector<uint8_t> q(static_cast<size_t>(rows * nb), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c)
        PackI4(q.data() + r * nb, c, m.q[static_cast<size_t>(r * cols + c)]);
    }
    RETURN_IF_ERROR(out.Add(specs[0], q.data(), q.size()));
  }
  return out.Add(specs[1], m.scale.data(), m.scale.size() * 4);
}

std::string LayersString(const ModelConfig& cfg) {
  std::string s;
  for (size_t l = 0; l < cfg.layers.size(); ++l) {
    if (cfg.layers[l].moe) absl::StrAppend(&s, s.empty() ? "" : ",", l);
  }
  return s;
}

}  // namespace

std::string PackedFileName(SplitMode split, int shard, int num_shards) {
  return absl::StrCat("experts-", SplitModeName(split), "-", shard, "of", num_shards,
                      ".safetensors");
}

namespace {
// fsync of a file or directory; INTERNAL naming it.
absl::Status SyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat(path, ": open: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat(path, ": fsync: ", std::strerror(err)));
  return absl::OkStatus();
}
}  // namespace

uint64_t Fnv1a64(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

PackOptions ShardPackOptions(int64_t intermediate, int64_t num_experts, SplitMode split, int shard,
                             int num_shards, WeightFormat format, int group) {
  PackOptions o;
  o.format = format;
  o.group = IsGrouped(format) ? group : 128;
  if (split == SplitMode::kEp) {
    o.expert_begin = Part(num_experts, shard, num_shards);
    o.expert_end = Part(num_experts, shard + 1, num_shards);
    o.i_begin = 0;
    o.i_end = intermediate;
  } else {
    o.expert_begin = 0;
    o.expert_end = num_experts;
    o.i_begin = Part(intermediate, shard, num_shards);
    o.i_end = Part(intermediate, shard + 1, num_shards);
  }
  return o;
}

absl::StatusOr<std::string> DefaultConvertFormat(const ModelConfig& cfg, const std::string& dir) {
  ASSIGN_OR_RETURN(const NativeExpertFormat native, CheckpointExpertFormat(cfg, dir));
  if (native.format == WeightFormat::kBf16) return std::string("int4g64");
  return WeightFormatName(native.format, native.group);
}

absl::Status ConvertModel(const std::string& model_dir, const std::string& out_dir,
                          const ConvertOptions& opts) {
  ASSIGN_OR_RETURN(ModelConfig cfg, LoadModelConfig(model_dir));
  std::string format = opts.format;
  if (format.empty()) {
    ASSIGN_OR_RETURN(format, DefaultConvertFormat(cfg, model_dir));
  }
  int group = 64;
  ASSIGN_OR_RETURN(WeightFormat f, ParseWeightFormat(format, &group));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(model_dir));
  ASSIGN_OR_RETURN(const std::string source_fingerprint, RoutedExpertsFingerprint(*ckpt, cfg));
  const int64_t H = cfg.hidden_size, I = cfg.moe.intermediate_size, E = cfg.moe.num_experts;
  const int n = opts.shards;
  if (n < 1 || (opts.split == SplitMode::kEp ? n > E : n > I)) {
    return absl::InvalidArgumentError(absl::StrCat("--shards: ", n, " does not fit the model"));
  }
  if (opts.threads < 0)
    return absl::InvalidArgumentError(absl::StrCat("--threads: ", opts.threads, " is negative"));
  // Default: the CPUs this process may run on (not the machine's: a
  // container or taskset limits both speed and the memory budget).
  int threads = opts.threads;
  if (threads == 0) {
    cpu_set_t set;
    threads = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    threads = std::clamp(threads, 1, 64);
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": ", ec.message()));
  std::vector<PackOptions> shard_opts;
  for (int i = 0; i < n; ++i)
    shard_opts.push_back(ShardPackOptions(I, E, opts.split, i, n, f, group));

  // Plan every shard file (tensor order = the order written below) and open
  // it with room for a header whose checksums are all at their longest.
  std::vector<ShardOut> outs(static_cast<size_t>(n));
  std::vector<std::map<std::string, std::string>> metas(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const PackOptions& po = shard_opts[static_cast<size_t>(i)];
    const int64_t is = po.i_end - po.i_begin;
    std::vector<TensorSpec> plan;
    for (size_t l = 0; l < cfg.layers.size(); ++l) {
      if (!cfg.layers[l].moe) continue;
      for (int64_t e = po.expert_begin; e < po.expert_end; ++e) {
        const std::string p = absl::StrCat(l, ".", e, ".");
        for (auto&& t : MatrixSpecs(p + "gate", f, po.group, is, H)) plan.push_back(std::move(t));
        for (auto&& t : MatrixSpecs(p + "up", f, po.group, is, H)) plan.push_back(std::move(t));
        for (auto&& t : MatrixSpecs(p + "down", f, po.group, H, is)) plan.push_back(std::move(t));
      }
    }
    metas[static_cast<size_t>(i)] = {{"hmoe_packed_version", kVersion},
                                     {"format", WeightFormatName(f, group)},
                                     {"model_type", cfg.model_type},
                                     {"hidden", absl::StrCat(H)},
                                     {"intermediate", absl::StrCat(I)},
                                     {"num_experts", absl::StrCat(E)},
                                     {"layers", LayersString(cfg)},
                                     {"shard", absl::StrCat(i)},
                                     {"num_shards", absl::StrCat(n)},
                                     {"split", SplitModeName(opts.split)},
                                     {"i_begin", absl::StrCat(po.i_begin)},
                                     {"i_end", absl::StrCat(po.i_end)},
                                     {"expert_begin", absl::StrCat(po.expert_begin)},
                                     {"expert_end", absl::StrCat(po.expert_end)},
                                     {"source_fingerprint", source_fingerprint}};
    std::map<std::string, std::string> longest = metas[static_cast<size_t>(i)];
    nlohmann::json sums = nlohmann::json::object();
    for (const TensorSpec& t : plan) sums[t.name] = absl::StrCat(~uint64_t{0});
    longest["checksums"] = sums.dump();
    longest["conversion_id"] = std::string(16, 'f');
    const uint64_t reserve = SafetensorsStreamWriter::HeaderBytes(plan, longest);
    const std::string path = out_dir + "/" + PackedFileName(opts.split, i, n) + ".tmp";
    ASSIGN_OR_RETURN(outs[static_cast<size_t>(i)].w,
                     SafetensorsStreamWriter::Create(path, std::move(plan), reserve));
  }

  // Quantize `threads` experts at a time, write them in order: at most that
  // many experts' weights are in memory at once.
  struct Slot {
    absl::Status status;
    std::vector<std::optional<QuantExpert>> per_shard;
  };
  std::vector<Slot> slots(static_cast<size_t>(threads));
  int moe_done = 0, moe_total = 0;
  for (const auto& layer_cfg : cfg.layers) moe_total += layer_cfg.moe ? 1 : 0;
  for (size_t l = 0; l < cfg.layers.size(); ++l) {
    if (!cfg.layers[l].moe) continue;
    const int layer = static_cast<int>(l);
    const MoeWeightsSource src = CheckpointSource(*ckpt, cfg, layer);
    for (int64_t e0 = 0; e0 < E; e0 += threads) {
      if (opts.cancelled && opts.cancelled())
        return absl::CancelledError(absl::StrCat("convert cancelled at MoE layer ", layer));
      const int64_t e1 = std::min<int64_t>(E, e0 + threads);
      auto quantize = [&](int64_t e) {
        Slot& slot = slots[static_cast<size_t>(e - e0)];
        slot.status = absl::OkStatus();
        slot.per_shard.assign(static_cast<size_t>(n), std::nullopt);
        auto w = src.expert(e);
        if (!w.ok()) {
          slot.status = w.status();
          return;
        }
        for (int i = 0; i < n; ++i) {
          const PackOptions& po = shard_opts[static_cast<size_t>(i)];
          if (e < po.expert_begin || e >= po.expert_end) continue;
          auto q = QuantizeExpert(*w, src, po);
          if (!q.ok()) {
            slot.status = q.status();
            return;
          }
          slot.per_shard[static_cast<size_t>(i)] = *std::move(q);
        }
      };
      std::vector<std::thread> pool;
      absl::Status started;
      for (int64_t e = e0 + 1; e < e1 && started.ok(); ++e) {
        try {
          pool.emplace_back(quantize, e);
        } catch (const std::system_error& err) {  // e.g. the pids limit
          started = absl::ResourceExhaustedError(
              absl::StrCat("--threads ", threads, ": cannot start a thread: ", err.what()));
        }
      }
      if (started.ok()) quantize(e0);
      for (std::thread& t : pool) t.join();
      RETURN_IF_ERROR(started);
      for (int64_t e = e0; e < e1; ++e) {
        Slot& slot = slots[static_cast<size_t>(e - e0)];
        RETURN_IF_ERROR(slot.status);
        for (int i = 0; i < n; ++i) {
          auto& q = slot.per_shard[static_cast<size_t>(i)];
          if (!q) continue;
          ShardOut& out = outs[static_cast<size_t>(i)];
          const std::string p = absl::StrCat(layer, ".", e, ".");
          RETURN_IF_ERROR(AddMatrix(out, p + "gate", q->gate));
          RETURN_IF_ERROR(AddMatrix(out, p + "up", q->up));
          RETURN_IF_ERROR(AddMatrix(out, p + "down", q->down));
          q.reset();
        }
      }
    }
    ++moe_done;
    if (opts.progress) opts.progress(layer, moe_done, moe_total);
  }
  // Every file complete before any is renamed: a failure to finish one (a
  // full disk at the last write) leaves a previous conversion's files whole,
  // not half old and half new. Finished .tmp files are not removed by their
  // writers, so a failure removes them here.
  auto remove_tmp_from = [&](int first) {
    for (int j = first; j < n; ++j)
      std::filesystem::remove(outs[static_cast<size_t>(j)].w->path(), ec);
  };
  // One id for the whole conversion, from every shard's checksums and layout:
  // the same for any thread count, different for other weights.
  std::string all;
  for (int i = 0; i < n; ++i) {
    absl::StrAppend(&all, PackedFileName(opts.split, i, n), "\n",
                    metas[static_cast<size_t>(i)]["format"], "\n",
                    outs[static_cast<size_t>(i)].sums.dump(), "\n");
  }
  const std::string conversion_id = absl::StrFormat("%016x", Fnv1a64(all.data(), all.size()));
  for (int i = 0; i < n; ++i) {
    ShardOut& out = outs[static_cast<size_t>(i)];
    for (const auto& [k, v] : metas[static_cast<size_t>(i)]) out.w->SetMetadata(k, v);
    out.w->SetMetadata("checksums", out.sums.dump());
    out.w->SetMetadata("conversion_id", conversion_id);
    absl::Status st = out.w->Finish();
    if (st.ok()) st = SyncPath(out.w->path(), O_RDONLY);
    if (!st.ok()) {
      remove_tmp_from(0);
      return st;
    }
  }
  for (int i = 0; i < n; ++i) {
    const std::string path = out_dir + "/" + PackedFileName(opts.split, i, n);
    std::filesystem::rename(outs[static_cast<size_t>(i)].w->path(), path, ec);
    if (ec) {
      const std::string why = ec.message();
      remove_tmp_from(i);
      return absl::InternalError(absl::StrCat(path, ": ", why));
    }
  }
  return SyncPath(out_dir, O_RDONLY | O_DIRECTORY);  // the renames
}

absl::StatusOr<std::unique_ptr<PackedExperts>> PackedExperts::Open(const std::string& dir,
                                                                   const ModelConfig& cfg,
                                                                   SplitMode split, int shard,
                                                                   int num_shards) {
  const std::string path = dir + "/" + PackedFileName(split, shard, num_shards);
  auto p = std::unique_ptr<PackedExperts>(new PackedExperts());
  ASSIGN_OR_RETURN(p->file_, SafetensorsFile::Open(path));
  const auto& m = p->file_->metadata();
  auto get = [&](const std::string& k) -> std::string {
    auto it = m.find(k);
    return it == m.end() ? std::string() : it->second;
  };
  auto mismatch = [&](const std::string& field, const std::string& have, const std::string& want) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": packed for ", field, " ", have, ", but the model/shard has ", want));
  };
  if (get("hmoe_packed_version") != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not an hmoe packed expert file (version \"", get("hmoe_packed_version"), "\")"));
  }
  const std::pair<const char*, std::string> checks[] = {
      {"model_type", cfg.model_type},
      {"hidden", absl::StrCat(cfg.hidden_size)},
      {"intermediate", absl::StrCat(cfg.moe.intermediate_size)},
      {"num_experts", absl::StrCat(cfg.moe.num_experts)},
      {"layers", LayersString(cfg)},
      {"shard", absl::StrCat(shard)},
      {"num_shards", absl::StrCat(num_shards)},
      {"split", SplitModeName(split)}};
  for (const auto& [k, want] : checks) {
    if (get(k) != want) return mismatch(k, get(k), want);
  }
  p->conversion_id_ = get("conversion_id");
  p->source_fingerprint_ = get("source_fingerprint");
  int group = 64;
  ASSIGN_OR_RETURN(p->format_, ParseWeightFormat(get("format"), &group));
  p->group_ = group;
  p->hidden_ = cfg.hidden_size;
  if (!absl::SimpleAtoi(get("i_begin"), &p->i_begin_) ||
      !absl::SimpleAtoi(get("i_end"), &p->i_end_) ||
      !absl::SimpleAtoi(get("expert_begin"), &p->e_begin_) ||
      !absl::SimpleAtoi(get("expert_end"), &p->e_end_)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad slice metadata"));
  }
  auto sums = nlohmann::json::parse(get("checksums"), nullptr, false);
  if (!sums.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": bad checksums"));
  for (const TensorEntry& t : p->file_->entries()) {
    if (!sums.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": no checksum for ", t.name));
    }
    if (!sums[t.name].is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad checksum entry for ", t.name, " (not a string)"));
    }
    p->sums_[t.name] = sums[t.name].get<std::string>();
  }
  p->path_ = path;
  return p;
}

absl::StatusOr<QuantExpert> PackedExperts::Expert(int layer, int64_t e) const {
  if (e < e_begin_ || e >= e_end_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": holds experts [", e_begin_, ", ", e_end_, "), not expert ", e));
  }
  const int64_t H = hidden_, is = i_end_ - i_begin_;
  auto load = [&](const std::string& proj, int64_t rows, int64_t cols,
                  QuantMatrix* m) -> absl::Status {
    const std::string base = absl::StrCat(layer, ".", e, ".", proj);
    auto tensor = [&](const std::string& name) -> absl::StatusOr<Tensor> {
      ASSIGN_OR_RETURN(Tensor t, file_->Get(name));
      auto it = sums_.find(name);
      if (it == sums_.end() ||
          it->second != absl::StrCat(Fnv1a64(t.raw(), static_cast<size_t>(t.nbytes())))) {
        return absl::DataLossError(absl::StrCat(path_, ": checksum mismatch in ", name));
      }
      return t;
    };
    m->format = format_;
    m->group = IsGrouped(format_) ? group_ : 0;
    m->rows = rows;
    m->cols = cols;
    ASSIGN_OR_RETURN(Tensor q, tensor(base + ".q"));
    auto shape_error = [&](const Tensor& t) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": ", base, " has shape ", ShapeString(t.shape()), " / dtype ",
                       DTypeName(t.dtype()), ", expected [", rows, ", ", cols, "] ",
                       WeightFormatName(format_, group_)));
    };
    // What convert wrote for this matrix: .q, then .s unless bf16.
    const std::vector<TensorSpec> want = MatrixSpecs(base, format_, group_, rows, cols);
    const size_t n = static_cast<size_t>(rows * cols);
    if (q.dtype() != want[0].dtype || q.shape() != want[0].shape) return shape_error(q);
    if (format_ == WeightFormat::kBf16) {
      m->bf16.assign(q.data<uint16_t>(), q.data<uint16_t>() + n);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(Tensor s, tensor(base + ".s"));
    if (s.dtype() != want[1].dtype || s.shape() != want[1].shape) return shape_error(s);
    const int64_t qcols = want[0].shape[1];
    switch (format_) {
      case WeightFormat::kBf16:
      case WeightFormat::kInt8:
      case WeightFormat::kInt4:
        break;
      case WeightFormat::kMxfp4:
      case WeightFormat::kInt4Bf16:
      case WeightFormat::kFp8:
      case WeightFormat::kMxfp8: {
        m->packed.assign(q.data<uint8_t>(), q.data<uint8_t>() + q.numel());
        const ScaleType st = Traits(format_).scale_type;
        if (st == ScaleType::kBf16) {
          m->scale_bf16.assign(s.data<uint16_t>(), s.data<uint16_t>() + s.numel());
        } else if (st == ScaleType::kE8M0) {
          m->scale_e8m0.assign(s.data<uint8_t>(), s.data<uint8_t>() + s.numel());
          for (size_t i = 0; i < m->scale_e8m0.size(); ++i)
            if (m->scale_e8m0[i] == kE8M0NaN)
              return absl::DataLossError(
                  absl::StrCat(path_, ": ", base, ".s[", i, "] is the e8m0 NaN code 0xFF"));
        } else {
          m->scale.assign(s.data<float>(), s.data<float>() + s.numel());
        }
        return absl::OkStatus();
      }
    }
    m->scale.assign(s.data<float>(), s.data<float>() + s.numel());
    if (format_ == WeightFormat::kInt8) {
      m->q.assign(q.data<int8_t>(), q.data<int8_t>() + n);
    } else {
      m->q.resize(n);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c)
          m->q[static_cast<size_t>(r * cols + c)] = UnpackI4(q.data<uint8_t>() + r * qcols, c);
      }
    }
    return absl::OkStatus();
  };
  QuantExpert x;
  RETURN_IF_ERROR(load("gate", is, H, &x.gate));
  RETURN_IF_ERROR(load("up", is, H, &x.up));
  RETURN_IF_ERROR(load("down", H, is, &x.down));
  return x;
}

}  // namespace hmoe
