#include "expert_service/numa.h"

#include <hwloc.h>
#include <numa.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hmoe {
namespace {

bool NumaOk() {
  static const bool ok = numa_available() >= 0;
  return ok;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// One logical CPU per physical core, in core order.
std::vector<int> CoreCpus() {
  std::vector<int> allowed = AllowedCpus();
  std::vector<int> out;
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) == 0) {
    if (hwloc_topology_load(topo) == 0) {
      const int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
      for (int i = 0; i < ncores; ++i) {
        hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, static_cast<unsigned>(i));
        if (core == nullptr || core->cpuset == nullptr) continue;
        for (int pu = hwloc_bitmap_first(core->cpuset); pu >= 0;
             pu = hwloc_bitmap_next(core->cpuset, pu)) {
          if (std::find(allowed.begin(), allowed.end(), pu) != allowed.end()) {
            out.push_back(pu);
            break;
          }
        }
      }
    }
    hwloc_topology_destroy(topo);
  }
  if (out.empty()) out = allowed;
  if (out.empty()) out.push_back(0);
  return out;
}

int NodeOfCpu(int cpu) {
  if (!NumaOk()) return 0;
  const int n = numa_node_of_cpu(cpu);
  return n < 0 ? 0 : n;
}

}  // namespace

int NumaNodeCount() { return NumaOk() ? std::max(1, numa_max_node() + 1) : 1; }

absl::StatusOr<std::vector<NodeCores>> DiscoverTopology(const TopologyOptions& opts) {
  if (opts.max_threads < 0 || opts.virtual_nodes < 0)
    return absl::InvalidArgumentError("max_threads and virtual_nodes must be >= 0");
  std::vector<int> cpus = CoreCpus();
  if (opts.max_threads > 0 && static_cast<size_t>(opts.max_threads) < cpus.size())
    cpus.resize(static_cast<size_t>(opts.max_threads));
  std::vector<NodeCores> nodes;
  if (opts.virtual_nodes > 0) {
    const int v = opts.virtual_nodes;
    if (static_cast<size_t>(v) > cpus.size())
      return absl::InvalidArgumentError(
          absl::StrCat("virtual_nodes ", v, " exceeds the ", cpus.size(), " cores available"));
    nodes.resize(static_cast<size_t>(v));
    const size_t n = cpus.size();
    for (int i = 0; i < v; ++i) {
      const size_t b = n * static_cast<size_t>(i) / static_cast<size_t>(v);
      const size_t e = n * static_cast<size_t>(i + 1) / static_cast<size_t>(v);
      nodes[static_cast<size_t>(i)].cpus.assign(cpus.begin() + static_cast<long>(b),
                                                cpus.begin() + static_cast<long>(e));
      nodes[static_cast<size_t>(i)].mem_node = NodeOfCpu(cpus[b]);
    }
    return nodes;
  }
  std::vector<int> node_ids;
  for (int c : cpus) {
    const int n = NodeOfCpu(c);
    auto it = std::find(node_ids.begin(), node_ids.end(), n);
    size_t idx = static_cast<size_t>(it - node_ids.begin());
    if (it == node_ids.end()) {
      node_ids.push_back(n);
      nodes.push_back(NodeCores{{}, n});
    }
    nodes[idx].cpus.push_back(c);
  }
  return nodes;
}

absl::StatusOr<NumaBuffer> NumaBuffer::Allocate(size_t bytes, int node) {
  NumaBuffer b;
  if (bytes == 0) return b;
  const size_t rounded = (bytes + 4095) & ~size_t{4095};
  if (node >= 0 && NumaOk() && node < NumaNodeCount()) {
    void* p = numa_alloc_onnode(rounded, node);
    if (p == nullptr)
      return absl::ResourceExhaustedError(
          absl::StrCat("numa_alloc_onnode(", rounded, " bytes, node ", node, ") failed"));
    b.data_ = static_cast<uint8_t*>(p);
    b.numa_ = true;
  } else {
    // Large buffers on 2 MiB boundaries so transparent huge pages can back them.
    const size_t align = rounded >= (size_t{4} << 20) ? size_t{2} << 20 : size_t{4096};
    const size_t total = (rounded + align - 1) & ~(align - 1);
    void* p = std::aligned_alloc(align, total);
    if (p == nullptr)
      return absl::ResourceExhaustedError(absl::StrCat("aligned_alloc(", total, ") failed"));
    b.data_ = static_cast<uint8_t*>(p);
  }
  // Weights and activations are streamed: huge pages spare TLB walks (advice
  // only; ignored where THP is off; HMOE_THP=0 skips it, for benchmarks).
  static const bool thp = [] {
    const char* e = std::getenv("HMOE_THP");
    return e == nullptr || *e != '0';
  }();
  if (thp && rounded >= (size_t{4} << 20)) madvise(b.data_, rounded, MADV_HUGEPAGE);
  b.size_ = rounded;
  b.node_ = node;
  return b;
}

NumaBuffer& NumaBuffer::operator=(NumaBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    node_ = std::exchange(o.node_, -1);
    numa_ = std::exchange(o.numa_, false);
  }
  return *this;
}

NumaBuffer::~NumaBuffer() { Release(); }

void NumaBuffer::Release() {
  if (data_ == nullptr) return;
  if (numa_)
    numa_free(data_, size_);
  else
    std::free(data_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace hmoe
