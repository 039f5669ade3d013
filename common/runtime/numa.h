// CPU topology (cores grouped by NUMA node, optionally split into virtual
// nodes) and node-local memory.
#pragma once

#include <sched.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hmoe {

struct TopologyOptions {
  int max_threads = 0;    // 0: one per core the process may run on
  int virtual_nodes = 0;  // >0: split the chosen cores into this many nodes (ignores real nodes)
};

// One entry per (possibly virtual) node: the logical CPUs its workers pin to
// (one per physical core), the real NUMA node they sit on, and the real node
// whose memory it uses: cpu_node itself, or the nearest node this process
// may bind memory to when cpu_node has no memory or is outside its
// cpuset.mems (MemoryNodeFor).
struct NodeCores {
  std::vector<int> cpus;
  int mem_node = 0;
  int cpu_node = 0;
};

// Cores come from hwloc (first allowed PU of each core), falling back to the
// process affinity mask. Virtual nodes take contiguous runs of cores.
absl::StatusOr<std::vector<NodeCores>> DiscoverTopology(const TopologyOptions& opts);

// The memory node for CPUs on `cpu_node`, given the nodes memory may be bound
// to here (`mem_nodes`: allowed by cpuset.mems and holding memory) and the
// SLIT distance between two nodes: cpu_node when listed, else the listed
// node nearest to it (ties: the lowest id). cpu_node when the list is empty
// (nothing better to offer; NumaBuffer then reports the kernel's refusal).
int MemoryNodeFor(int cpu_node, const std::vector<int>& mem_nodes,
                  const std::function<int(int, int)>& distance);

// The nodes this process may bind memory to: in its cpuset.mems and with
// memory (a CPU-only node, e.g. some VMs' and CXL layouts, has none). Empty
// without libnuma.
std::vector<int> BindableMemoryNodes();

// "" when every node uses its own CPUs' memory; else, for the ready line,
// "; memory of node M for the cores of node C (C has none this process may
// bind)", one clause per real CPU node remapped.
std::string DescribeMemoryRemap(const std::vector<NodeCores>& nodes);

// A CPU list such as "0-13,15" (single CPUs and ranges, comma-separated) as
// a set; INVALID_ARGUMENT naming the bad part.
absl::Status ParseCpuList(absl::string_view list, cpu_set_t* out);

// Number of real NUMA nodes (1 when libnuma is unavailable).
int NumaNodeCount();
// Whether libnuma works here (NumaBuffer binds memory only then).
bool NumaAvailable();

// Memory bound to one NUMA node (anonymous mmap + mbind(MPOL_BIND):
// page-aligned, zeroed by the kernel on first touch, its pages only ever on
// that node), or plain aligned memory when libnuma is unavailable (e.g. a
// container whose seccomp profile refuses the NUMA system calls). Move-only.
class NumaBuffer {
 public:
  NumaBuffer() = default;
  // node < 0, or libnuma unavailable: no binding. INVALID_ARGUMENT for a node
  // the machine does not have; FAILED_PRECONDITION naming the node and errno
  // when the kernel refuses the binding (never silently unbound);
  // RESOURCE_EXHAUSTED when the mapping fails.
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
  bool mapped_ = false;  // munmap (bound) or free
};

// What memory a process may fill: each NUMA node's size, the machine's, and
// the cgroup memory limit that applies to the process (CgroupMemoryMax).
struct MemoryLimits {
  // By node id; empty without libnuma, or when the nodes' sizes do not add
  // up to (90% of) the machine's (some VMs and sandboxes report so).
  std::vector<int64_t> node_bytes;
  int64_t machine_bytes = 0;
  int64_t cgroup_bytes = 0;  // 0: no limit
  std::string cgroup_file;   // the file that set cgroup_bytes
  // MemAvailable of /proc/meminfo when read: what can be filled now without
  // swapping or killing (other processes hold the rest); 0: unknown.
  int64_t available_bytes = 0;
};
MemoryLimits ReadMemoryLimits();

// The smallest cgroup memory limit on the process's path up to the root:
// `proc_self_cgroup` is the text of /proc/self/cgroup, `root` the cgroup
// mount (/sys/fs/cgroup): v2's memory.max (also under root/unified, the
// hybrid layout) and v1's memory/.../memory.limit_in_bytes. 0 (and `file`
// untouched) when none is set.
int64_t CgroupMemoryMax(absl::string_view proc_self_cgroup, const std::string& root,
                        std::string* file);

// MemAvailable of /proc/meminfo text, in bytes; 0 when absent or malformed.
int64_t ParseMemAvailable(absl::string_view meminfo);

// "12.3 GiB", or "45.6 MiB" below 1 GiB.
std::string HumanBytes(int64_t bytes);

// OK when `need` (bytes per NUMA node; node -1: unbound) fits: each bound
// node's bytes within that node's size, the total within the machine and
// the cgroup limit. Otherwise RESOURCE_EXHAUSTED naming the limit, the need
// and `what` (e.g. "this shard's packed weights"), sizes in GiB (MiB below
// 1 GiB).
absl::Status CheckMemoryFits(const std::map<int, int64_t>& need, const MemoryLimits& limits,
                             absl::string_view what);

// For a need that CheckMemoryFits accepts: "" when its total also fits in
// what is available now (limits.available_bytes, or unknown), else a
// warning that names both (the load may be killed for memory part-way,
// since other processes hold the rest).
std::string MemoryAvailableWarning(const std::map<int, int64_t>& need, const MemoryLimits& limits,
                                   absl::string_view what);

}  // namespace hmoe
