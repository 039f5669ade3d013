#include "expert_service/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace hmoe {
namespace {

TEST(ThreadPoolTest, ParallelForVisitsEachIndexOnce) {
  auto pool = ThreadPool::Create({}).value();
  ASSERT_GE(pool->num_threads(), 1);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(1000);
    pool->ParallelFor(1000, [&](int64_t i, const Worker&) { hits[static_cast<size_t>(i)]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(ThreadPoolTest, RunReachesEveryWorkerWithNodeIds) {
  ThreadPoolOptions o;
  o.virtual_nodes = 2;
  o.max_threads = 2;
  auto pool = ThreadPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->num_nodes(), 2);
  std::vector<std::atomic<int>> seen(static_cast<size_t>((*pool)->num_threads()));
  (*pool)->Run([&](const Worker& w) {
    EXPECT_LT(w.node, 2);
    EXPECT_LT(w.in_node, (*pool)->node_threads(w.node));
    seen[static_cast<size_t>(w.global)]++;
  });
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
}

TEST(ThreadPoolTest, SleepsAndWakes) {
  ThreadPoolOptions o;
  o.spin_us = 1;
  auto pool = ThreadPool::Create(o).value();
  std::atomic<int> n{0};
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    pool->Run([&](const Worker&) { n++; });
  }
  EXPECT_EQ(n.load(), 5 * pool->num_threads());
}

TEST(ThreadPoolTest, TooManyVirtualNodesIsAnError) {
  ThreadPoolOptions o;
  o.max_threads = 1;
  o.virtual_nodes = 4;
  EXPECT_FALSE(ThreadPool::Create(o).ok());
}

TEST(NumaBufferTest, AllocatesAndFrees) {
  auto b = NumaBuffer::Allocate(1 << 20, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
  b->data()[0] = 1;
  b->data()[(1 << 20) - 1] = 2;
  NumaBuffer moved = std::move(*b);
  EXPECT_EQ(moved.data()[0], 1);
}

}  // namespace
}  // namespace hmoe
