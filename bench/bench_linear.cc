// hmoe-bench-linear: the CPU reference backend's Linear (gpu_worker/cpu/ops.h),
// the worker's dense layers, shared experts and LM head on that backend.
// Google Benchmark; one thread (the per-core figure), bf16 and f32 weights,
// scalar vs the AVX2 and AVX-512 paths (same bits). Counters: GFLOP/s and the weights'
// GB/s (the weights stream once per call; activations stay in cache).
//
//   hmoe-bench-linear [--benchmark_filter=bf16] [--benchmark_min_time=0.2]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "gpu_worker/cpu/ops.h"

namespace hmoe::cpu {
namespace {

// Args: K, N, T, bf16 (0/1), isa (LinearIsa: 0 scalar, 1 AVX2, 2 AVX-512).
void BM_Linear(benchmark::State& state) {
  const int64_t K = state.range(0), N = state.range(1), T = state.range(2);
  const bool bf16 = state.range(3) != 0;
  const auto isa = static_cast<LinearIsa>(state.range(4));
  if (isa > BestLinearIsa()) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(T * K)), wf(static_cast<size_t>(N * K));
  for (float& v : x) v = nd(rng);
  for (float& v : wf) v = nd(rng) * 0.05f;
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = F32ToBf16(wf[i]);
  Matrix m;
  m.rows = N;
  m.cols = K;
  if (bf16)
    m.bf16 = wb.data();
  else
    m.f32 = wf.data();
  std::vector<float> y(static_cast<size_t>(T * N));
  for (auto _ : state) {
    Linear(nullptr, x.data(), T, m, nullptr, y.data(), isa);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  const double calls = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * K * N * T * calls / 1e9, benchmark::Counter::kIsRate);
  state.counters["weight_GB/s"] = benchmark::Counter(
      static_cast<double>(N * K * (bf16 ? 2 : 4)) * calls / 1e9, benchmark::Counter::kIsRate);
  static const char* const kIsa[] = {" scalar", " avx2", " avx512"};
  state.SetLabel(std::string(bf16 ? "bf16" : "f32") + kIsa[static_cast<int>(isa)]);
}

// Shapes of the serving benchmark's model (H 2048, I 1024 shared / dense
// 4096) and of the trained fixture's LM head; T: a decode step of 1-16
// requests and a prefill chunk of 64.
void Shapes(benchmark::internal::Benchmark* b) {
  for (auto [K, N] : {std::pair<int64_t, int64_t>{2048, 2048}, {2048, 4096}, {1024, 2048}})
    for (int64_t T : {1, 4, 16, 64})
      for (int64_t bf16 : {1, 0})
        for (int64_t isa : {0, 1, 2}) b->Args({K, N, T, bf16, isa});
}
BENCHMARK(BM_Linear)->Apply(Shapes)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace hmoe::cpu

BENCHMARK_MAIN();
