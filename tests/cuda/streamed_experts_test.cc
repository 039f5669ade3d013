// StreamedExperts' prefetch of the next MoE layer (gpu_worker/cuda/
// streamed_experts.h): the same Runs on an instance with two stages and
// guesses (right, partly wrong, of another layer, empty, repeated) and on one
// without give bit-for-bit equal outputs and CPU ids, and the counts of
// experts uploaded ahead and used are exactly what the guesses imply. Skips
// without a usable CUDA device.
#include "gpu_worker/cuda/streamed_experts.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/experts/synthetic_source.h"
#include "common/experts/weight_format.h"
#include "common/model_config.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/cuda/device_status.h"
#include "tests/testing/temp_dir.h"

namespace hmoe::cuda {
namespace {

class Streams {
 public:
  Streams() {
    ok_ = cudaStreamCreate(&stream_) == cudaSuccess &&
          cublasCreate(&blas_) == CUBLAS_STATUS_SUCCESS &&
          cublasSetStream(blas_, stream_) == CUBLAS_STATUS_SUCCESS;
  }
  ~Streams() {
    if (blas_ != nullptr) cublasDestroy(blas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  bool ok() const { return ok_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }

 private:
  bool ok_ = false;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

struct Pass {
  int layer;
  std::vector<int32_t> ids;  // [T][K]
};

TEST(StreamedExperts, PrefetchChangesNoResultAndCountsItsGuesses) {
  if (std::string why; !CudaDeviceUsable(&why)) GTEST_SKIP() << why;
  auto config = LoadModelConfig(testing::FixturesDir() + "/ds3_fortunes");
  ASSERT_TRUE(config.ok()) << config.status();
  const std::vector<int32_t> moe = config->moe_layer_indices();
  ASSERT_GE(moe.size(), 4u) << "the fixture has the MoE layers this test walks";
  const int64_t H = config->hidden_size, E = config->moe.num_experts,
                K = config->moe.experts_per_token, T = 40;
  SyntheticExperts spec{config->hidden_size, config->moe.intermediate_size, E, 7};
  const ExpertSourceFn source = [&](int layer) { return SyntheticExpertSource(spec, layer); };

  // Routing per layer: each token K distinct experts, drawn from a subset
  // so that some experts get no token.
  std::mt19937 rng(5);
  auto route = [&](int layer, int64_t used) {
    Pass p{layer, {}};
    std::vector<int32_t> pool(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) pool[static_cast<size_t>(e)] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    pool.resize(static_cast<size_t>(used));
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(pool.begin(), pool.end(), rng);
      p.ids.insert(p.ids.end(), pool.begin(), pool.begin() + K);
    }
    return p;
  };
  auto experts_of = [&](const Pass& p) {
    std::set<int32_t> s(p.ids.begin(), p.ids.end());
    return std::vector<int32_t>(s.begin(), s.end());
  };

  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  std::vector<float> w(static_cast<size_t>(T * K));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (uint16_t& v : x) {
    const float f = u(rng);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    v = static_cast<uint16_t>(b >> 16);
  }
  for (float& v : w) v = 0.1f + 0.9f * (u(rng) + 1.f) / 2.f;
  void *dx = nullptr, *dw = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, w.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);

  for (const WeightFormat fmt : {WeightFormat::kBf16, WeightFormat::kInt4}) {
    SCOPED_TRACE(WeightFormatName(fmt));
    Streams s;
    ASSERT_TRUE(s.ok());
    Budget budget(int64_t{8} << 30);
    auto with =
        StreamedExperts::Create(*config, source, fmt, 32, 64, true, s.stream(), s.blas(), &budget);
    ASSERT_TRUE(with.ok()) << with.status();
    auto without =
        StreamedExperts::Create(*config, source, fmt, 32, 64, false, s.stream(), s.blas(), &budget);
    ASSERT_TRUE(without.ok()) << without.status();
    ASSERT_EQ((*with)->stages(), 2);
    ASSERT_EQ((*without)->stages(), 1);

    int64_t ahead = 0, used = 0;
    // Runs `p` (its experts, or `gpu` when given) on both and compares.
    auto run = [&](const Pass& p, std::vector<int32_t> gpu = {}) {
      if (gpu.empty()) gpu = experts_of(p);
      std::vector<float> out[2];
      std::vector<int32_t> cpu[2];
      StreamedExperts* inst[2] = {with->get(), without->get()};
      for (int i = 0; i < 2; ++i) {
        cpu[i].assign(p.ids.size(), -7);
        auto n = inst[i]->Run(p.layer, static_cast<const uint16_t*>(dx), T, K, p.ids.data(),
                              static_cast<const float*>(dw), gpu, cpu[i].data());
        ASSERT_TRUE(n.ok()) << n.status();
        int64_t want = 0;
        for (int32_t e : p.ids) want += std::binary_search(gpu.begin(), gpu.end(), e);
        EXPECT_EQ(*n, want);
        out[i].resize(static_cast<size_t>(T * H));
        ASSERT_EQ(cudaStreamSynchronize(s.stream()), cudaSuccess);
        ASSERT_EQ(
            cudaMemcpy(out[i].data(), inst[i]->out(), out[i].size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
      }
      EXPECT_EQ(cpu[0], cpu[1]) << "layer " << p.layer;
      EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4))
          << "layer " << p.layer << ": outputs differ with prefetch";
    };
    auto prefetch = [&](int layer, const std::vector<int32_t>& guess, int64_t want) {
      auto n = (*with)->Prefetch(layer, guess);
      ASSERT_TRUE(n.ok()) << n.status();
      EXPECT_EQ(*n, want) << "experts queued for layer " << layer;
      ahead += want;
      auto none = (*without)->Prefetch(layer, guess);
      ASSERT_TRUE(none.ok()) << none.status();
      EXPECT_EQ(*none, 0) << "one stage prefetches nothing";
    };
    auto check_counts = [&] {
      EXPECT_EQ((*with)->prefetched(), ahead);
      EXPECT_EQ((*with)->prefetch_used(), used);
      EXPECT_EQ((*without)->prefetched(), 0);
      EXPECT_EQ((*without)->prefetch_used(), 0);
    };

    const Pass p0 = route(moe[0], E / 2), p1 = route(moe[1], E / 2), p2 = route(moe[2], E),
               p0b = route(moe[0], 6);
    run(p0);
    check_counts();
    // Partly wrong: half of p1's experts and the experts p1 does not use.
    const std::vector<int32_t> e1 = experts_of(p1);
    std::vector<int32_t> g1;
    for (size_t i = 0; i < e1.size(); i += 2) g1.push_back(e1[i]);
    const int64_t right1 = static_cast<int64_t>(g1.size());
    for (int32_t e = 0; e < E; ++e)
      if (!std::binary_search(e1.begin(), e1.end(), e)) g1.push_back(e);
    std::vector<int32_t> g1_twice = g1;  // repeats are ignored
    g1_twice.insert(g1_twice.end(), g1.begin(), g1.begin() + 3);
    prefetch(moe[1], g1_twice, static_cast<int64_t>(g1.size()));
    prefetch(moe[1], g1, 0);  // already queued: nothing again
    run(p1);
    used += right1;
    check_counts();
    // Every expert of the next layer, right.
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) all[static_cast<size_t>(e)] = e;
    prefetch(moe[2], all, E);
    run(p2);
    used += static_cast<int64_t>(experts_of(p2).size());
    check_counts();
    // A guess for another layer than the one that runs next: overwritten.
    prefetch(moe[3], all, E);
    run(p0b);
    check_counts();
    // Empty guess; then the same layer again from the stage it is in, with
    // a subset of its experts on the GPU (the rest go to the service).
    prefetch(moe[0], {}, 0);
    std::vector<int32_t> half = experts_of(p0b);
    half.resize(half.size() / 2);
    run(p0b, half);
    run(p2);
    check_counts();
    // Bad input.
    EXPECT_EQ((*with)->Prefetch(-1, all).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*with)->Prefetch(moe[0], {static_cast<int32_t>(E)}).status().code(),
              absl::StatusCode::kInvalidArgument);
    if (config->first_k_dense_replace > 0) {
      EXPECT_EQ((*with)->Prefetch(0, all).status().code(), absl::StatusCode::kInvalidArgument)
          << "layer 0 is dense";
    }
  }
  cudaFree(dx);
  cudaFree(dw);
}

}  // namespace
}  // namespace hmoe::cuda
