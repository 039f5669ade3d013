// Hot experts: routed experts computed on the GPU from device-resident
// quantized weights. Launcher conventions: gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// hmoe::SplitHot (driver/routing.h) on the device: slot i < n goes to hot
// (cold[i] = -1) when 0 <= ids[i] < E and mask[ids[i]] != 0, else to cold
// (hot[i] = -1).
cudaError_t SplitHotIds(const int32_t* ids, int64_t n, const uint8_t* mask, int64_t E,
                        int32_t* cold, int32_t* hot, cudaStream_t s);

struct HotExpertsArgs {
  const uint16_t* x = nullptr;  // bf16 [T][H]
  int64_t T = 0, H = 0, I = 0;
  const int32_t* ids = nullptr;    // [T][K]
  const float* weights = nullptr;  // [T][K]
  int64_t K = 0;
  // Device array [E]: slot ids[t, j] = e is computed when 0 <= e < E and
  // experts[e].gate.w != nullptr (a hot expert); other slots add nothing.
  const DevExpert* experts = nullptr;
  int64_t E = 0;
  float* out = nullptr;  // [T][H], overwritten
  void* scratch = nullptr;
  int64_t scratch_bytes = 0;  // >= HotExpertsScratchBytes(T, H, I, K)
};
int64_t HotExpertsScratchBytes(int64_t T, int64_t H, int64_t I, int64_t K);
// out[t] = sum over hot slots j (ascending) of weights[t, j] * E(x[t]) with
// the numerics of the expert service's reference in its "few tokens" regime
// (RunMoeReference): int8 and int4 weights meet int8 activations quantized
// per row (x per token over H, then silu(gate) * up per slot over I), the
// integer dot products exact, combined in double with the scales; bf16
// weights and the native formats (mxfp4, int4bf16, fp8, mxfp8: each weight
// f32(value * scale)) meet f32 activations and a bf16-rounded intermediate. Results
// match the reference up to summation order and expf's last bits.
cudaError_t HotExperts(const HotExpertsArgs& a, cudaStream_t s);

}  // namespace hmoe::cuda
