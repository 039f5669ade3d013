#include "common/experts/checkpoint_source.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/weight_map.h"

namespace hmoe {

absl::StatusOr<ExpertWeights> LoadExpertWeights(const Checkpoint& ckpt, const ModelConfig& cfg,
                                                int layer, int64_t expert) {
  const int64_t H = cfg.hidden_size, I = cfg.moe.intermediate_size;
  // Asked of fp8 experts only: bf16 ones do not care what the config says.
  const absl::StatusOr<int64_t> fp8_block = Fp8ExpertBlock(cfg, ckpt.dir());
  auto load = [&](ExpertProj proj, int64_t rows, int64_t cols, Tensor* w,
                  Tensor* scale_inv) -> absl::Status {
    const std::string name = ExpertWeightName(cfg, layer, static_cast<int>(expert), proj);
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
  ExpertWeights w;
  RETURN_IF_ERROR(load(ExpertProj::kGate, I, H, &w.gate, &w.gate_scale_inv));
  RETURN_IF_ERROR(load(ExpertProj::kUp, I, H, &w.up, &w.up_scale_inv));
  RETURN_IF_ERROR(load(ExpertProj::kDown, H, I, &w.down, &w.down_scale_inv));
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
  src.expert = [&ckpt, &cfg, layer](int64_t e) { return LoadExpertWeights(ckpt, cfg, layer, e); };
  return src;
}

}  // namespace hmoe
