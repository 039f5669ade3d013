// A small persistent thread pool for the CPU reference backend's parallel loops.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hmoe::cpu {

class ThreadPool {
 public:
  // `threads` workers in total, the calling thread included (<= 1: everything
  // runs inline on the caller).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) over disjoint chunks covering [0, n), each at least
  // `grain` long (except the last), and returns when all are done. Chunks are
  // handed out by an atomic counter. One loop runs at a time: concurrent
  // callers queue; a call from inside a chunk runs inline. `fn` must not throw.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunChunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunk);

  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one loop at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int active_ = 0;  // workers inside the current loop
  // The current loop.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

}  // namespace hmoe::cpu
