// The DenseWeights / KvDtype vocabulary of model.h. CUDA-free and in
// hmoe_model_core, so that the memory planner, the backends and the command
// lines have it without the model.
#include <optional>
#include <string_view>

#include "gpu_worker/model.h"

namespace hmoe {

std::string_view DenseWeightsName(DenseWeights w) {
  switch (w) {
    case DenseWeights::kAuto:
      return "auto";
    case DenseWeights::kBf16:
      return "bf16";
    case DenseWeights::kFp8:
      return "fp8";
    case DenseWeights::kInt8:
      return "int8";
    case DenseWeights::kInt4:
      return "int4";
  }
  return "auto";
}

std::optional<DenseWeights> ParseDenseWeights(std::string_view s) {
  for (DenseWeights w : {DenseWeights::kAuto, DenseWeights::kBf16, DenseWeights::kFp8,
                         DenseWeights::kInt8, DenseWeights::kInt4})
    if (s == DenseWeightsName(w)) return w;
  return std::nullopt;
}

DenseFormat DenseFormatOf(DenseWeights w) {
  switch (w) {
    case DenseWeights::kFp8:
      return {WeightFormat::kFp8, 128};
    case DenseWeights::kInt8:
      return {WeightFormat::kInt8, 0};
    case DenseWeights::kInt4:
      return {WeightFormat::kInt4, 128};
    case DenseWeights::kAuto:
    case DenseWeights::kBf16:
      break;
  }
  return {WeightFormat::kBf16, 0};
}

std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kBf16:
      return "bf16";
    case KvDtype::kFp8:
      return "fp8";
  }
  return "f32";
}

std::optional<KvDtype> ParseKvDtype(std::string_view s) {
  for (KvDtype d : {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8})
    if (s == KvDtypeName(d)) return d;
  return std::nullopt;
}

}  // namespace hmoe
