#include "common/experts/checkpoint_source.h"

#include <array>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "common/native_layout.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/weight_map.h"

namespace hmoe {
namespace {

// The tensor names of one projection stored natively per `cfg`'s
// common/native_layout.h row: its codes, its scales and (compressed-tensors
// int4) its weight_shape; the weight itself without a row.
struct NativeNames {
  std::string codes, scales, shape;
};
NativeNames NamesOf(const ModelConfig& cfg, const std::string& weight) {
  const NativeLayout* l = FindNativeLayout(cfg.quantization);
  if (l == nullptr) return {weight, "", ""};
  return {NativeTensorName(weight, l->codes), NativeTensorName(weight, l->scales),
          l->shape.empty() ? "" : NativeTensorName(weight, l->shape)};
}

std::string Shape2(int64_t a, int64_t b) { return absl::StrCat("[", a, ", ", b, "]"); }

}  // namespace

absl::StatusOr<NativeExpertFormat> CheckpointExpertFormat(const ModelConfig& cfg,
                                                          const std::string& dir) {
  const NativeLayout* l = FindNativeLayout(cfg.quantization);
  if (l == nullptr) return NativeExpertFormat{};
  ASSIGN_OR_RETURN(const WeightFormat f, ParseWeightFormat(l->expert_format));
  if (f == WeightFormat::kFp8) {
    ASSIGN_OR_RETURN(const int64_t block, Fp8ExpertBlock(cfg, dir));
    // Blocks the fp8 row does not take are dequantized (and re-quantized).
    if (TakesGroup(WeightFormat::kFp8, static_cast<int>(block)))
      return NativeExpertFormat{WeightFormat::kFp8, static_cast<int>(block)};
    return NativeExpertFormat{};
  }
  if (!l->ct_format.empty() && !TakesOneGroup(f))  // compressed-tensors int4: the config's group
    return NativeExpertFormat{f, static_cast<int>(cfg.quantization.group_size)};
  return NativeExpertFormat{f, Traits(f).default_group};
}

absl::StatusOr<ExpertWeights> LoadExpertWeights(const Checkpoint& ckpt, const ModelConfig& cfg,
                                                int layer, int64_t expert) {
  const int64_t H = cfg.hidden_size, I = cfg.moe.intermediate_size;
  // Asked of fp8 experts only: bf16 ones do not care what the config says.
  const absl::StatusOr<int64_t> fp8_block = Fp8ExpertBlock(cfg, ckpt.dir());
  // An fp8 block it cannot express is reported by load_plain, for fp8 experts.
  const absl::StatusOr<NativeExpertFormat> native_or = CheckpointExpertFormat(cfg, ckpt.dir());
  const NativeExpertFormat native = native_or.ok() ? *native_or : NativeExpertFormat{};
  auto bad_shape = [&](const std::string& name, const Tensor& t, const std::string& want) {
    return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", name, " is ",
                                                   DTypeName(t.dtype()), " ",
                                                   ShapeString(t.shape()), ", expected ", want));
  };
  // A projection stored natively: its codes and scales, checked.
  auto load_native = [&](const std::string& weight, int64_t rows, int64_t cols, Tensor* w,
                         Tensor* scale) -> absl::Status {
    const WeightFormat f = native.format;
    const int group = native.group;
    const NativeNames n = NamesOf(cfg, weight);
    ASSIGN_OR_RETURN(*w, ckpt.Get(n.codes));
    ASSIGN_OR_RETURN(*scale, ckpt.Get(n.scales));
    const int64_t srows = ScaleRows(f, group, rows), scols = ScalesPerRow(f, group, cols);
    switch (f) {
      case WeightFormat::kInt4Bf16: {
        if (w->dtype() != DType::kI32 || w->rank() != 2 || w->dim(0) != rows ||
            w->dim(1) != (cols + 7) / 8)
          return bad_shape(n.codes, *w,
                           absl::StrCat("I32 ", Shape2(rows, (cols + 7) / 8), " (", rows, " x ",
                                        cols, " int4, 8 per int32)"));
        if (ckpt.Has(n.shape)) {
          ASSIGN_OR_RETURN(const Tensor shape, ckpt.Get(n.shape));
          const std::vector<float> v = shape.ToF32();
          if (shape.numel() != 2 || v[0] != static_cast<float>(rows) ||
              v[1] != static_cast<float>(cols))
            return absl::InvalidArgumentError(absl::StrCat(
                ckpt.dir(), ": ", n.shape, " says ",
                shape.numel() == 2 ? Shape2(static_cast<int64_t>(v[0]), static_cast<int64_t>(v[1]))
                                   : ShapeString(shape.shape()),
                ", expected ", Shape2(rows, cols)));
        }
        if (scale->dtype() != DType::kBF16 || scale->rank() != 2 || scale->dim(0) != srows ||
            scale->dim(1) != scols)
          return bad_shape(n.scales, *scale,
                           absl::StrCat("BF16 ", Shape2(srows, scols), " (one per ", group, " of ",
                                        n.codes, "'s ", Shape2(rows, cols), ")"));
        break;
      }
      case WeightFormat::kMxfp4: {
        const bool u8 = w->dtype() == DType::kU8 || w->dtype() == DType::kI8;
        if (cols % 32 != 0 || !u8 ||
            !((w->rank() == 3 && w->dim(0) == rows && w->dim(1) == cols / 32 && w->dim(2) == 16) ||
              (w->rank() == 2 && w->dim(0) == rows && w->dim(1) == cols / 2)))
          return bad_shape(n.codes, *w,
                           cols % 32 != 0 ? absl::StrCat("no mxfp4 matrix: its ", cols,
                                                         " columns are no multiple of 32")
                                          : absl::StrCat("U8 [", rows, ", ", cols / 32, ", 16] (",
                                                         rows, " x ", cols, " e2m1, 2 per byte)"));
        break;
      }
      case WeightFormat::kFp8:
      case WeightFormat::kMxfp8:
        if (w->dtype() != DType::kF8E4M3 || w->rank() != 2 || w->dim(0) != rows ||
            w->dim(1) != cols)
          return bad_shape(n.codes, *w, absl::StrCat("F8_E4M3 ", Shape2(rows, cols)));
        break;
      default:
        break;
    }
    if (Traits(f).scale_type == ScaleType::kE8M0) {
      if ((scale->dtype() != DType::kU8 && scale->dtype() != DType::kF8E8M0) ||
          scale->rank() != 2 || scale->dim(0) != srows || scale->dim(1) != scols)
        return bad_shape(n.scales, *scale,
                         absl::StrCat("F8_E8M0 / U8 ", Shape2(srows, scols), " (one per 32 of ",
                                      n.codes, "'s ", Shape2(rows, cols), ")"));
    } else if (f == WeightFormat::kFp8 && (scale->dtype() != DType::kF32 || scale->rank() != 2 ||
                                           scale->dim(0) != srows || scale->dim(1) != scols)) {
      return bad_shape(n.scales, *scale,
                       absl::StrCat("F32 ", Shape2(srows, scols), " (the ", group, "x", group,
                                    " block scales of ", n.codes, "'s ", Shape2(rows, cols), ")"));
    }
    // A scale without a value (the e8m0 NaN 0xFF, a non-finite f32 / bf16)
    // would serve its weights as NaN: refused here, naming it.
    for (int64_t i = 0; i < scale->numel(); ++i) {
      std::string value;
      switch (Traits(f).scale_type) {
        case ScaleType::kE8M0:
          if (static_cast<const uint8_t*>(scale->raw())[i] == kE8M0NaN)
            value = "0xFF, the e8m0 NaN";
          break;
        case ScaleType::kF32:
          if (const float v = static_cast<const float*>(scale->raw())[i]; !std::isfinite(v))
            value = absl::StrCat(v);
          break;
        case ScaleType::kBf16:
          if (const float v = Bf16ToF32(static_cast<const uint16_t*>(scale->raw())[i]);
              !std::isfinite(v))
            value = absl::StrCat(v);
          break;
        case ScaleType::kNone:
          break;
      }
      if (!value.empty())
        return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", n.scales, " [", i / scols,
                                                       ", ", i % scols, "] is ", value,
                                                       ": the weights it scales have no value"));
    }
    return absl::OkStatus();
  };
  // A projection stored plainly (bf16 / f16 / f32, or fp8 to dequantize).
  auto load_plain = [&](const std::string& name, int64_t rows, int64_t cols, Tensor* w,
                        Tensor* scale_inv) -> absl::Status {
    ASSIGN_OR_RETURN(*w, ckpt.Get(name));
    if (w->rank() != 2 || w->dim(0) != rows || w->dim(1) != cols) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", name, " has shape ",
                                                     ShapeString(w->shape()), ", expected [", rows,
                                                     ", ", cols, "]"));
    }
    if (w->dtype() == DType::kF8E4M3) {
      RETURN_IF_ERROR(fp8_block.status());
      const int64_t block = *fp8_block;
      if (block == 0)
        return absl::InvalidArgumentError(
            absl::StrCat(ckpt.dir(), ": ", name,
                         " is fp8, but config.json has no quantization_config (quant_method fp8, "
                         "weight_block_size): its block scales cannot be read"));
      const std::string sname = ScaleInvName(name);
      ASSIGN_OR_RETURN(*scale_inv, ckpt.Get(sname));
      if (scale_inv->dtype() != DType::kF32 || scale_inv->rank() != 2 ||
          scale_inv->dim(0) != (rows + block - 1) / block ||
          scale_inv->dim(1) != (cols + block - 1) / block) {
        return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", sname, " has shape ",
                                                       ShapeString(scale_inv->shape()),
                                                       ", not the block scales of ", name));
      }
    } else if (w->dtype() != DType::kBF16 && w->dtype() != DType::kF16 &&
               w->dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.dir(), ": ", name, " has dtype ",
                                                     DTypeName(w->dtype()),
                                                     "; experts must be bf16, f16, f32 or fp8"));
    }
    return absl::OkStatus();
  };
  const std::array<ExpertProj, 3> projs = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};
  std::array<std::string, 3> names;
  std::array<bool, 3> is_native{};
  for (int i = 0; i < 3; ++i) {
    names[i] = ExpertWeightName(cfg, layer, static_cast<int>(expert), projs[i]);
    const NativeNames n = NamesOf(cfg, names[i]);
    // fp8 and mxfp8 keep the plain name: the dtype tells (a bf16 module left
    // unquantized is read plainly).
    if (native.format == WeightFormat::kFp8 || native.format == WeightFormat::kMxfp8) {
      const TensorEntry* e = ckpt.Find(names[i]);
      is_native[i] = e != nullptr && e->dtype == DType::kF8E4M3 &&
                     (native.format == WeightFormat::kFp8 || ckpt.Has(n.scales));
    } else {
      is_native[i] = native.format != WeightFormat::kBf16 && ckpt.Has(n.codes);
    }
  }
  if (is_native[0] != is_native[1] || is_native[0] != is_native[2])
    return absl::UnimplementedError(
        absl::StrCat(ckpt.dir(), ": layer ", layer, " expert ", expert,
                     " stores some projections as ", WeightFormatName(native.format, native.group),
                     " and others unquantized; an expert is read in one format"));
  ExpertWeights w;
  Tensor* ws[3] = {&w.gate, &w.up, &w.down};
  Tensor* ss[3] = {&w.gate_scale_inv, &w.up_scale_inv, &w.down_scale_inv};
  const int64_t rows[3] = {I, I, H}, cols[3] = {H, H, I};
  for (int i = 0; i < 3; ++i) {
    if (is_native[i]) {
      RETURN_IF_ERROR(load_native(names[i], rows[i], cols[i], ws[i], ss[i]));
    } else {
      RETURN_IF_ERROR(load_plain(names[i], rows[i], cols[i], ws[i], ss[i]));
    }
  }
  if (is_native[0]) {
    w.format = native.format;
    w.group = native.group;
  }
  return w;
}

absl::StatusOr<int64_t> Fp8ExpertBlock(const ModelConfig& cfg, const std::string& dir) {
  if (cfg.quantization.method != "fp8" || cfg.quantization.weight_block.size() != 2) return 0;
  if (cfg.quantization.weight_block[0] != cfg.quantization.weight_block[1])
    return absl::UnimplementedError(absl::StrCat(dir, ": fp8 weight blocks must be square, got ",
                                                 cfg.quantization.weight_block[0], "x",
                                                 cfg.quantization.weight_block[1]));
  return cfg.quantization.weight_block[0];
}

MoeWeightsSource CheckpointSource(const Checkpoint& ckpt, const ModelConfig& cfg, int layer) {
  MoeWeightsSource src;
  src.hidden = cfg.hidden_size;
  src.intermediate = cfg.moe.intermediate_size;
  src.num_experts = cfg.moe.num_experts;
  // LoadExpertWeights refuses what this cannot express (non-square, none).
  const absl::StatusOr<int64_t> block = Fp8ExpertBlock(cfg, ckpt.dir());
  src.fp8_block = block.ok() ? *block : 0;
  const absl::StatusOr<NativeExpertFormat> native = CheckpointExpertFormat(cfg, ckpt.dir());
  if (native.ok()) {
    src.native_format = native->format;
    src.native_group = native->group;
  }
  src.expert = [&ckpt, &cfg, layer](int64_t e) { return LoadExpertWeights(ckpt, cfg, layer, e); };
  return src;
}

}  // namespace hmoe
