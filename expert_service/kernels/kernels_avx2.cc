#include "expert_service/kernels/gemm.h"
namespace hmoe::kern {
const KernelSet& Avx2Kernels() { return ScalarKernels(); }
}  // namespace hmoe::kern
