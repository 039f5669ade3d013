// A persistent worker pool: one worker per core, grouped into (real or
// virtual) NUMA nodes. Worker 0 is the thread that calls Run() (no thread
// spins idle waiting for the others); workers 1..n-1 are threads pinned to
// the other cores; Run() keeps the caller on node 0's first core for the call
// (ThreadPoolOptions::pin_caller). Run() hands one function to every worker and
// returns when all have finished it; callers split work with their own atomic
// counters (per node for node-local work, see ParallelFor). Idle workers spin
// for `spin_us`, then sleep on a futex (std::atomic::wait).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "expert_service/numa.h"

namespace hmoe {

struct ThreadPoolOptions {
  // 0: env HMOE_THREADS if set, else one per core.
  int max_threads = 0;
  // 0: env HMOE_VIRTUAL_NUMA if set, else the real NUMA nodes.
  int virtual_nodes = 0;
  bool pin = true;  // pin each worker to its core
  // (with pin) Run() moves a calling thread that is not on node 0's first
  // core there for the call and restores its affinity after it.
  bool pin_caller = true;
  int spin_us = 500;  // busy-wait this long for new work before sleeping
};

struct Worker {
  int global = 0;   // 0 .. num_threads-1
  int node = 0;     // 0 .. num_nodes-1
  int in_node = 0;  // 0 .. node_threads(node)-1
};

class ThreadPool {
 public:
  // INVALID_ARGUMENT for negative counts, or an env value that is not a
  // non-negative integer (named in the message); see DiscoverTopology.
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
