// The one place a layer's outputs join the residual stream. Internal to
// gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "gpu_worker/cuda/expert_call_path.h"

namespace hmoe::cuda {

// residual += (parts[0] + parts[1] + ...) + shared, each addition rounded to
// f32 from left to right, as the reference adds the routed experts' sum (the
// service's part, then what the GPU computed of it: hot or streamed) and then
// the shared experts'. Absent terms (null data) are skipped; a single term is
// added as is. Otherwise the sum is formed in the first scratch term, which
// must be among the first two present (a + b == b + a bit for bit); the other
// terms are not written. n: floats per term. Launches through `ops`.
absl::Status JoinResidual(float* residual, std::initializer_list<ResidualPart> parts,
                          ResidualPart shared, int64_t n, StreamOps& ops);

}  // namespace hmoe::cuda
