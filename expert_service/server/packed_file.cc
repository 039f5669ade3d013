#include "expert_service/server/packed_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hmoe {
namespace {

constexpr const char* kVersion = "1";

int64_t Part(int64_t n, int i, int parts) { return n * i / parts; }

// q and scales of a whole matrix, exactly as QuantizeInPlace rounds it.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scale;  // [rows][groups]
  int64_t groups = 0, group = 0;
};

Quantized Quantize(ServeFormat f, int group, int64_t rows, int64_t cols, const float* w) {
  Quantized r;
  r.group = f == ServeFormat::kInt8 ? cols : group;
  r.groups = (cols + r.group - 1) / r.group;
  const float qmax = f == ServeFormat::kInt8 ? 127.f : 7.f;
  const float qmin = f == ServeFormat::kInt8 ? -127.f : -8.f;
  r.q.resize(static_cast<size_t>(rows * cols));
  r.scale.resize(static_cast<size_t>(rows * r.groups));
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t gi = 0; gi < r.groups; ++gi) {
      const int64_t c0 = gi * r.group, n = std::min(r.group, cols - c0);
      const float* p = w + row * cols + c0;
      float amax = 0;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(p[i]));
      const float s = amax / qmax;
      r.scale[static_cast<size_t>(row * r.groups + gi)] = s;
      for (int64_t i = 0; i < n; ++i) {
        r.q[static_cast<size_t>(row * cols + c0 + i)] =
            s == 0 ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(p[i] / s), qmin, qmax));
      }
    }
  }
  return r;
}

struct Writer {
  SafetensorsWriter w;
  nlohmann::json sums = nlohmann::json::object();
  absl::Status Add(const std::string& name, DType dt, Shape shape, const void* data, size_t n) {
    sums[name] = absl::StrCat(Fnv1a64(data, n));
    return w.Add(name, dt, std::move(shape), data, n);
  }
};

// Writes rows [r0, r1) x cols [c0, c1) of a quantized matrix.
absl::Status AddSlice(Writer& out, const std::string& name, ServeFormat f,
                      const std::vector<float>& full, const Quantized* qz, int64_t cols, int64_t r0,
                      int64_t r1, int64_t c0, int64_t c1) {
  const int64_t rows = r1 - r0, n = c1 - c0;
  if (f == ServeFormat::kBf16) {
    std::vector<uint16_t> b(static_cast<size_t>(rows * n));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < n; ++c)
        b[static_cast<size_t>(r * n + c)] =
            F32ToBf16(full[static_cast<size_t>((r0 + r) * cols + c0 + c)]);
    }
    return out.Add(name + ".q", DType::kBF16, {rows, n}, b.data(), b.size() * 2);
  }
  const int64_t g0 = c0 / qz->group, g1 = (c1 - 1) / qz->group + 1;
  std::vector<float> s(static_cast<size_t>(rows * (g1 - g0)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = g0; g < g1; ++g)
      s[static_cast<size_t>(r * (g1 - g0) + g - g0)] =
          qz->scale[static_cast<size_t>((r0 + r) * qz->groups + g)];
  }
  if (f == ServeFormat::kInt8) {
    std::vector<int8_t> q(static_cast<size_t>(rows * n));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(q.data() + r * n, qz->q.data() + (r0 + r) * cols + c0, static_cast<size_t>(n));
    }
    RETURN_IF_ERROR(out.Add(name + ".q", DType::kI8, {rows, n}, q.data(), q.size()));
  } else {
    const int64_t nb = (n + 1) / 2;
    std::vector<uint8_t> q(static_cast<size_t>(rows * nb), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < n; ++c)
        PackI4(q.data() + r * nb, c, qz->q[static_cast<size_t>((r0 + r) * cols + c0 + c)]);
    }
    RETURN_IF_ERROR(out.Add(name + ".q", DType::kU8, {rows, nb}, q.data(), q.size()));
  }
  return out.Add(name + ".s", DType::kF32, {rows, g1 - g0}, s.data(), s.size() * 4);
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

uint64_t Fnv1a64(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

absl::StatusOr<std::vector<float>> LoadExpertMatrix(const Checkpoint& ckpt, const ModelConfig& cfg,
                                                    int layer, int expert, ExpertProj proj,
                                                    int64_t rows, int64_t cols) {
  const std::string name = ExpertWeightName(cfg, layer, expert, proj);
  ASSIGN_OR_RETURN(Tensor t, ckpt.Get(name));
  if (t.rank() != 2 || t.dim(0) != rows || t.dim(1) != cols) {
    return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", name, " has shape ",
                                                   ShapeString(t.shape()), ", expected [", rows,
                                                   ", ", cols, "]"));
  }
  if (t.dtype() == DType::kF8E4M3) {
    const std::string sname = ScaleInvName(name);
    ASSIGN_OR_RETURN(Tensor s, ckpt.Get(sname));
    const int64_t block =
        cfg.quantization.weight_block.empty() ? 128 : cfg.quantization.weight_block[0];
    if (s.dtype() != DType::kF32 || s.rank() != 2 || s.dim(0) != (rows + block - 1) / block ||
        s.dim(1) != (cols + block - 1) / block) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", sname, " has shape ",
                                                     ShapeString(s.shape()),
                                                     ", not the block scales of ", name));
    }
    std::vector<float> out(static_cast<size_t>(rows * cols));
    DequantFp8BlockToF32(t.data<uint8_t>(), rows, cols, s.data<float>(), block, out.data());
    return out;
  }
  return t.ToF32();
}

absl::Status ConvertModel(const std::string& model_dir, const std::string& out_dir,
                          const ConvertOptions& opts) {
  int group = 64;
  ASSIGN_OR_RETURN(ServeFormat f, ParseServeFormat(opts.format, &group));
  ASSIGN_OR_RETURN(ModelConfig cfg, LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(model_dir));
  const int64_t H = cfg.hidden_size, I = cfg.moe.intermediate_size, E = cfg.moe.num_experts;
  const int n = opts.shards;
  if (n < 1 || (opts.split == SplitMode::kEp ? n > E : n > I)) {
    return absl::InvalidArgumentError(absl::StrCat("--shards: ", n, " does not fit the model"));
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(out_dir, ": ", ec.message()));
  std::vector<Writer> writers(static_cast<size_t>(n));
  for (size_t l = 0; l < cfg.layers.size(); ++l) {
    if (!cfg.layers[l].moe) continue;
    const int layer = static_cast<int>(l);
    for (int64_t e = 0; e < E; ++e) {
      const int ei = static_cast<int>(e);
      ASSIGN_OR_RETURN(auto gate, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kGate, I, H));
      ASSIGN_OR_RETURN(auto up, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kUp, I, H));
      ASSIGN_OR_RETURN(auto down, LoadExpertMatrix(*ckpt, cfg, layer, ei, ExpertProj::kDown, H, I));
      Quantized qg, qu, qd;
      if (f == ServeFormat::kBf16) {
        QuantizeInPlace(f, group, I, H, gate.data());
        QuantizeInPlace(f, group, I, H, up.data());
        QuantizeInPlace(f, group, H, I, down.data());
      } else {
        qg = Quantize(f, group, I, H, gate.data());
        qu = Quantize(f, group, I, H, up.data());
        qd = Quantize(f, group, H, I, down.data());
      }
      for (int i = 0; i < n; ++i) {
        int64_t i0 = 0, i1 = I;
        if (opts.split == SplitMode::kEp) {
          if (e < Part(E, i, n) || e >= Part(E, i + 1, n)) continue;
        } else {
          i0 = Part(I, i, n);
          i1 = Part(I, i + 1, n);
        }
        Writer& w = writers[static_cast<size_t>(i)];
        const std::string p = absl::StrCat(layer, ".", e, ".");
        RETURN_IF_ERROR(AddSlice(w, p + "gate", f, gate, &qg, H, i0, i1, 0, H));
        RETURN_IF_ERROR(AddSlice(w, p + "up", f, up, &qu, H, i0, i1, 0, H));
        RETURN_IF_ERROR(AddSlice(w, p + "down", f, down, &qd, I, 0, H, i0, i1));
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    Writer& w = writers[static_cast<size_t>(i)];
    const bool ep = opts.split == SplitMode::kEp;
    const std::map<std::string, std::string> meta = {
        {"hmoe_packed_version", kVersion},
        {"format", ServeFormatName(f, group)},
        {"model_type", cfg.model_type},
        {"hidden", absl::StrCat(H)},
        {"intermediate", absl::StrCat(I)},
        {"num_experts", absl::StrCat(E)},
        {"layers", LayersString(cfg)},
        {"shard", absl::StrCat(i)},
        {"num_shards", absl::StrCat(n)},
        {"split", SplitModeName(opts.split)},
        {"i_begin", absl::StrCat(ep ? 0 : Part(I, i, n))},
        {"i_end", absl::StrCat(ep ? I : Part(I, i + 1, n))},
        {"expert_begin", absl::StrCat(ep ? Part(E, i, n) : 0)},
        {"expert_end", absl::StrCat(ep ? Part(E, i + 1, n) : E)},
        {"checksums", w.sums.dump()}};
    for (const auto& [k, v] : meta) w.w.SetMetadata(k, v);
    const std::string path = out_dir + "/" + PackedFileName(opts.split, i, n);
    RETURN_IF_ERROR(w.w.Write(path + ".tmp"));
    std::filesystem::rename(path + ".tmp", path, ec);
    if (ec) return absl::InternalError(absl::StrCat(path, ": ", ec.message()));
  }
  return absl::OkStatus();
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
  int group = 64;
  ASSIGN_OR_RETURN(p->format_, ParseServeFormat(get("format"), &group));
  p->group_ = group;
  p->hidden_ = cfg.hidden_size;
  p->cfg_cols_down_ = cfg.moe.intermediate_size;
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
    p->sums_[t.name] = sums[t.name].get<std::string>();
  }
  p->path_ = path;
  return p;
}

absl::StatusOr<ExpertSlice> PackedExperts::Expert(int layer, int e, int64_t i0, int64_t i1) const {
  if (i0 != i_begin_ || i1 != i_end_ || e < e_begin_ || e >= e_end_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": holds experts [", e_begin_, ", ", e_end_, ") x intermediate [",
                     i_begin_, ", ", i_end_, "), not expert ", e, " [", i0, ", ", i1, ")"));
  }
  const int64_t H = hidden_, is = i1 - i0;
  auto load = [&](const std::string& proj, int64_t rows, int64_t cols, int64_t c_abs0,
                  std::vector<float>* out) -> absl::Status {
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
    ASSIGN_OR_RETURN(Tensor q, tensor(base + ".q"));
    out->resize(static_cast<size_t>(rows * cols));
    auto shape_error = [&](const Tensor& t) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": ", base, " has shape ", ShapeString(t.shape()), " / dtype ",
                       DTypeName(t.dtype()), ", expected [", rows, ", ", cols, "] ",
                       ServeFormatName(format_, group_)));
    };
    if (format_ == ServeFormat::kBf16) {
      if (q.dtype() != DType::kBF16 || q.rank() != 2 || q.dim(0) != rows || q.dim(1) != cols)
        return shape_error(q);
      const uint16_t* d = q.data<uint16_t>();
      for (int64_t i = 0; i < rows * cols; ++i) (*out)[static_cast<size_t>(i)] = Bf16ToF32(d[i]);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(Tensor s, tensor(base + ".s"));
    const int64_t g =
        format_ == ServeFormat::kInt8 ? (proj == "down" ? cfg_cols_down_ : H) : group_;
    const int64_t g0 = c_abs0 / g, ng = (c_abs0 + cols - 1) / g + 1 - g0;
    const int64_t qcols = format_ == ServeFormat::kInt8 ? cols : (cols + 1) / 2;
    if (q.rank() != 2 || q.dim(0) != rows || q.dim(1) != qcols ||
        q.dtype() != (format_ == ServeFormat::kInt8 ? DType::kI8 : DType::kU8)) {
      return shape_error(q);
    }
    if (s.dtype() != DType::kF32 || s.rank() != 2 || s.dim(0) != rows || s.dim(1) != ng)
      return shape_error(s);
    const float* sc = s.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int qv = format_ == ServeFormat::kInt8 ? q.data<int8_t>()[r * cols + c]
                                                     : UnpackI4(q.data<uint8_t>() + r * qcols, c);
        (*out)[static_cast<size_t>(r * cols + c)] =
            static_cast<float>(qv) * sc[r * ng + (c_abs0 + c) / g - g0];
      }
    }
    return absl::OkStatus();
  };
  ExpertSlice x;
  RETURN_IF_ERROR(load("gate", is, H, 0, &x.gate));
  RETURN_IF_ERROR(load("up", is, H, 0, &x.up));
  RETURN_IF_ERROR(load("down", H, is, i0, &x.down));
  return x;
}

}  // namespace hmoe
