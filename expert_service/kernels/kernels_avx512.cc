#include "expert_service/kernels/gemm.h"
namespace hmoe::kern {
const KernelSet& Avx512Kernels() { return ScalarKernels(); }
uint64_t StreamReadAvx512(const uint8_t*, int64_t) { return 0; }
}  // namespace hmoe::kern
