// Shared fixtures for the kernels tests: random routing, error metric, the
// kernel sets (random experts: tests/testing/random_experts.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/runtime/thread_pool.h"
#include "common/tensor.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/kernels/moe.h"
#include "tests/testing/random_experts.h"

namespace hmoe::testing {

struct Batch {
  int64_t T = 0;
  int K = 0;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  MoeInput input() const { return MoeInput{T, K, x.data(), ids.data(), w.data()}; }
};

// Skewed routing over [0, E_total) (expert 0 takes ~1/3 of the slots so
// regimes mix); repeats within a token allowed when `repeats`; expert
// `empty_expert` never routed; ids outside [0, E_total) appear when `foreign`.
inline Batch RandomBatch(int64_t T, int K, int64_t H, int64_t E_total, uint64_t seed,
                         bool repeats = true, int64_t empty_expert = -1, bool foreign = false) {
  Batch b;
  b.T = T;
  b.K = K;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  b.x.resize(static_cast<size_t>(T * H));
  for (auto& v : b.x) v = F32ToBf16(nd(rng));
  std::uniform_int_distribution<int64_t> ue(0, E_total - 1);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < K; ++j) {
      int64_t e = (rng() % 3 == 0) ? 0 : ue(rng);
      if (e == empty_expert) e = (e + 1) % E_total;
      if (!repeats)
        for (int jj = 0; jj < j; ++jj)
          if (b.ids[static_cast<size_t>(t * K + jj)] == e) {
            e = -1;
            break;
          }
      if (foreign && rng() % 5 == 0) e = (rng() & 1) ? E_total + 3 : -1;
      b.ids.push_back(static_cast<int32_t>(e));
      b.w.push_back(uw(rng));
    }
  return b;
}

// max |a - b| / max |b|; +inf when the sizes differ or either side holds a
// NaN or inf (so a kernel that writes NaN fails every bound: std::max would
// skip it).
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (a.size() != b.size()) return kInf;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return kInf;
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den == 0 ? num : num / den;
}

inline ThreadPool& SharedPool() {
  static ThreadPool* pool = [] {
    ThreadPoolOptions o;
    o.max_threads = 2;
    o.virtual_nodes = 1;
    return ThreadPool::Create(o).value().release();
  }();
  return *pool;
}

// The kernel sets this CPU runs, by name.
struct NamedSet {
  std::string name;
  const kern::KernelSet* set;
};
inline std::vector<NamedSet> SetsOnThisCpu() {
  std::vector<NamedSet> sets = {{"scalar", &kern::ScalarKernels()}};
  if (DetectedIsa() >= Isa::kAvx2) sets.push_back({"avx2", &kern::Avx2Kernels()});
  if (DetectedIsa() >= Isa::kAvx512) sets.push_back({"avx512", &kern::Avx512Kernels()});
  if (DetectedIsa() >= Isa::kAmx) sets.push_back({"amx", &kern::AmxKernels()});
  return sets;
}

}  // namespace hmoe::testing
