#include "common/runtime/numa.h"

#include <hwloc.h>
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

// cpu_node -> its memory node, for this process (read once per topology).
std::function<int(int)> MemoryNodeMap() {
  const std::vector<int> mem = BindableMemoryNodes();
  return [mem](int cpu_node) {
    return MemoryNodeFor(cpu_node, mem, [](int a, int b) { return numa_distance(a, b); });
  };
}

}  // namespace

absl::Status ParseCpuList(absl::string_view list, cpu_set_t* out) {
  CPU_ZERO(out);
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    std::vector<std::string> r = absl::StrSplit(part, '-');
    int lo = 0, hi = 0;
    if (r.empty() || r.size() > 2 || !absl::SimpleAtoi(r[0], &lo) ||
        !absl::SimpleAtoi(r.back(), &hi) || lo < 0 || hi < lo || hi >= CPU_SETSIZE)
      return absl::InvalidArgumentError(
          absl::StrCat("bad CPU range \"", part, "\" in \"", list, "\" (e.g. 0-13,15)"));
    for (int c = lo; c <= hi; ++c) CPU_SET(c, out);
  }
  return absl::OkStatus();
}

int MemoryNodeFor(int cpu_node, const std::vector<int>& mem_nodes,
                  const std::function<int(int, int)>& distance) {
  if (mem_nodes.empty() ||
      std::find(mem_nodes.begin(), mem_nodes.end(), cpu_node) != mem_nodes.end())
    return cpu_node;
  int best = -1, best_d = std::numeric_limits<int>::max();
  for (int n : mem_nodes) {
    // numa_distance gives 0 when it cannot tell: rank that last.
    int d = distance(cpu_node, n);
    if (d <= 0) d = std::numeric_limits<int>::max() - 1;
    if (d < best_d || (d == best_d && n < best)) {
      best = n;
      best_d = d;
    }
  }
  return best;
}

std::vector<int> BindableMemoryNodes() {
  std::vector<int> out;
  if (!NumaOk()) return out;
  bitmask* allowed = numa_get_mems_allowed();
  for (int n = 0; n <= numa_max_node(); ++n) {
    if (allowed != nullptr && numa_bitmask_isbitset(allowed, static_cast<unsigned>(n)) == 0)
      continue;
    long long free_bytes = 0;
    if (numa_node_size64(n, &free_bytes) > 0) out.push_back(n);
  }
  if (allowed != nullptr) numa_bitmask_free(allowed);
  return out;
}

std::string DescribeMemoryRemap(const std::vector<NodeCores>& nodes) {
  std::string out;
  std::vector<int> told;
  for (const NodeCores& n : nodes) {
    if (n.mem_node == n.cpu_node || std::find(told.begin(), told.end(), n.cpu_node) != told.end())
      continue;
    told.push_back(n.cpu_node);
    absl::StrAppend(&out, "; memory of node ", n.mem_node, " for the cores of node ", n.cpu_node,
                    " (", n.cpu_node, " has none this process may bind)");
  }
  return out;
}

bool NumaAvailable() { return NumaOk(); }

int NumaNodeCount() { return NumaOk() ? std::max(1, numa_max_node() + 1) : 1; }

absl::StatusOr<std::vector<NodeCores>> DiscoverTopology(const TopologyOptions& opts) {
  if (opts.max_threads < 0 || opts.virtual_nodes < 0)
    return absl::InvalidArgumentError("max_threads and virtual_nodes must be >= 0");
  std::vector<int> cpus = CoreCpus();
  if (opts.max_threads > 0 && static_cast<size_t>(opts.max_threads) < cpus.size())
    cpus.resize(static_cast<size_t>(opts.max_threads));
  std::vector<NodeCores> nodes;
  const std::function<int(int)> mem_node_of = MemoryNodeMap();
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
      nodes[static_cast<size_t>(i)].cpu_node = NodeOfCpu(cpus[b]);
      nodes[static_cast<size_t>(i)].mem_node = mem_node_of(NodeOfCpu(cpus[b]));
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
      nodes.push_back(NodeCores{{}, mem_node_of(n), n});
    }
    nodes[idx].cpus.push_back(c);
  }
  return nodes;
}

absl::StatusOr<NumaBuffer> NumaBuffer::Allocate(size_t bytes, int node) {
  NumaBuffer b;
  if (bytes == 0) return b;
  const size_t rounded = (bytes + 4095) & ~size_t{4095};
  if (node >= 0 && NumaOk()) {
    if (node >= NumaNodeCount())
      return absl::InvalidArgumentError(
          absl::StrCat("NUMA node ", node, " does not exist (", NumaNodeCount(), " nodes)"));
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return absl::ResourceExhaustedError(absl::StrCat("mmap(", rounded, " bytes for NUMA node ",
                                                       node, "): ", std::strerror(errno)));
    // Before any page is touched: every page comes from `node` or the
    // allocation fails (MPOL_BIND), never silently from another node.
    std::vector<unsigned long> mask(static_cast<size_t>(node) / (8 * sizeof(unsigned long)) + 1);
    mask[static_cast<size_t>(node) / (8 * sizeof(unsigned long))] =
        1ul << (static_cast<unsigned>(node) % (8 * sizeof(unsigned long)));
    if (mbind(p, rounded, MPOL_BIND, mask.data(), mask.size() * 8 * sizeof(unsigned long) + 1, 0) !=
        0) {
      const int err = errno;
      munmap(p, rounded);
      return absl::FailedPreconditionError(
          absl::StrCat("mbind(", rounded, " bytes to NUMA node ", node, "): ", std::strerror(err)));
    }
    b.data_ = static_cast<uint8_t*>(p);
    b.mapped_ = true;
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
  // only; ignored where THP is off).
  if (rounded >= (size_t{4} << 20)) madvise(b.data_, rounded, MADV_HUGEPAGE);
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
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

NumaBuffer::~NumaBuffer() { Release(); }

void NumaBuffer::Release() {
  if (data_ == nullptr) return;
  if (mapped_)
    munmap(data_, size_);
  else
    std::free(data_);
  data_ = nullptr;
  size_ = 0;
}

namespace {

std::string ReadSmallFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return {};
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < (int64_t{1} << 30)) return absl::StrFormat("%.1f MiB", b / (1024.0 * 1024));
  return absl::StrFormat("%.1f GiB", b / (1024.0 * 1024 * 1024));
}

int64_t CgroupMemoryMax(absl::string_view proc_self_cgroup, const std::string& root,
                        std::string* file) {
  int64_t best = 0;
  // The smallest limit in `name` files of the group at `path` under `mount`
  // and its ancestors. A host's root group has no limit file; a container's
  // namespace root ("/") shows the container's own at the mount's top.
  auto walk = [&](const std::string& mount, std::string path, const char* name) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    for (;;) {
      const std::string f = mount + (path == "/" ? "" : path) + "/" + name;
      const std::string text(absl::StripAsciiWhitespace(ReadSmallFile(f)));
      int64_t v = 0;
      // v1 writes "no limit" as a huge page-rounded number; v2 as "max".
      if (absl::SimpleAtoi(text, &v) && v > 0 && v < (int64_t{1} << 62) &&
          (best == 0 || v < best)) {
        best = v;
        if (file != nullptr) *file = f;
      }
      if (path == "/") break;
      const size_t slash = path.rfind('/');
      path.resize(slash == 0 ? 1 : slash);
    }
  };
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n')) {
    line = absl::StripTrailingAsciiWhitespace(line);
    // "hierarchy-id:controllers:path"; v2 is "0::path".
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3 || f[2].empty() || f[2][0] != '/') continue;
    if (f[0] == "0" && f[1].empty()) {
      walk(root, std::string(f[2]), "memory.max");
      walk(root + "/unified", std::string(f[2]), "memory.max");  // hybrid layout
    } else {
      for (absl::string_view c : absl::StrSplit(f[1], ','))
        if (c == "memory") walk(root + "/memory", std::string(f[2]), "memory.limit_in_bytes");
    }
  }
  return best;
}

MemoryLimits ReadMemoryLimits() {
  MemoryLimits m;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) m.machine_bytes = int64_t{pages} * page;
  if (NumaOk()) {
    int64_t sum = 0;
    for (int n = 0; n < NumaNodeCount(); ++n) {
      const long long sz = numa_node_size64(n, nullptr);
      m.node_bytes.push_back(sz > 0 ? sz : 0);
      sum += m.node_bytes.back();
    }
    // Some virtual machines and sandboxes report nodes that do not add up to
    // their memory: per-node sizes are only trusted when they do.
    if (sum < m.machine_bytes / 10 * 9) m.node_bytes.clear();
  }
  m.cgroup_bytes =
      CgroupMemoryMax(ReadSmallFile("/proc/self/cgroup"), "/sys/fs/cgroup", &m.cgroup_file);
  m.available_bytes = ParseMemAvailable(ReadSmallFile("/proc/meminfo"));
  return m;
}

int64_t ParseMemAvailable(absl::string_view meminfo) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, "MemAvailable:")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) return 0;
    int64_t kib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) || kib < 0 ||
        kib > std::numeric_limits<int64_t>::max() / 1024)
      return 0;
    return kib * 1024;
  }
  return 0;
}

std::string MemoryAvailableWarning(const std::map<int, int64_t>& need, const MemoryLimits& limits,
                                   absl::string_view what) {
  int64_t total = 0;
  for (const auto& [node, bytes] : need) total += bytes;
  if (limits.available_bytes <= 0 || total <= limits.available_bytes) return "";
  return absl::StrCat("warning: ", what, " need ", HumanBytes(total), "; only ",
                      HumanBytes(limits.available_bytes),
                      " of memory is available now (MemAvailable: other processes hold the "
                      "rest): the load may be killed for memory part-way");
}

absl::Status CheckMemoryFits(const std::map<int, int64_t>& need, const MemoryLimits& limits,
                             absl::string_view what) {
  int64_t total = 0;
  for (const auto& [node, bytes] : need) {
    total += bytes;
    if (node >= 0 && static_cast<size_t>(node) < limits.node_bytes.size() &&
        limits.node_bytes[static_cast<size_t>(node)] > 0 &&
        bytes > limits.node_bytes[static_cast<size_t>(node)])
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " need ", HumanBytes(bytes), " on NUMA node ", node, ", which has ",
                       HumanBytes(limits.node_bytes[static_cast<size_t>(node)]), " of memory"));
  }
  if (limits.machine_bytes > 0 && total > limits.machine_bytes)
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " need ", HumanBytes(total), "; the machine has ",
                     HumanBytes(limits.machine_bytes), " of memory"));
  if (limits.cgroup_bytes > 0 && total > limits.cgroup_bytes)
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " need ", HumanBytes(total), "; the process's cgroup allows ",
                     HumanBytes(limits.cgroup_bytes), " (", limits.cgroup_file, ")"));
  return absl::OkStatus();
}

}  // namespace hmoe
