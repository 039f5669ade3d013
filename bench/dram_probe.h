// The machine's DRAM read bandwidth, the denominator of every memory-bound
// figure in the benchmarks (hmoe-bench-moe's "% read probe", hmoe-bench-e2e's
// CPU-expert decode ceiling). One probe for both.
//
// Every thread of the pool reads its own contiguous share of one buffer
// (first-touched by that thread, so it lies on the thread's node) in several
// access patterns: 1, 4 or 8 interleaved sequential streams per thread, with
// no software prefetch or with _mm_prefetch 1 KiB / 4 KiB ahead of each
// stream, with the widest loads this CPU has (AVX-512 and AVX2 where present;
// SSE2 otherwise; chosen at run time, never SIGILL). A pattern's figure is the
// best of `reps` passes; the machine's bandwidth is the best pattern. A
// single pattern alone (one stream per thread) reads 30-40% below what the
// expert kernels reach on the GPU machine, so only the best of them bounds
// the kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/runtime/thread_pool.h"

namespace hmoe {

struct DramPattern {
  std::string name;  // e.g. "avx512 x8 pf1k": load width, streams per thread, prefetch
  double gbs = 0;    // best pass, GB/s (1e9 bytes)
};

struct DramProbe {
  std::vector<DramPattern> patterns;
  double best_gbs = 0;
  std::string best;  // the best pattern's name
  int64_t buffer_bytes = 0;
  int threads = 0;
};

// The largest cache any level of cpu0 reports (sysfs); 32 MiB when unknown.
int64_t LlcBytes();
// What the probe reads by default: max(8 x LLC, 2 GiB).
int64_t DefaultProbeBytes();

// RESOURCE_EXHAUSTED when the buffer cannot be allocated; INVALID_ARGUMENT
// for bytes < 1 MiB per thread or reps < 1.
absl::StatusOr<DramProbe> MeasureDramRead(ThreadPool& pool, int64_t bytes, int reps = 4);

// "avx512 x1 42.0, ... | best 57.1 GB/s (avx512 x8 pf1k)".
std::string DramProbeSummary(const DramProbe& p);

}  // namespace hmoe
