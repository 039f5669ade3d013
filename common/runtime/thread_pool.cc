#include "common/runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Set while this thread runs a range of ParallelFor(n, grain, fn): a nested
// call runs inline.
thread_local bool in_range = false;

// A non-negative count from the environment; unset or empty is 0.
absl::StatusOr<int> EnvCount(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  int n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(name, "='", v, "' is not a non-negative integer"));
  return n;
}

// The nodes of a pool: the cores found (per_core) or one node of workers
// tied to no core.
absl::StatusOr<std::vector<NodeCores>> PoolNodes(const ThreadPoolOptions& opts) {
  if (opts.per_core) {
    TopologyOptions topo;
    topo.max_threads = opts.max_threads;
    topo.virtual_nodes = opts.virtual_nodes;
    return DiscoverTopology(topo);
  }
  if (opts.max_threads < 1 || opts.virtual_nodes != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "a pool without per_core takes max_threads >= 1 and no virtual_nodes, got max_threads ",
        opts.max_threads, ", virtual_nodes ", opts.virtual_nodes));
  NodeCores node;
  node.cpus.assign(static_cast<size_t>(opts.max_threads), -1);
  node.mem_node = -1;
  return std::vector<NodeCores>{std::move(node)};
}

}  // namespace

ThreadPoolOptions UnpinnedThreads(int threads) {
  ThreadPoolOptions o;
  o.max_threads = threads;
  o.per_core = false;
  o.pin = false;
  o.spin_us = 0;
  return o;
}

absl::Status ThreadCountsFromEnv(int* max_threads, int* virtual_nodes) {
  if (*max_threads == 0) {
    auto n = EnvCount("HMOE_THREADS");
    if (!n.ok()) return n.status();
    *max_threads = *n;
  }
  if (*virtual_nodes == 0) {
    auto n = EnvCount("HMOE_VIRTUAL_NUMA");
    if (!n.ok()) return n.status();
    *virtual_nodes = *n;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const ThreadPoolOptions& opts) {
  auto nodes = PoolNodes(opts);
  if (!nodes.ok()) return nodes.status();
  const bool pin = opts.per_core && opts.pin;
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  pool->nodes_ = std::move(*nodes);
  pool->spin_us_ = opts.spin_us;
  pool->pin_caller_ = pin && opts.pin_caller;
  size_t planned = 0;
  for (const NodeCores& n : pool->nodes_) planned += n.cpus.size();
  int g = 0;
  for (size_t n = 0; n < pool->nodes_.size(); ++n) {
    for (size_t i = 0; i < pool->nodes_[n].cpus.size(); ++i, ++g) {
      Worker w{g, static_cast<int>(n), static_cast<int>(i)};
      if (g == 0) {
        pool->caller_ = w;  // the thread calling Run()
        pool->caller_cpu_ = pool->nodes_[n].cpus[i];
        continue;
      }
      const int cpu = pool->nodes_[n].cpus[i];
      try {
        pool->workers_.emplace_back(&ThreadPool::Loop, pool.get(), w);
      } catch (const std::system_error& e) {  // EAGAIN: a pids / tasks limit
        return absl::ResourceExhaustedError(
            absl::StrCat("starting worker thread ", g, " of ", planned, ": ", e.what()));
      }
      if (pin) {
        // Pinned from here so a refusal is reported, not ignored (the CPU
        // set changed since discovery, or a cgroup cpuset forbids the CPU).
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        const int err =
            pthread_setaffinity_np(pool->workers_.back().native_handle(), sizeof(set), &set);
        if (err != 0)
          return absl::FailedPreconditionError(
              absl::StrCat("pinning worker ", g, " to CPU ", cpu, ": ", std::strerror(err),
                           " (the CPUs the process may use changed while the pool started?)"));
      }
    }
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  gen_.fetch_add(1, std::memory_order_acq_rel);
  gen_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Loop(Worker w) {
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        CpuRelax();
        if (++spins == 64) {
          spins = 0;
          if (std::chrono::steady_clock::now() > deadline) {
            gen_.wait(seen, std::memory_order_acquire);
          }
        }
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    RunJob(w, *job_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

// Runs the job on one worker; an exception is kept (the first one), never
// let out: a worker thread would terminate, the caller would unwind while
// the others still use the job.
void ThreadPool::RunJob(const Worker& w, absl::FunctionRef<void(const Worker&)> fn) {
  try {
    fn(w);
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::Run(absl::FunctionRef<void(const Worker&)> fn) {
  std::lock_guard<std::mutex> lock(run_mu_);
  // Worker 0 runs here: on node 0's first core, not on a core whose pinned
  // worker it would share. Only a thread found elsewhere is moved, and its
  // own affinity is restored after the call (threads it creates later must
  // not inherit one core); it then usually stays, so later calls cost one
  // sched_getcpu.
  cpu_set_t saved;
  bool moved = false;
  if (pin_caller_ && sched_getcpu() != caller_cpu_ &&
      pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(caller_cpu_, &one);
    moved = pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
  }
  job_ = &fn;
  pending_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_release);
  gen_.fetch_add(1, std::memory_order_acq_rel);
  gen_.notify_all();
  RunJob(caller_, fn);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
  int spins = 0;
  for (;;) {
    uint32_t p = pending_.load(std::memory_order_acquire);
    if (p == 0) break;
    CpuRelax();
    if (++spins == 64) {
      spins = 0;
      if (std::chrono::steady_clock::now() > deadline) pending_.wait(p, std::memory_order_acquire);
    }
  }
  job_ = nullptr;
  if (moved) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t, const Worker&)> fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  Run([&](const Worker& w) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i, w);
  });
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (workers_.empty() || in_range || n <= grain) {
    fn(0, n);
    return;
  }
  const int64_t per = 4 * static_cast<int64_t>(num_threads());
  const int64_t chunk = std::max(grain, (n + per - 1) / per);
  std::atomic<int64_t> next{0};
  Run([&](const Worker&) {
    struct InRange {  // restored however fn leaves
      bool was = in_range;
      InRange() { in_range = true; }
      ~InRange() { in_range = was; }
    } scope;
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < n;)
      fn(b, std::min(n, b + chunk));
  });
}

}  // namespace hmoe
