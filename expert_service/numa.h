// CPU topology (cores grouped by NUMA node, optionally split into virtual
// nodes) and node-local memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe {

struct TopologyOptions {
  int max_threads = 0;    // 0: one per core the process may run on
  int virtual_nodes = 0;  // >0: split the chosen cores into this many nodes (ignores real nodes)
};

// One entry per (possibly virtual) node: the logical CPUs its workers pin to
// (one per physical core) and the real NUMA node whose memory it uses.
struct NodeCores {
  std::vector<int> cpus;
  int mem_node = 0;
};

// Cores come from hwloc (first allowed PU of each core), falling back to the
// process affinity mask. Virtual nodes take contiguous runs of cores.
absl::StatusOr<std::vector<NodeCores>> DiscoverTopology(const TopologyOptions& opts);

// Number of real NUMA nodes (1 when libnuma is unavailable).
int NumaNodeCount();

// Memory bound to one NUMA node (numa_alloc_onnode; page-aligned, zeroed by
// the kernel on first touch), or plain aligned memory when libnuma is absent.
// Move-only.
class NumaBuffer {
 public:
  NumaBuffer() = default;
  // node < 0: no binding.
  static absl::StatusOr<NumaBuffer> Allocate(size_t bytes, int node);
  ~NumaBuffer();
  NumaBuffer(NumaBuffer&& o) noexcept { *this = std::move(o); }
  NumaBuffer& operator=(NumaBuffer&& o) noexcept;
  NumaBuffer(const NumaBuffer&) = delete;
  NumaBuffer& operator=(const NumaBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int node() const { return node_; }

 private:
  void Release();
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int node_ = -1;
  bool numa_ = false;
};

}  // namespace hmoe
