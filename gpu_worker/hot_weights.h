// The hot experts' weights for the GPU: loaded from the
// checkpoint and quantized exactly as the expert service quantizes them
// (QuantizeExpert), then laid out as the CUDA kernel reads them
// (gpu_worker/cuda/dev_quant_matrix.h DevQuantMatrix). CUDA-free, so CI checks it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/expert_placement.h"
#include "common/experts/format_codes.h"
#include "common/experts/quantize.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace hmoe {

// One matrix in the kernel's layout: each row RowBytes(format, cols) of
// weights at the format's bits (bf16 [rows][cols]; int8 q [rows][cols];
// int4 two values per byte, the even column in the low nibble; the native
// formats' codes as QuantMatrix::packed holds them), and
// [ScaleRows][ScalesPerRow(format, group, cols)] scales as f32.
struct HostQuantMatrix {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};
HostQuantMatrix ToKernelLayout(const QuantMatrix& m);
// The bytes of one matrix in the kernel's layout (int4: `group`).
struct KernelMatrixBytes {
  int64_t w = 0, scale = 0;
};
KernelMatrixBytes KernelLayoutBytes(WeightFormat f, int group, int64_t rows, int64_t cols);

struct HotExpertWeights {
  int32_t layer = 0, expert = 0;
  HostQuantMatrix gate, up, down;
  int64_t bytes() const;  // what the GPU holds for it
};

// What one routed expert of `config` takes on the GPU in `format` (int4:
// `group`): HotExpertWeights::bytes() without loading it (for placement).
int64_t HotExpertBytes(const ModelConfig& config, WeightFormat format, int group);

// Where a layer's routed-expert weights come from (CheckpointSource,
// SyntheticExpertSource).
using ExpertSourceFn = std::function<MoeWeightsSource(int layer)>;

// Every expert of `placement`, in its order (ascending layer, then expert),
// quantized to `format` (int4: `group`) from `source`. FAILED_PRECONDITION
// for a placement of another model or a source of other shapes; the
// source's errors (a checkpoint's name the tensor) are passed on.
absl::StatusOr<std::vector<HotExpertWeights>> LoadHotExperts(const ExpertSourceFn& source,
                                                             const ModelConfig& config,
                                                             const Placement& placement,
                                                             WeightFormat format, int group);
// The same from `ckpt` (CheckpointSource).
absl::StatusOr<std::vector<HotExpertWeights>> LoadHotExperts(const Checkpoint& ckpt,
                                                             const ModelConfig& config,
                                                             const Placement& placement,
                                                             WeightFormat format, int group);

}  // namespace hmoe
