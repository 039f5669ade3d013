// The same MoE computed with oneDNN 2.6 matmul per expert (one fused
// gate+up matmul [M,H]x[H,2I] and one down matmul [M,I]x[I,H] per expert, M
// a runtime dim): a second opinion for tests and the library the benchmark
// must beat. Formats: BF16, and INT8 with per-channel output scales (per-token
// activation scales applied after the matmul). Numerics follow moe.h (INT8:
// activations quantized per token, h per row); INT4 is unsupported (oneDNN 2.6
// has no int4), callers compare INT4 against this INT8.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "expert_service/kernels/moe.h"

namespace hmoe {

class OnednnMoe {
 public:
  // fill(e, gate_up, gu_scale, down, down_scale) writes expert e's plain
  // row-major weights: gate_up [2I][H] (gate rows then up rows), down [H][I],
  // as bf16 (uint16) or int8, and for INT8 the per-row scales [2I] / [H].
  using Fill =
      std::function<void(int64_t e, void* gate_up, float* gu_scale, void* down, float* down_scale)>;
  static absl::StatusOr<std::unique_ptr<OnednnMoe>> Create(WeightFormat format, int64_t hidden,
                                                           int64_t inter, int64_t num_experts,
                                                           int64_t expert_begin, const Fill& fill);
  // From plain quantized experts (tests).
  static absl::StatusOr<std::unique_ptr<OnednnMoe>> FromQuant(
      const std::vector<QuantExpert>& experts, int64_t expert_begin);
  ~OnednnMoe();

  // out [T][H] f32, overwritten. Runs on the calling thread's OpenMP team
  // (oneDNN's runtime here), matmuls and glue alike.
  absl::Status Run(const MoeInput& in, float* out);
  // OpenMP threads for later Run calls from this thread (0: leave as is), so
  // a benchmark can give the baseline the same thread count as ours.
  static void SetThreads(int threads);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe
