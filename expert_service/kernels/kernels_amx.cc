#include "expert_service/kernels/gemm.h"
namespace hmoe::kern {
const KernelSet& AmxKernels() { return ScalarKernels(); }
void AmxPeakLoop(int64_t, bool) {}
}  // namespace hmoe::kern
