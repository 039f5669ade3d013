// Hot experts on the GPU (CudaOptions::hot_experts): a placement's routed
// experts, quantized as the expert service quantizes them, held on the
// device. For a slot pass's MoE layer with any, Split takes the hot slots out
// of the call (they reach the service as kNoExpert) and Run computes them
// into out() while the service works on the rest; the layer's join adds
// out() to the service's answer. A producer of part of the routed sum, like
// StreamedExperts for large passes. Internal to gpu_worker/cuda/ (includes
// CUDA).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/expert_placement.h"
#include "common/model_config.h"
#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/cuda/expert_call_path.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe::cuda {

class GpuHotExperts {
 public:
  // Loads `placement`'s experts from `source` in `format` (int4: `group`)
  // and the scratch for passes of up to `max_tokens` tokens, taking their
  // device memory from `budget` ("hot experts").
  static absl::StatusOr<std::unique_ptr<GpuHotExperts>> Create(const ModelConfig& config,
                                                               const ExpertSourceFn& source,
                                                               const Placement& placement,
                                                               WeightFormat format, int group,
                                                               int64_t max_tokens, Budget* budget);

  bool has(int layer) const { return layers_.count(layer) > 0; }
  int64_t bytes() const { return bytes_; }  // the experts' weights on the device

  // Layer `layer`'s call ids [slots] (device): enqueues the split into the
  // cold ids (returned: hot slots kNoExpert) and the hot ones, and their
  // copy into a pinned area of the layer's (*hot_host, read after the pass
  // for the routing counts).
  absl::StatusOr<const int32_t*> Split(int layer, const int32_t* ids, int64_t slots,
                                       const int32_t** hot_host, StreamOps& ops);
  // Enqueues out()[t] = the sum of t's hot slots of the last Split, weighted
  // by w [T, k] (device), for x bf16 [T, H] (device).
  absl::Status Run(int layer, const uint16_t* x, int64_t T, const float* w, int64_t k,
                   StreamOps& ops);
  float* out() const { return out_.as<float>(); }  // [T, H] of the last Run

 private:
  explicit GpuHotExperts(const ModelConfig& config) : c_(config) {}
  // Per decoder layer with any: the device table [E] of DevExpert (null
  // weights: not hot) and the mask [E].
  struct Layer {
    DeviceBuffer table, mask;
  };
  const ModelConfig& c_;
  int64_t max_tokens_ = 0, bytes_ = 0;
  std::map<int, Layer> layers_;
  std::vector<DeviceBuffer> weights_;
  DeviceBuffer hot_ids_, cold_ids_, out_, scratch_;
  PinnedBuffer hot_ids_pinned_;  // [layer][max_tokens * K]
};

}  // namespace hmoe::cuda
