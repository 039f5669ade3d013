// Streamed experts (hybrid prefill): every routed expert of the
// model in pinned host memory, quantized as the expert service serves it and
// laid out as the GPU reads it; for one MoE layer of a large pass, the
// experts the plan gives the GPU are uploaded over PCIe (a copy stream, in
// chunks whose events let compute start on the first while the rest
// arrive), dequantized to bf16 one expert at a time and computed with cuBLAS
// (gate and up in one GEMM, silu(gate) * up, down), each slot's output
// weighted and the token's slots summed in slot order. With two stages
// (device copies of one layer's experts), Prefetch uploads a guess of the
// next MoE layer's experts into the stage the last Run did not use while
// that Run computes; a Run then uploads only what its stage lacks. Internal
// to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe::cuda {

class StreamedExperts {
 public:
  // Quantizes every routed expert of `config`'s MoE layers from `source` (as
  // LoadHotExperts) into pinned host memory, one layer at a time, and takes
  // its device memory from `budget` ("streamed experts": one layer's experts
  // and the scratch of a pass of `max_tokens` tokens; with `prefetch`, a
  // second stage as "streamed experts (prefetch stage)" when the budget has
  // room for it, else one stage and a log line). `compute` and `blas` (bound
  // to `compute`) are the backend's. Measures the PCIe rate. `progress`,
  // when set, gets (bytes pinned, bytes to pin) after each layer.
  static absl::StatusOr<std::unique_ptr<StreamedExperts>> Create(
      const ModelConfig& config, const ExpertSourceFn& source, WeightFormat format, int group,
      int64_t max_tokens, bool prefetch, cudaStream_t compute, cublasHandle_t blas, Budget* budget,
      const std::function<void(int64_t done, int64_t total)>& progress = {});
  ~StreamedExperts();

  // Enqueues layer `layer`'s streamed part on the compute stream: uploads
  // those of `gpu_experts` (ascending, each with tokens in ids) its stage
  // lacks (the stage holding `layer`, else the one the last Run did not
  // use), computes each as it arrives (prefetched ones first), every slot
  // whose expert is among them and writes out[t] = the sum of t's such
  // slots (weighted), in slot order, into out(); writes `cpu_ids` = ids
  // with those slots kNoExpert (what the caller sends to the service). x:
  // bf16 [T][H] device; ids: host [T][K]; w: device [T][K]. Returns the
  // number of slots taken (0: nothing enqueued, out() not written).
  absl::StatusOr<int64_t> Run(int layer, const uint16_t* x, int64_t T, int64_t K,
                              const int32_t* ids, const float* w,
                              const std::vector<int32_t>& gpu_experts, int32_t* cpu_ids);
  const float* out() const { return out_.as<float>(); }  // [T][H] of the last Run

  // Queues on the copy stream, behind what is there, the upload of
  // `experts` (ids in [0, E), any order, repeats ignored) of MoE layer
  // `layer` into the stage the last Run did not use, once that stage's last
  // compute is done; what it already holds of `layer` is not uploaded
  // again. A guess: a Run(layer) next computes from it and uploads only the
  // experts it lacks; a wrong guess costs PCIe time, never results.
  // Returns the experts queued (0 with one stage).
  absl::StatusOr<int64_t> Prefetch(int layer, const std::vector<int32_t>& experts);
  int stages() const { return static_cast<int>(stages_.size()); }
  // Experts uploaded by Prefetch, and of those the ones a Run computed from
  // (each upload counted once).
  int64_t prefetched() const { return prefetched_; }
  int64_t prefetch_used() const { return prefetch_used_; }

  // With `on`, Upload and Run record timing events (copy and compute
  // streams); TakeTimeline waits for both streams and returns one line per
  // span since the last take ("layer L upload|prefetch|compute a-b ms"),
  // times from the first span's start. For --log-prefill-plans.
  void set_timeline(bool on) { timeline_on_ = on; }
  std::string TakeTimeline();

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

  // A device copy of (some of) one MoE layer's experts.
  struct Stage {
    DeviceBuffer buf;  // E blobs
    int layer = -1;    // whose experts it holds (-1: none)
    // Per expert: the upload sequence number of the chunk bringing it (-1:
    // not held) and whether Prefetch brought it and no Run has used it yet.
    std::vector<int64_t> arrival;
    std::vector<uint8_t> ahead;
    cudaEvent_t done = nullptr;  // the last Run's compute from it
  };
  // Queues the upload of those of `experts` that `st` lacks (assigning it
  // to `layer` first: then the copies wait for its last compute), in up to
  // kChunks chunks of runs of consecutive ids; returns how many it queued.
  absl::StatusOr<int64_t> Upload(Stage& st, int layer, const std::vector<int32_t>& experts,
                                 bool ahead);

  ModelConfig c_;
  WeightFormat format_ = WeightFormat::kBf16;
  int group_ = 0;
  int64_t max_tokens_ = 0;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  // One expert's blob: gate w, gate scale, up w, up scale, down w, down
  // scale, each at a 256-byte aligned offset.
  int64_t off_[6] = {};
  int64_t blob_ = 0;
  std::vector<int> layer_row_;       // decoder layer -> arena row (-1: not MoE)
  std::vector<PinnedBuffer> arena_;  // per MoE layer: E blobs
  std::vector<Stage> stages_;        // 1, or 2 with prefetch
  int last_ = 0;                     // the stage of the last Run
  // Upload chunks: sequence numbers on the one (in-order) copy stream,
  // recorded round robin into chunk_ev_ (a re-recorded event is later on
  // that stream, so waiting on it stays correct). Chunks up to
  // arrived_upto_ are known in (the host saw a Run that waited on them done).
  int64_t seq_ = 0, arrived_upto_ = -1, last_waited_ = -1;
  std::vector<cudaEvent_t> chunk_ev_;
  DeviceBuffer w_gu_, w_d_;               // bf16 [2I][H], [H][I]
  DeviceBuffer xg_, ys_, y_gu_, hb_, z_;  // gathered x, slot outputs, GEMM scratch
  DeviceBuffer out_;                      // f32 [max_tokens][H]
  DeviceBuffer idx_;                      // int32 gather rows, slots; uint8 marks
  PinnedBuffer idx_host_;
  int64_t idx_ints_ = 0;
  double pcie_gbps_ = 0, gemm_tflops_ = 0;
  int64_t prefetched_ = 0, prefetch_used_ = 0;
  int64_t device_bytes_ = 0, prefetch_stage_bytes_ = 0;
  // The timeline's spans; events come from (and go back to) a pool.
  struct Span {
    int layer;
    const char* what;
    cudaEvent_t a, b;
  };
  bool timeline_on_ = false;
  std::vector<Span> spans_;
  std::vector<cudaEvent_t> span_pool_;
  absl::StatusOr<cudaEvent_t> SpanEvent();

  Budget* budget_ = nullptr;
};

}  // namespace hmoe::cuda
