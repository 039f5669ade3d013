// The one persistent worker pool (the expert kernels', the CPU reference
// backend's, the benchmarks'): one worker per core, grouped into (real or
// virtual) NUMA nodes, or (per_core = false) a plain count of unpinned
// workers. Worker 0 is the thread that calls Run() (no thread spins idle
// waiting for the others); workers 1..n-1 are threads pinned to the other
// cores (with pin); Run() keeps the caller on node 0's first core for the call
// (ThreadPoolOptions::pin_caller). Run() hands one function to every worker and
// returns when all have finished it; callers split work with their own atomic
// counters (per node for node-local work), or use ParallelFor (by index, or
// by ranges of at least a grain). Idle workers spin for `spin_us`, then sleep
// on a futex (std::atomic::wait). The pool reads no environment: binaries
// read HMOE_THREADS / HMOE_VIRTUAL_NUMA at their edge (ThreadCountsFromEnv).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/runtime/numa.h"

namespace hmoe {

struct ThreadPoolOptions {
  // Workers, the calling thread included. 0: one per core the process may
  // run on (per_core; else INVALID_ARGUMENT).
  int max_threads = 0;
  // >0: split the cores into this many nodes; 0: the real NUMA nodes.
  int virtual_nodes = 0;
  // true: one worker per core (DiscoverTopology), at most max_threads.
  // false: exactly max_threads (>= 1) workers in one node, never pinned and
  // tied to no core (each NodeCores cpu is -1, mem_node -1: memory unbound),
  // however many cores there are; virtual_nodes must be 0.
  bool per_core = true;
  bool pin = true;  // (per_core) pin each worker to its core
  // (with pin) Run() moves a calling thread that is not on node 0's first
  // core there for the call and restores its affinity after it.
  bool pin_caller = true;
  int spin_us = 500;  // busy-wait this long for new work before sleeping
};

// A pool of `threads` workers (the caller included) tied to no core, which
// sleep as soon as they are idle: the CPU reference backend's loops.
ThreadPoolOptions UnpinnedThreads(int threads);

// HMOE_THREADS and HMOE_VIRTUAL_NUMA, for a binary to read once at its edge
// (the pool itself reads no environment): each sets *max_threads /
// *virtual_nodes where that is 0 (an explicit count wins, and its variable is
// not read); unset or empty leaves it 0. INVALID_ARGUMENT naming the variable
// and its value when that is not a non-negative integer.
absl::Status ThreadCountsFromEnv(int* max_threads, int* virtual_nodes);

struct Worker {
  int global = 0;   // 0 .. num_threads-1
  int node = 0;     // 0 .. num_nodes-1
  int in_node = 0;  // 0 .. node_threads(node)-1
};

class ThreadPool {
 public:
  // INVALID_ARGUMENT for negative counts (see DiscoverTopology), or, without
  // per_core, a count below 1 or virtual nodes.
  // RESOURCE_EXHAUSTED when a worker thread cannot be started.
  // FAILED_PRECONDITION when (with pin) a worker cannot be pinned to its CPU.
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(const ThreadPoolOptions& opts = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  int node_threads(int node) const {
    return static_cast<int>(nodes_[static_cast<size_t>(node)].cpus.size());
  }
  int mem_node(int node) const { return nodes_[static_cast<size_t>(node)].mem_node; }
  const std::vector<NodeCores>& nodes() const { return nodes_; }

  // Runs fn on every worker (worker 0 on the calling thread) and waits.
  // Calls from several threads are serialized. If fn throws (e.g. bad_alloc
  // while loading), Run still waits for every worker to finish the job, then
  // rethrows the first exception; the pool stays usable.
  void Run(absl::FunctionRef<void(const Worker&)> fn);

  // fn(i, worker) for i in [0, n), dynamically scheduled over all workers.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t, const Worker&)> fn);

  // fn(begin, end) over disjoint ranges covering [0, n), each at least
  // `grain` long (except the last; about 4 per worker), handed out by an
  // atomic counter. Runs inline on the caller, without waking the workers,
  // when the pool has one thread, n <= grain, or it is called from inside
  // another range's fn (of any pool). Otherwise as Run: calls from several
  // threads are serialized; an exception is rethrown after every worker
  // finished.
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> fn);

 private:
  ThreadPool() = default;
  void Loop(Worker w);

  std::vector<NodeCores> nodes_;
  std::vector<std::thread> workers_;
  int spin_us_ = 500;
  bool pin_caller_ = false;
  int caller_cpu_ = 0;  // node 0's first core
  Worker caller_;
  std::mutex run_mu_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint32_t> pending_{0};
  std::atomic<bool> stop_{false};
  const absl::FunctionRef<void(const Worker&)>* job_ = nullptr;
  std::mutex error_mu_;
  std::exception_ptr error_;  // the job's first exception, guarded by error_mu_
  void RunJob(const Worker& w, absl::FunctionRef<void(const Worker&)> fn);
};

}  // namespace hmoe
