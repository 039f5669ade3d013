// The launcher contract every kernel family shares (gpu_worker/cuda/kernel_api.h): zero-size work
// is a no-op returning cudaSuccess. Skips without a usable CUDA device.
#include <gtest/gtest.h>

#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/mla_kernels.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"
#include "gpu_worker/cuda/router_kernels.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

TEST(GpuKernelTest, ZeroSizesAreNoOps) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(EmbedRows(nullptr, 16, nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(AddRmsNorm(nullptr, nullptr, 0, 16, nullptr, 1e-6f, nullptr, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(ApplyRope(nullptr, 0, 4, 64, 16, 0, 16, nullptr, false, nullptr), cudaSuccess);
  EXPECT_EQ(
      WriteMlaCache(nullptr, 0, 512, 64, nullptr, 1e-6f, nullptr, true, nullptr, nullptr, nullptr),
      cudaSuccess);
  EXPECT_EQ(WriteKvCache(nullptr, nullptr, 0, 16, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  PagedAttentionArgs a;
  a.dk = a.dv = 64;
  EXPECT_EQ(PagedAttention(a, nullptr), cudaSuccess);
  EXPECT_EQ(MlaAbsorbQuery(nullptr, nullptr, 0, 128, 128, 64, 128, 512, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(MlaExpandOutput(nullptr, nullptr, 0, 128, 128, 128, 512, nullptr, nullptr, nullptr),
            cudaSuccess);
  RouteParams p;
  p.num_experts = 8;
  p.top_k = 2;
  EXPECT_EQ(RouteTokens(nullptr, 0, p, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(SiluMul(nullptr, 0, 16, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(ToBf16(nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(Bf16ToF32(nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(AddBias(nullptr, 0, 16, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(Accumulate(nullptr, nullptr, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(GatherRows(nullptr, 16, nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace hmoe::cuda
