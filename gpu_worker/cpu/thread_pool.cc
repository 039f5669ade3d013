#include "gpu_worker/cpu/thread_pool.h"

#include <algorithm>

namespace hmoe::cpu {
namespace {
thread_local bool in_pool_task = false;
}  // namespace

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunChunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n,
                           int64_t chunk) {
  const bool was = in_pool_task;
  in_pool_task = true;
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk, std::memory_order_relaxed);
    if (begin >= n) break;
    fn(begin, std::min(n, begin + chunk));
  }
  in_pool_task = was;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (fn_ == nullptr) continue;  // woke after that loop was closed
      fn = fn_;
      n = n_;
      chunk = chunk_;
      ++active_;
    }
    RunChunks(*fn, n, chunk);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (workers_.empty() || in_pool_task || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mu_);
  // About 4 chunks per thread for balance, never below the grain.
  const int64_t chunk = std::max(grain, (n + 4 * size() - 1) / (4 * size()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_.store(0, std::memory_order_relaxed);
    ++generation_;
  }
  wake_.notify_all();
  RunChunks(fn, n, chunk);
  std::unique_lock<std::mutex> lock(mu_);
  // Wait for every worker that joined this loop; later wakers see it closed.
  done_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace hmoe::cpu
