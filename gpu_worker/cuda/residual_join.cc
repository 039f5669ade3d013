#include "gpu_worker/cuda/residual_join.h"

#include <vector>

#include "common/status.h"
#include "gpu_worker/cuda/elementwise_kernels.h"

namespace hmoe::cuda {

absl::Status JoinResidual(float* residual, std::initializer_list<ResidualPart> parts,
                          ResidualPart shared, int64_t n, StreamOps& ops) {
  ResidualPart terms[8];
  int count = 0;
  for (const ResidualPart& p : parts)
    if (p.data != nullptr && count < 7) terms[count++] = p;
  if (shared.data != nullptr) terms[count++] = shared;
  if (count == 0) return absl::OkStatus();
  if (count == 1)
    return ops.Launched(Accumulate(residual, terms[0].data, nullptr, n, ops.stream()),
                        "Accumulate");
  int acc = -1;
  for (int i = 0; i < count && acc < 0; ++i)
    if (terms[i].scratch) acc = i;
  if (acc < 0 || (acc > 1 && count > 2))
    return absl::InternalError("JoinResidual: no scratch term to sum into in order");
  float* sum = const_cast<float*>(terms[acc].data);
  for (int i = 0; i < count; ++i) {
    if (i == acc) continue;
    RETURN_IF_ERROR(
        ops.Launched(Accumulate(sum, terms[i].data, nullptr, n, ops.stream()), "Accumulate"));
  }
  return ops.Launched(Accumulate(residual, sum, nullptr, n, ops.stream()), "Accumulate");
}

}  // namespace hmoe::cuda
