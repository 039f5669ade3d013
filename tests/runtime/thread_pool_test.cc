#include "common/runtime/thread_pool.h"

#include <gtest/gtest.h>
#include <numaif.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/runtime/numa.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

// CPU lists as --cores and hmoe-bench-e2e's --service-cores take them.
TEST(ParseCpuListTest, RangesAndSinglesAndClearErrors) {
  cpu_set_t set;
  ASSERT_TRUE(ParseCpuList("0-2,5,7-7", &set).ok());
  EXPECT_EQ(CPU_COUNT(&set), 5);
  for (int c : {0, 1, 2, 5, 7}) EXPECT_TRUE(CPU_ISSET(c, &set)) << c;
  EXPECT_FALSE(CPU_ISSET(3, &set));
  ASSERT_TRUE(ParseCpuList("14", &set).ok());
  EXPECT_EQ(CPU_COUNT(&set), 1);
  for (const char* bad : {"", "3-1", "a", "1-2-3", "-1", "0,,2", "99999"}) {
    absl::Status st = ParseCpuList(bad, &set);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("bad CPU range"), std::string_view::npos) << st;
  }
}

TEST(ThreadPoolTest, ParallelForVisitsEachIndexOnce) {
  auto pool = ThreadPool::Create({}).value();
  ASSERT_GE(pool->num_threads(), 1);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> hits(1000);
    pool->ParallelFor(1000, [&](int64_t i, const Worker&) { hits[static_cast<size_t>(i)]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

// A job that throws (bad_alloc while loading) on the calling worker or a
// pool thread: Run waits for every worker to finish with the job, then
// rethrows; the pool stays usable (before: a worker thread's exception
// terminated the process; the caller's unwound while the others still ran
// the job, and the next Run could return before its workers finished).
TEST(ThreadPoolTest, AnExceptionInAJobIsRethrownAfterEveryWorkerFinished) {
  ThreadPoolOptions o;
  o.max_threads = 4;
  auto pool = ThreadPool::Create(o).value();
  for (int thrower : {0, pool->num_threads() - 1}) {
    SCOPED_TRACE(thrower);
    std::atomic<int> finished{0};
    bool threw = false;
    try {
      pool->Run([&](const Worker& w) {
        if (w.global == thrower) throw std::runtime_error("job failed");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        finished.fetch_add(1);
      });
    } catch (const std::runtime_error& e) {
      threw = std::string(e.what()) == "job failed";
    }
    EXPECT_TRUE(threw);
    EXPECT_EQ(finished.load(), pool->num_threads() - 1);  // all others done before Run returned
    std::vector<std::atomic<int>> hits(1000);
    pool->ParallelFor(1000, [&](int64_t i, const Worker&) { hits[static_cast<size_t>(i)]++; });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
}

TEST(ThreadPoolTest, RunReachesEveryWorkerWithNodeIds) {
  ThreadPoolOptions o;
  o.virtual_nodes = 2;
  o.max_threads = 2;
  auto pool = ThreadPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ThreadPool& p = **pool;
  ASSERT_EQ(p.num_nodes(), 2);
  int sum = 0;
  for (int n = 0; n < p.num_nodes(); ++n) {
    EXPECT_GE(p.node_threads(n), 1) << "node " << n;
    sum += p.node_threads(n);
  }
  EXPECT_EQ(sum, p.num_threads());
  // seen[node][in_node] and seen_global: each slot exactly once.
  std::vector<std::vector<std::atomic<int>>> seen(2);
  for (int n = 0; n < 2; ++n)
    seen[static_cast<size_t>(n)] =
        std::vector<std::atomic<int>>(static_cast<size_t>(p.node_threads(n)));
  std::vector<std::atomic<int>> seen_global(static_cast<size_t>(p.num_threads()));
  std::atomic<int> bad{0};
  p.Run([&](const Worker& w) {
    if (w.global < 0 || w.global >= p.num_threads() || w.node < 0 || w.node >= 2 || w.in_node < 0 ||
        w.in_node >= p.node_threads(w.node)) {
      bad++;
      return;
    }
    seen_global[static_cast<size_t>(w.global)]++;
    seen[static_cast<size_t>(w.node)][static_cast<size_t>(w.in_node)]++;
  });
  EXPECT_EQ(bad.load(), 0) << "a worker id out of range";
  for (auto& s : seen_global) EXPECT_EQ(s.load(), 1);
  for (auto& node : seen)
    for (auto& s : node) EXPECT_EQ(s.load(), 1);
}

double CpuSeconds(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Idle workers go to sleep after spin_us (no CPU burnt while waiting) and
// wake for the next Run. Each worker thread's own CPU clock is read across an
// idle window: a spinning worker burns ~0.3 s of it (0.075 s even on a
// quarter of a core), a sleeping one ~nothing.
TEST(ThreadPoolTest, SleepsAndWakes) {
  ThreadPoolOptions o;
  o.spin_us = 1;
  o.max_threads = 2;
  auto pool = ThreadPool::Create(o).value();
  if (pool->num_threads() < 2) GTEST_SKIP() << "one CPU: the pool has no worker threads to sleep";
  std::atomic<int> n{0};
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    pool->Run([&](const Worker&) { n++; });
  }
  EXPECT_EQ(n.load(), 5 * pool->num_threads());
  // The CPU clocks of workers 1.. (worker 0 is this thread).
  std::vector<clockid_t> clocks(static_cast<size_t>(pool->num_threads()));
  pool->Run([&](const Worker& w) {
    pthread_getcpuclockid(pthread_self(), &clocks[static_cast<size_t>(w.global)]);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the spin
  std::vector<double> c0;
  for (size_t i = 1; i < clocks.size(); ++i) c0.push_back(CpuSeconds(clocks[i]));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (size_t i = 1; i < clocks.size(); ++i) {
    const double burnt = CpuSeconds(clocks[i]) - c0[i - 1];
    EXPECT_LT(burnt, 0.03) << "idle worker " << i << " burnt " << burnt << " s of CPU in 0.3 s";
  }
  pool->Run([&](const Worker&) { n++; });  // and they wake again
  EXPECT_EQ(n.load(), 6 * pool->num_threads());
}

// Worker 0 runs on the calling thread, moved to node 0's first core for the
// call; the caller's own affinity mask is back after it.
TEST(ThreadPoolTest, RunKeepsTheCallerOnTheFirstCore) {
  ThreadPoolOptions o;
  o.max_threads = 2;
  auto pool = ThreadPool::Create(o).value();
  const int cpu0 = pool->nodes()[0].cpus[0];
  cpu_set_t orig;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(orig), &orig), 0);
  // Start elsewhere when there is an elsewhere: on the pool's other core.
  cpu_set_t start = orig;
  if (pool->num_threads() > 1) {
    CPU_ZERO(&start);
    CPU_SET(pool->nodes().back().cpus.back(), &start);
    ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(start), &start), 0);
  }
  for (int call = 0; call < 3; ++call) {
    int seen = -1;
    pool->Run([&](const Worker& w) {
      if (w.global == 0) seen = sched_getcpu();
    });
    EXPECT_EQ(seen, cpu0) << "call " << call;
    cpu_set_t now;
    ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(now), &now), 0);
    EXPECT_TRUE(CPU_EQUAL(&now, &start)) << "call " << call << ": the caller's mask changed";
  }
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(orig), &orig), 0);
}

TEST(ThreadPoolTest, TooManyVirtualNodesIsAnError) {
  ThreadPoolOptions o;
  o.max_threads = 1;
  o.virtual_nodes = 4;
  EXPECT_FALSE(ThreadPool::Create(o).ok());
}

// HMOE_THREADS / HMOE_VIRTUAL_NUMA apply, at a binary's edge, when the
// option is 0; a value that is not a non-negative integer is
// INVALID_ARGUMENT naming the variable, never a silent default.
TEST(ThreadPoolTest, EnvCountsAreValidated) {
  {
    testing::ScopedEnv e("HMOE_THREADS", "1");
    ThreadPoolOptions o;
    ASSERT_TRUE(ThreadCountsFromEnv(&o.max_threads, &o.virtual_nodes).ok());
    auto pool = ThreadPool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->num_threads(), 1);
  }
  for (const char* name : {"HMOE_THREADS", "HMOE_VIRTUAL_NUMA"}) {
    for (const char* bad : {"abc", "-1", "2x", "99999999999"}) {
      testing::ScopedEnv e(name, bad);
      ThreadPoolOptions o;
      const absl::Status st = ThreadCountsFromEnv(&o.max_threads, &o.virtual_nodes);
      ASSERT_FALSE(st.ok()) << name << "=" << bad;
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find(name), std::string_view::npos) << st;
      EXPECT_NE(st.message().find(bad), std::string_view::npos) << st;
    }
  }
  {
    testing::ScopedEnv e("HMOE_THREADS", "abc");  // an explicit option wins over the env
    ThreadPoolOptions o;
    o.max_threads = 1;
    ASSERT_TRUE(ThreadCountsFromEnv(&o.max_threads, &o.virtual_nodes).ok());
    auto pool = ThreadPool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ((*pool)->num_threads(), 1);
  }
}

// The pool itself reads no environment: a bad HMOE_THREADS is no concern of
// Create (only ThreadCountsFromEnv, at a binary's edge, reads it).
TEST(ThreadPoolTest, CreateReadsNoEnvironment) {
  testing::ScopedEnv threads("HMOE_THREADS", "abc");
  testing::ScopedEnv vnuma("HMOE_VIRTUAL_NUMA", "abc");
  ThreadPoolOptions o;
  o.max_threads = 1;
  auto pool = ThreadPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->num_nodes(), 1);
}

// The CPU reference backend's loops: ranges of at least the grain cover
// every index once; a call from inside a range runs inline.
TEST(ThreadPoolTest, CoversEveryIndexOnceAndNestsInline) {
  auto pool = ThreadPool::Create(UnpinnedThreads(4)).value();
  for (int64_t n : {1, 7, 100, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool->ParallelFor(n, 3, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        hits[static_cast<size_t>(i)]++;
        pool->ParallelFor(2, 1, [](int64_t, int64_t) {});  // nested: runs inline
      }
    });
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
}

// Without per_core: exactly the count asked for, past the cores too, tied to
// no core and no memory node; a count below 1 or virtual nodes is refused.
TEST(ThreadPoolTest, UnpinnedPoolHasExactlyItsCount) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  auto pool = ThreadPool::Create(UnpinnedThreads(cores + 3));
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->num_threads(), cores + 3);
  ASSERT_EQ((*pool)->num_nodes(), 1);
  EXPECT_EQ((*pool)->mem_node(0), -1);
  for (int cpu : (*pool)->nodes()[0].cpus) EXPECT_EQ(cpu, -1);
  std::atomic<int> ran{0};
  (*pool)->Run([&](const Worker&) { ran++; });
  EXPECT_EQ(ran.load(), cores + 3);
  for (int bad : {0, -1}) {
    auto p = ThreadPool::Create(UnpinnedThreads(bad));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  ThreadPoolOptions split = UnpinnedThreads(2);
  split.virtual_nodes = 2;
  EXPECT_EQ(ThreadPool::Create(split).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NumaBufferTest, AllocatesAndFrees) {
  for (int node : {0, -1}) {
    auto b = NumaBuffer::Allocate(1 << 20, node);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
    EXPECT_GE(b->size(), size_t{1} << 20);
    EXPECT_EQ(b->node(), node);
    b->data()[0] = 1;
    b->data()[(1 << 20) - 1] = 2;
    uint8_t* const p = b->data();
    NumaBuffer moved = std::move(*b);
    EXPECT_EQ(moved.data(), p);
    EXPECT_EQ(moved.data()[0], 1);
    EXPECT_EQ(moved.data()[(1 << 20) - 1], 2);
    EXPECT_EQ(b->data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(b->size(), 0u);
  }
}

// Bound memory: the kernel's policy for the pages is MPOL_BIND to the node
// (pages never spill to another node); a node the machine lacks is refused.
TEST(NumaBufferTest, BindsToTheNodeOrRefuses) {
  if (!NumaAvailable())
    GTEST_SKIP() << "libnuma reports NUMA unavailable here (buffers are unbound)";
  auto b = NumaBuffer::Allocate(1 << 20, 0);
  ASSERT_TRUE(b.ok()) << b.status();
  b->data()[4096] = 1;
  int mode = -1;
  unsigned long mask[16] = {};
  ASSERT_EQ(
      get_mempolicy(&mode, mask, 16 * 8 * sizeof(unsigned long), b->data() + 4096, MPOL_F_ADDR), 0)
      << std::strerror(errno);
  EXPECT_EQ(mode, MPOL_BIND);
  EXPECT_EQ(mask[0] & 1, 1u);
  int node = -1;
  ASSERT_EQ(get_mempolicy(&node, nullptr, 0, b->data() + 4096, MPOL_F_NODE | MPOL_F_ADDR), 0);
  EXPECT_EQ(node, 0);

  auto missing = NumaBuffer::Allocate(1 << 20, NumaNodeCount());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument) << missing.status();
  EXPECT_NE(missing.status().message().find("does not exist"), std::string_view::npos);
}

TEST(MemoryLimitsTest, CgroupLimitIsTheSmallestOnThePath) {
  testing::TempDir dir;
  const std::string root = dir.path();
  std::filesystem::create_directories(root + "/a/b/c");
  auto write = [&](const std::string& rel, const std::string& text) {
    std::ofstream(root + rel) << text;
  };
  write("/a/memory.max", "4096000\n");
  write("/a/b/memory.max", "max\n");
  write("/a/b/c/memory.max", "8192000\n");
  std::string file;
  EXPECT_EQ(CgroupMemoryMax("0::/a/b/c\n", root, &file), 4096000);
  EXPECT_EQ(file, root + "/a/memory.max");
  EXPECT_EQ(CgroupMemoryMax("0::/a/b/c/\n", root, nullptr), 4096000);
  EXPECT_EQ(CgroupMemoryMax("12:memory:/a\n0::/a/b\n", root, nullptr), 4096000);
  // Not in a v2 group, no limit on the path, a path outside the mount.
  EXPECT_EQ(CgroupMemoryMax("4:memory:/a/b/c\n", root, nullptr), 0);
  EXPECT_EQ(CgroupMemoryMax("0::/a/b\n", root + "/a/b", nullptr), 0);
  EXPECT_EQ(CgroupMemoryMax("0::/x/y\n", root, nullptr), 0);
  // cgroup v1: memory/<path>/memory.limit_in_bytes; "no limit" is a huge number.
  std::filesystem::create_directories(root + "/memory/p/q");
  write("/memory/p/memory.limit_in_bytes", "2048000\n");
  write("/memory/p/q/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryMax("4:memory:/p/q\n3:cpuset:/\n0::/\n", root, &file), 2048000);
  EXPECT_EQ(file, root + "/memory/p/memory.limit_in_bytes");
  EXPECT_EQ(CgroupMemoryMax("4:cpu,memory:/p/q\n", root, nullptr), 2048000);
  EXPECT_EQ(CgroupMemoryMax("4:memory:/p/q\n0::/a/b/c\n", root, nullptr), 2048000);
  EXPECT_EQ(CgroupMemoryMax("4:cpu:/p/q\n", root, nullptr), 0);
  // A container's namespace root shows its own limit at the mount's top.
  write("/memory.max", "1000000\n");
  file.clear();
  EXPECT_EQ(CgroupMemoryMax("0::/\n", root, &file), 1000000);
  EXPECT_EQ(file, root + "/memory.max");
}

TEST(MemoryLimitsTest, CheckMemoryFitsNamesTheLimit) {
  MemoryLimits m;
  m.node_bytes = {int64_t{8} << 30, int64_t{4} << 30};
  m.machine_bytes = int64_t{12} << 30;
  EXPECT_TRUE(CheckMemoryFits({{0, int64_t{8} << 30}, {1, int64_t{4} << 30}}, m, "w").ok());
  absl::Status st = CheckMemoryFits({{0, int64_t{1} << 30}, {1, int64_t{5} << 30}}, m, "weights");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "weights need 5.0 GiB on NUMA node 1, which has 4.0 GiB of memory");
  // Unbound memory counts against the machine only.
  st = CheckMemoryFits({{-1, int64_t{13} << 30}}, m, "weights");
  EXPECT_EQ(st.message(), "weights need 13.0 GiB; the machine has 12.0 GiB of memory");
  m.cgroup_bytes = int64_t{2} << 30;
  m.cgroup_file = "/sys/fs/cgroup/x/memory.max";
  st = CheckMemoryFits({{0, int64_t{3} << 30}}, m, "weights");
  EXPECT_EQ(st.message(),
            "weights need 3.0 GiB; the process's cgroup allows 2.0 GiB "
            "(/sys/fs/cgroup/x/memory.max)");
  // This machine: sizes read, and a need past them refused.
  const MemoryLimits here = ReadMemoryLimits();
  EXPECT_GT(here.machine_bytes, 0);
  for (int64_t n : here.node_bytes) EXPECT_LE(n, here.machine_bytes);
  EXPECT_EQ(CheckMemoryFits({{-1, here.machine_bytes + 1}}, here, "x").code(),
            absl::StatusCode::kResourceExhausted);
}

// What is available now (MemAvailable) is checked apart from the capacity:
// a need that fits the machine but not what other processes left is a
// warning, not a refusal (page cache may yet be reclaimed).
TEST(MemoryLimitsTest, AvailableMemoryWarns) {
  EXPECT_EQ(ParseMemAvailable("MemTotal:       24578048 kB\nMemFree:          812304 kB\n"
                              "MemAvailable:    6291456 kB\nBuffers:  1 kB\n"),
            int64_t{6} << 30);
  EXPECT_EQ(ParseMemAvailable("MemTotal: 1 kB\n"), 0);            // a kernel before 3.14
  EXPECT_EQ(ParseMemAvailable("MemAvailable: lots kB\n"), 0);     // malformed
  EXPECT_EQ(ParseMemAvailable("MemAvailable: 1024 pages\n"), 0);  // not in kB
  MemoryLimits m;
  m.machine_bytes = int64_t{16} << 30;
  m.available_bytes = int64_t{6} << 30;
  const std::map<int, int64_t> need = {{0, int64_t{5} << 30}, {-1, int64_t{2} << 30}};
  EXPECT_TRUE(CheckMemoryFits(need, m, "weights").ok());
  EXPECT_EQ(MemoryAvailableWarning(need, m, "weights"),
            "warning: weights need 7.0 GiB; only 6.0 GiB of memory is available now "
            "(MemAvailable: other processes hold the rest): the load may be killed for memory "
            "part-way");
  EXPECT_EQ(MemoryAvailableWarning({{0, int64_t{6} << 30}}, m, "weights"), "");
  m.available_bytes = 0;  // unknown: nothing to say
  EXPECT_EQ(MemoryAvailableWarning(need, m, "weights"), "");
  // This machine: read, and no more than it has.
  const MemoryLimits here = ReadMemoryLimits();
  EXPECT_GT(here.available_bytes, 0);
  EXPECT_LE(here.available_bytes, here.machine_bytes);
}

// Virtual nodes: contiguous runs of the same cores, every core once, sizes
// differing by at most one; each virtual node's memory is a real node.
TEST(TopologyTest, VirtualNodesSplitTheCoresContiguously) {
  auto one = DiscoverTopology({});
  ASSERT_TRUE(one.ok()) << one.status();
  std::vector<int> all;
  for (const NodeCores& n : *one) all.insert(all.end(), n.cpus.begin(), n.cpus.end());
  ASSERT_FALSE(all.empty());
  const int reals = NumaNodeCount();
  EXPECT_GE(reals, 1);
  for (const NodeCores& n : *one) EXPECT_LT(n.mem_node, reals);
  const int cores = static_cast<int>(all.size());
  for (int v = 1; v <= std::min(cores, 4); ++v) {
    TopologyOptions o;
    o.virtual_nodes = v;
    auto t = DiscoverTopology(o);
    ASSERT_TRUE(t.ok()) << "virtual_nodes=" << v << ": " << t.status();
    ASSERT_EQ(static_cast<int>(t->size()), v);
    std::vector<int> cat;
    size_t lo = all.size(), hi = 0;
    for (const NodeCores& n : *t) {
      cat.insert(cat.end(), n.cpus.begin(), n.cpus.end());
      lo = std::min(lo, n.cpus.size());
      hi = std::max(hi, n.cpus.size());
      EXPECT_GE(n.mem_node, 0);
      EXPECT_LT(n.mem_node, reals);
    }
    std::vector<int> sorted_all = all, sorted_cat = cat;
    std::sort(sorted_all.begin(), sorted_all.end());
    std::sort(sorted_cat.begin(), sorted_cat.end());
    EXPECT_EQ(sorted_cat, sorted_all) << "virtual_nodes=" << v << ": not every core once";
    if (one->size() == 1) {
      EXPECT_EQ(cat, all) << "virtual_nodes=" << v << ": runs not in core order";
    }
    EXPECT_LE(hi - lo, 1u) << "virtual_nodes=" << v;
  }
  TopologyOptions limited;
  limited.max_threads = 1;
  auto t1 = DiscoverTopology(limited);
  ASSERT_TRUE(t1.ok());
  int n1 = 0;
  for (const NodeCores& n : *t1) n1 += static_cast<int>(n.cpus.size());
  EXPECT_EQ(n1, 1);
}

// A CPU node without memory this process may bind (CPU-only node, or outside
// cpuset.mems) takes the nearest bindable node's memory; MPOL_BIND to it
// would fail every allocation.
TEST(TopologyTest, MemoryNodeIsTheNearestBindableOne) {
  // Four nodes, two sockets: 0-1 close (12), 0/1 to 2/3 far (32).
  const int slit[4][4] = {{10, 12, 32, 32}, {12, 10, 32, 32}, {32, 32, 10, 12}, {32, 32, 12, 10}};
  auto d = [&](int a, int b) { return slit[a][b]; };
  EXPECT_EQ(MemoryNodeFor(1, {0, 1, 2, 3}, d), 1);
  EXPECT_EQ(MemoryNodeFor(1, {0, 2, 3}, d), 0);  // its socket's neighbour
  EXPECT_EQ(MemoryNodeFor(1, {2, 3}, d), 2);     // tie at 32: the lower id
  EXPECT_EQ(MemoryNodeFor(3, {0, 1, 2}, d), 2);
  EXPECT_EQ(MemoryNodeFor(2, {}, d), 2);  // nothing to offer
  // A distance the kernel cannot tell (0) ranks after every known one.
  auto unknown_to_0 = [&](int a, int b) { return b == 0 ? 0 : slit[a][b]; };
  EXPECT_EQ(MemoryNodeFor(1, {0, 3}, unknown_to_0), 3);
  EXPECT_EQ(MemoryNodeFor(1, {0}, unknown_to_0), 0);

  std::vector<NodeCores> nodes(3);
  nodes[0] = {{0, 1}, 0, 0};
  nodes[1] = {{2, 3}, 0, 1};  // node 1's cores on node 0's memory
  nodes[2] = {{4, 5}, 0, 1};  // a second virtual node of real node 1
  EXPECT_EQ(DescribeMemoryRemap(nodes),
            "; memory of node 0 for the cores of node 1 (1 has none this process may bind)");
  nodes[1].mem_node = nodes[2].mem_node = 1;
  EXPECT_EQ(DescribeMemoryRemap(nodes), "");

  // This machine: every topology node's memory is bindable, and binding to
  // it works.
  const std::vector<int> bindable = BindableMemoryNodes();
  for (int n : bindable) {
    EXPECT_GE(n, 0);
    EXPECT_LT(n, NumaNodeCount());
  }
  for (int v : {0, 2}) {
    TopologyOptions o;
    o.virtual_nodes = v;
    auto t = DiscoverTopology(o);
    if (!t.ok()) continue;  // a single core cannot make 2 virtual nodes
    for (const NodeCores& n : *t) {
      if (!bindable.empty()) {
        EXPECT_NE(std::find(bindable.begin(), bindable.end(), n.mem_node), bindable.end())
            << "node " << n.mem_node << " (cores of node " << n.cpu_node << ") not bindable";
      }
      auto buf = NumaBuffer::Allocate(1 << 20, n.mem_node);
      ASSERT_TRUE(buf.ok()) << buf.status();
      buf->data()[0] = 1;  // first touch: the page comes from the bound node
    }
  }
}

}  // namespace
}  // namespace hmoe
