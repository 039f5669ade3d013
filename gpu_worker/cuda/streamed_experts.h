// Streamed experts (issue 31, hybrid prefill): every routed expert of the
// model in pinned host memory, quantized as the expert service serves it and
// laid out as the GPU reads it; for one MoE layer of a large pass, the
// experts the plan gives the GPU are uploaded over PCIe (a copy stream, in
// chunks whose events let compute start on the first while the rest
// arrive), dequantized to bf16 one expert at a time and computed with cuBLAS
// (gate and up in one GEMM, silu(gate) * up, down), each slot's output
// weighted and the token's slots summed in slot order. Internal to
// gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/cuda/kernels.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe::cuda {

class StreamedExperts {
 public:
  // Quantizes every routed expert of `config`'s MoE layers from `source` (as
  // LoadHotExperts) into pinned host memory, one layer at a time, and takes
  // its device memory from `budget` ("streamed experts": one layer's experts
  // and the scratch of a pass of `max_tokens` tokens). `compute` and `blas`
  // (bound to `compute`) are the backend's. Measures the PCIe rate.
  static absl::StatusOr<std::unique_ptr<StreamedExperts>> Create(
      const ModelConfig& config, const ExpertSourceFn& source, WeightFormat format, int group,
      int64_t max_tokens, cudaStream_t compute, cublasHandle_t blas, Budget* budget);
  ~StreamedExperts();

  // Enqueues layer `layer`'s streamed part on the compute stream: uploads
  // `gpu_experts` (ascending, each with tokens in ids), computes every slot
  // whose expert is among them and writes out[t] = the sum of t's such
  // slots (weighted), in slot order, into out(); writes `cpu_ids` = ids
  // with those slots kNoExpert (what the caller sends to the service). x:
  // bf16 [T][H] device; ids: host [T][K]; w: device [T][K]. Returns the
  // number of slots taken (0: nothing enqueued, out() not written).
  absl::StatusOr<int64_t> Run(int layer, const uint16_t* x, int64_t T, int64_t K,
                              const int32_t* ids, const float* w,
                              const std::vector<int32_t>& gpu_experts, int32_t* cpu_ids);
  const float* out() const { return out_.as<float>(); }  // [T][H] of the last Run

  double pcie_gbps() const { return pcie_gbps_; }  // host -> device, pinned, measured
  // One expert's compute (dequantization, GEMMs, activation) at the rows an
  // expert gets in a full pass, measured, as TFLOP/s of its GEMMs.
  double gemm_tflops() const { return gemm_tflops_; }
  int64_t expert_bytes() const { return blob_; }  // one expert as uploaded
  int64_t host_bytes() const;                     // the pinned arena
  int64_t max_tokens() const { return max_tokens_; }

 private:
  StreamedExperts() = default;
  absl::Status Measure();
  // z_[n][H] = down(silu(gate(x)) * up(x)) for x: bf16 [n][H] (device), on
  // the compute stream, through w_gu_ / w_d_ / y_gu_ / hb_.
  absl::Status ComputeExpert(const DevExpert& ex, const uint16_t* x, int64_t n);
  DevExpert ExpertAt(const char* base) const;  // the views of one blob at `base`

  ModelConfig c_;
  int format_ = 0, group_ = 0;
  int64_t max_tokens_ = 0;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  // One expert's blob: gate w, gate scale, up w, up scale, down w, down
  // scale, each at a 256-byte aligned offset.
  int64_t off_[6] = {};
  int64_t blob_ = 0;
  std::vector<int> layer_row_;            // decoder layer -> arena row (-1: not MoE)
  std::vector<PinnedBuffer> arena_;       // per MoE layer: E blobs
  DeviceBuffer stage_;                    // E blobs (the layer being computed)
  DeviceBuffer w_gu_, w_d_;               // bf16 [2I][H], [H][I]
  DeviceBuffer xg_, ys_, y_gu_, hb_, z_;  // gathered x, slot outputs, GEMM scratch
  DeviceBuffer out_;                      // f32 [max_tokens][H]
  DeviceBuffer idx_;                      // int32 gather rows, slots; uint8 marks
  PinnedBuffer idx_host_;
  int64_t idx_ints_ = 0;
  std::vector<cudaEvent_t> chunk_ev_;
  cudaEvent_t done_ev_ = nullptr;  // the last Run's compute (before the next upload)
  double pcie_gbps_ = 0, gemm_tflops_ = 0;
  int64_t device_bytes_ = 0;
  Budget* budget_ = nullptr;
};

}  // namespace hmoe::cuda
