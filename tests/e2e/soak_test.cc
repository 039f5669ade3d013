// Soak: mixed load on the serving pair (ds3_fortunes, shm) while the expert
// service is killed and restarted. Client threads send streamed text prompts,
// token-id prompts, long prompts (64-400 tokens), requests they cancel after
// a few chunks, requests with short deadlines and bad requests; a restarter
// kills the expert service (SIGKILL and SIGTERM in turn) and starts it again
// on its port. Checked: every request ends, within its deadline, with a code
// its kind allows; after warm-up the worker's RSS (and, on the cuda backend,
// its GPU memory as nvidia-smi reports it) stays within 5% of its warm-up
// level and its open descriptors and shared-memory segments do not grow; at
// rest no request runs or waits and no KV block or shm slot is in use; the
// pair serves again at the end. One summary line for the note.
//
// Options (environment; a malformed value fails the test naming it):
//   HMOE_SOAK_SECONDS          length (default 120; the test command runs
//                              that, 45 under ASan; bench/gpu_suite.sh 600)
//   HMOE_SOAK_RESTART_SECONDS  between expert-service restarts (default 20;
//                              0: none)
//   HMOE_SOAK_CLIENTS          client threads (default 6)
//   HMOE_SOAK_BACKEND          the worker's --backend: auto (default), cpu or
//                              cuda (skips where the worker cannot run it)
//   HMOE_SOAK_SAMPLES          a CSV file to write, one row per sample: the
//                              worker's RSS, descriptors, shm segments, KV
//                              blocks, requests running and waiting, shm
//                              slots in use, GPU memory (/metrics and
//                              nvidia-smi), requests ended and restarts so far
//   HMOE_SOAK_SAMPLE_SECONDS   between CSV rows (default 10)
//   HMOE_SOAK_GPU_QUIET_FILE   the GPU is the soak's alone once this file
//                              exists (bench/gpu_suite.sh creates it when the
//                              suite beside the soak ends); unset: all along.
//                              The device's memory in use (the worker's
//                              /metrics) stays within 5% of its first quiet
//                              sample after warm-up
#include <dirent.h>
#include <fcntl.h>
#include <httplib.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/shm_layout.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_pair.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

// An integer option from the environment: `fallback` when unset;
// INVALID_ARGUMENT naming the variable when not an integer >= `min`.
absl::StatusOr<int64_t> EnvInt(const char* name, int64_t fallback, int64_t min) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < min)
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\": want an integer >= ", min));
  return n;
}

struct SoakOptions {
  int64_t seconds = 120;
  int64_t restart_every = 20;  // 0: no restarts
  int64_t clients = 6;
  std::string backend = "auto";
  std::string samples;  // CSV path; empty: none written
  int64_t sample_every = 10;
  std::string gpu_quiet_file;  // empty: the GPU is the soak's alone all along
};

absl::StatusOr<SoakOptions> SoakOptionsFromEnv() {
  SoakOptions o;
  ASSIGN_OR_RETURN(o.seconds, EnvInt("HMOE_SOAK_SECONDS", o.seconds, 1));
  ASSIGN_OR_RETURN(o.restart_every, EnvInt("HMOE_SOAK_RESTART_SECONDS", o.restart_every, 0));
  ASSIGN_OR_RETURN(o.clients, EnvInt("HMOE_SOAK_CLIENTS", o.clients, 1));
  ASSIGN_OR_RETURN(o.sample_every, EnvInt("HMOE_SOAK_SAMPLE_SECONDS", o.sample_every, 1));
  if (const char* b = std::getenv("HMOE_SOAK_BACKEND"); b != nullptr && *b != '\0') {
    o.backend = b;
    if (o.backend != "auto" && o.backend != "cpu" && o.backend != "cuda")
      return absl::InvalidArgumentError(
          absl::StrCat("HMOE_SOAK_BACKEND=\"", o.backend, "\": want auto, cpu or cuda"));
  }
  if (const char* f = std::getenv("HMOE_SOAK_SAMPLES")) o.samples = f;
  if (const char* f = std::getenv("HMOE_SOAK_GPU_QUIET_FILE")) o.gpu_quiet_file = f;
  return o;
}

struct ProcSample {
  int64_t rss_kb = 0, fds = 0, memfds = 0;
  std::multiset<std::string> targets;  // what the descriptors point at
};

ProcSample Sample(int pid) {
  ProcSample s;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::atoll(line.c_str() + 6);
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      ++s.fds;
      char target[256] = {};
      const ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
      const std::string t = n > 0 ? std::string(target, static_cast<size_t>(n)) : "?";
      if (t.rfind("/memfd:", 0) == 0) ++s.memfds;
      // socket:[inode] and friends: the kind only (inodes change).
      s.targets.insert(t.substr(0, t.find('[')));
    }
    closedir(d);
  }
  return s;
}

// The worker's expert-call slots over shm, read from its segments (memfds
// named hmoe-shm, opened through /proc like the service attaches them):
// slots not FREE, and slots in all, over the segments not closed. -1, -1
// when no segment can be read (another transport, or /proc refuses).
struct SlotSample {
  int64_t busy = -1, total = -1;
};

SlotSample SampleSlots(int pid) {
  SlotSample out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string path = dir + "/" + e->d_name;
    char target[256] = {};
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0 ||
        !absl::StartsWith(absl::string_view(target, static_cast<size_t>(n)), "/memfd:hmoe-shm"))
      continue;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st = {};
    if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(ShmHeader))) {
      ::close(fd);
      continue;
    }
    const size_t bytes = static_cast<size_t>(st.st_size);
    void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) continue;
    const auto* h = static_cast<const ShmHeader*>(base);
    SlotGeometry g;
    g.num_slots = h->num_slots;
    g.slots_offset = h->slots_offset;
    g.slot_bytes = h->slot_bytes;
    g.req_capacity = h->req_capacity;
    g.resp_offset = h->resp_offset;
    g.resp_capacity = h->resp_capacity;
    if (h->magic == kShmMagic && h->closed.load() == 0 && CheckSlotGeometry(g, bytes).ok()) {
      if (out.total < 0) out = SlotSample{0, 0};
      for (uint32_t i = 0; i < g.num_slots; ++i) {
        const ShmSlot* slot = shm::SlotAt(static_cast<uint8_t*>(const_cast<void*>(base)), g, i);
        out.busy += slot->state.load() != kSlotFree;
        ++out.total;
      }
    }
    ::munmap(base, bytes);
  }
  closedir(d);
  return out;
}

// GPU memory of process `pid` in MiB as nvidia-smi reports it; -1 without
// nvidia-smi or when `pid` holds no GPU context.
int64_t GpuMemoryMib(int pid) {
  FILE* p = ::popen(
      "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null",
      "r");
  if (p == nullptr) return -1;
  int64_t mib = -1;
  char line[256];
  while (std::fgets(line, sizeof(line), p) != nullptr) {
    std::vector<std::string> f = absl::StrSplit(line, ',');
    int64_t got_pid = 0, used = 0;
    if (f.size() == 2 && absl::SimpleAtoi(absl::StripAsciiWhitespace(f[0]), &got_pid) &&
        got_pid == pid && absl::SimpleAtoi(absl::StripAsciiWhitespace(f[1]), &used))
      mib = std::max<int64_t>(mib, 0) + used;
  }
  ::pclose(p);
  return mib;
}

// A sample's value in Prometheus text (a series without labels); NaN if absent.
double MetricValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, series + " ")) {
      double v = 0;
      if (absl::SimpleAtod(line, &v)) return v;
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// One row of the samples file.
struct Row {
  double t_s = 0;
  std::string phase;  // warm-up, load, end (clients stopped), rest
  ProcSample proc;
  int64_t kv_used = -1, kv_total = -1, running = -1, waiting = -1;
  SlotSample slots;
  double gpu_used_bytes = std::numeric_limits<double>::quiet_NaN();  // /metrics, whole device
  int64_t gpu_proc_mib = -1;                                         // nvidia-smi, the worker
  bool gpu_quiet = false;  // no other process uses the GPU (HMOE_SOAK_GPU_QUIET_FILE)
  int64_t requests = 0, restarts = 0;
};

const char kCsvHeader[] =
    "t_s,phase,rss_kb,fds,shm_segments,kv_blocks_used,kv_blocks_total,requests_running,"
    "requests_waiting,slots_busy,slots_total,gpu_used_bytes,gpu_worker_mib,gpu_quiet,"
    "requests_ended,restarts";

std::string Csv(const Row& r) {
  return absl::StrCat(
      absl::StrFormat("%.1f", r.t_s), ",", r.phase, ",", r.proc.rss_kb, ",", r.proc.fds, ",",
      r.proc.memfds, ",", r.kv_used, ",", r.kv_total, ",", r.running, ",", r.waiting, ",",
      r.slots.busy, ",", r.slots.total, ",",
      std::isnan(r.gpu_used_bytes) ? std::string() : absl::StrFormat("%.0f", r.gpu_used_bytes), ",",
      r.gpu_proc_mib, ",", r.gpu_quiet ? 1 : 0, ",", r.requests, ",", r.restarts);
}

enum Kind { kStream, kIds, kLong, kCancel, kDeadline, kBad, kKinds };
const char* const kKindName[kKinds] = {"stream", "ids", "long", "cancel", "deadline", "bad"};

TEST(Soak, MixedLoadWithExpertServiceRestarts) {
  const absl::StatusOr<SoakOptions> opts = SoakOptionsFromEnv();
  ASSERT_TRUE(opts.ok()) << opts.status();
  const SoakOptions& o = *opts;
  testing::Pair pair;
  pair.set_capture_logs();
  if (!pair.Start(testing::FixturesDir() + "/ds3_fortunes", 1, "tp", "shm",
                  {"--max-batch=8", "--max-queue=64", "--backend=" + o.backend,
                   "--http-listen=127.0.0.1:0", "--http-port-file=" + pair.file("http.port")})) {
    std::ifstream in(pair.log("worker"));
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // Only a backend this machine cannot run skips; any other failure to start fails.
    if (o.backend == "cuda" && absl::StrContains(log, "backend cuda:"))
      GTEST_SKIP() << "the worker cannot run --backend=cuda here: " << log;
    FAIL() << "the pair did not start; the worker's log:\n" << log;
  }
  // The logs go with the pair's folder: their ends for a failure's
  // diagnosis, however the test ends (an ASSERT returns early).
  struct OnExit {
    std::function<void()> f;
    ~OnExit() { f(); }
  } print_logs{[&] {
    if (!HasFailure()) return;
    for (const std::string process : {"worker", "expert0"}) {
      std::ifstream in(pair.log(process));
      const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::printf("[ soak     ] the %s's log, last 4000 bytes:\n%s\n", process.c_str(),
                  log.substr(log.size() > 4000 ? log.size() - 4000 : 0).c_str());
    }
  }};
  const int worker_pid = pair.worker().pid();
  ASSERT_GT(worker_pid, 0);
  int http_port = 0;
  {
    std::ifstream in(pair.file("http.port"));
    in >> http_port;
  }
  ASSERT_GT(http_port, 0);
  const bool cuda = [&] {
    std::ifstream in(pair.log("worker"));
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return absl::StrContains(log, "backend cuda (");
  }();

  const absl::Time start = absl::Now(), stop_at = start + absl::Seconds(o.seconds);
  const absl::Time warm_at = start + absl::Seconds(std::max<int64_t>(20, o.seconds / 4));
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<std::pair<int, absl::StatusCode>, int64_t> outcomes;  // (kind, code) -> count
  std::vector<std::string> unexpected;
  int64_t slowest_ms = 0;
  std::atomic<int64_t> ended{0};
  auto record = [&](Kind k, const absl::Status& st, bool allowed, absl::Duration took) {
    ended.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    ++outcomes[{k, st.code()}];
    slowest_ms = std::max(slowest_ms, absl::ToInt64Milliseconds(took));
    if (!allowed && unexpected.size() < 20)
      unexpected.push_back(absl::StrCat(kKindName[k], ": ", st.ToString()));
  };

  auto load = [&](int id) {
    std::mt19937 rng(static_cast<uint32_t>(id) * 7919u + 1);
    const char* prompts[] = {"Love is", "A wise man once said", "The best way to", "Never",
                             "If you"};
    while (!stop.load()) {
      const Kind k = static_cast<Kind>(rng() % kKinds);
      api::v1::GenerateRequest r;
      r.set_max_tokens(static_cast<int32_t>(4 + rng() % 20));
      if (k == kIds || k == kLong) {
        const int n = k == kLong ? static_cast<int>(64 + rng() % 337) : 6;
        for (int i = 0; i < n; ++i)
          r.mutable_prompt_ids()->add_ids(static_cast<int32_t>(3 + rng() % 200));
      } else {
        r.set_prompt(prompts[rng() % 5]);
      }
      if (rng() % 2) r.mutable_sampling()->set_temperature(0.8f);
      if (k == kBad) {
        switch (rng() % 3) {
          case 0:
            r.mutable_prompt_ids()->add_ids(-5);
            break;
          case 1:
            r.mutable_sampling()->set_top_p(0.0f);
            break;
          default:
            r.set_max_tokens(0);
        }
      }
      if (k == kDeadline) r.set_max_tokens(64);
      // Every request carries a deadline: one that passes is a hang, except
      // for the deadline kind, whose deadline is the point. AddressSanitizer
      // runs the CPU model several times slower: a long prompt there gets
      // three times the room.
      const absl::Duration limit = k == kDeadline ? absl::Milliseconds(20 + rng() % 80)
                                                  : absl::Seconds(kAddressSanitizer ? 60 : 20);
      int chunks = 0;
      const absl::Time t0 = absl::Now();
      auto res = pair.client().Generate(
          r, [&](const api::v1::GenerateResponse&) { return !(k == kCancel && ++chunks >= 2); },
          t0 + limit);
      const absl::Status st = res.status();
      const absl::StatusCode c = st.code();
      bool ok = false;
      switch (k) {
        case kStream:
        case kIds:
        case kLong:
          ok = st.ok() || c == absl::StatusCode::kUnavailable;
          break;
        case kCancel:
          ok = st.ok() || c == absl::StatusCode::kCancelled || c == absl::StatusCode::kUnavailable;
          break;
        case kDeadline:
          ok = st.ok() || c == absl::StatusCode::kDeadlineExceeded ||
               c == absl::StatusCode::kUnavailable;
          break;
        case kBad:
          ok = c == absl::StatusCode::kInvalidArgument;
          break;
        default:
          break;
      }
      // RESOURCE_EXHAUSTED (a full queue) is an answer, not a hang.
      if (c == absl::StatusCode::kResourceExhausted) ok = k != kBad;
      record(k, st, ok, absl::Now() - t0);
    }
  };

  int64_t restarts = 0;
  std::vector<Row> rows;
  std::ofstream csv;
  if (!o.samples.empty()) {
    csv.open(o.samples, std::ios::trunc);
    ASSERT_TRUE(csv.good()) << "HMOE_SOAK_SAMPLES=" << o.samples << ": cannot write";
    csv << kCsvHeader << "\n" << std::flush;
  }
  // The process first (a scrape's socket is not counted), then the worker's
  // own figures.
  auto take = [&](const std::string& phase, bool keep = true) {
    Row r;
    r.t_s = absl::ToDoubleSeconds(absl::Now() - start);
    r.phase = phase;
    r.proc = Sample(worker_pid);
    r.slots = SampleSlots(worker_pid);
    if (auto st = pair.client().Stats(); st.ok()) {
      r.kv_used = st->kv_blocks_used();
      r.kv_total = st->kv_blocks_total();
      r.running = st->running();
      r.waiting = st->waiting();
    }
    if (cuda) {
      httplib::Client http("127.0.0.1", http_port);
      http.set_read_timeout(5, 0);
      if (auto res = http.Get("/metrics"); res && res->status == 200)
        r.gpu_used_bytes = MetricValue(res->body, "hmoe_gpu_memory_used_bytes");
      r.gpu_proc_mib = GpuMemoryMib(worker_pid);
      r.gpu_quiet = o.gpu_quiet_file.empty() || ::access(o.gpu_quiet_file.c_str(), F_OK) == 0;
    }
    r.requests = ended.load();
    r.restarts = restarts;
    if (keep && csv.is_open()) csv << Csv(r) << "\n" << std::flush;
    if (keep) rows.push_back(r);
    return r;
  };

  std::vector<ProcSample> after_warm;
  ProcSample warm;
  int64_t warm_gpu_mib = -1, gpu_mib_max = -1;
  std::vector<std::thread> threads;
  for (int i = 0; i < o.clients; ++i) threads.emplace_back(load, i);
  take("start");
  const absl::Duration restart_every = absl::Seconds(o.restart_every);
  absl::Time next_restart = o.restart_every > 0 ? start + restart_every : absl::InfiniteFuture();
  absl::Time next_row = start + absl::Seconds(o.sample_every);
  absl::Time last_restart = absl::InfinitePast();
  bool warmed = false;
  while (absl::Now() < stop_at) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    if (absl::Now() >= next_restart && absl::Now() + absl::Seconds(8) < stop_at) {
      pair.expert().Kill(restarts % 2 ? SIGTERM : SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      if (!pair.expert().Restart()) {
        ADD_FAILURE() << "the expert service did not restart (restart " << restarts << ")";
        break;
      }
      ++restarts;
      last_restart = absl::Now();
      next_restart = absl::Now() + restart_every;
    }
    if (!warmed && absl::Now() >= warm_at && absl::Now() >= last_restart + absl::Seconds(5)) {
      // The baseline in the state the end is sampled in: serving (not in
      // the middle of a restart, when the worker holds no segment, nor just
      // after one, while the new segment's pages are still being touched).
      api::v1::GenerateRequest probe;
      probe.set_prompt("Love is");
      probe.set_max_tokens(2);
      if (!testing::ServedWithin5s(pair.client(), probe)) {
        ADD_FAILURE() << "not serving at the end of warm-up";
        break;
      }
      const Row r = take("warm");
      warm = r.proc;
      warm_gpu_mib = gpu_mib_max = r.gpu_proc_mib;
      warmed = true;
      next_row = absl::Now() + absl::Seconds(o.sample_every);
    } else if (warmed) {
      if (absl::Now() >= next_row) {
        const Row r = take("load");
        gpu_mib_max = std::max(gpu_mib_max, r.gpu_proc_mib);
        after_warm.push_back(r.proc);
        next_row = absl::Now() + absl::Seconds(o.sample_every);
      } else {
        after_warm.push_back(Sample(worker_pid));
      }
    } else if (absl::Now() >= next_row) {
      take("warm-up");
      next_row = absl::Now() + absl::Seconds(o.sample_every);
    }
  }
  stop.store(true);
  for (std::thread& t : threads) t.join();

  // (The loop above only breaks early on a failure already reported; the
  // clients are stopped and joined before anything else can return.)
  // The pair serves again, and the worker holds what it held after warm-up.
  api::v1::GenerateRequest r;
  r.set_prompt("Love is");
  r.set_max_tokens(4);
  EXPECT_TRUE(testing::ServedWithin5s(pair.client(), r));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const size_t middle = rows.size() / 2;
  const Row end_row = take("end");
  const ProcSample& end = end_row.proc;
  after_warm.push_back(end);
  gpu_mib_max = std::max(gpu_mib_max, end_row.gpu_proc_mib);
  // At rest: nothing running or waiting, no KV block and no slot held (the
  // last request's blocks are returned as it ends: a short wait at most).
  Row rest;
  for (int i = 0; i < 50; ++i) {
    rest = take("rest", false);
    if (rest.running == 0 && rest.waiting == 0 && rest.kv_used == 0 && rest.slots.busy <= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (csv.is_open()) csv << Csv(rest) << "\n" << std::flush;
  EXPECT_EQ(rest.running, 0) << "requests running at rest";
  EXPECT_EQ(rest.waiting, 0) << "requests waiting at rest";
  EXPECT_EQ(rest.kv_used, 0) << "KV blocks in use at rest (of " << rest.kv_total << ")";
  EXPECT_LE(rest.slots.busy, 0) << "shm slots in use at rest (of " << rest.slots.total << ")";
  ASSERT_TRUE(warmed);
  int64_t rss_max = warm.rss_kb, fds_max = warm.fds, memfds_max = warm.memfds;
  for (const ProcSample& s : after_warm) {
    rss_max = std::max(rss_max, s.rss_kb);
    fds_max = std::max(fds_max, s.fds);
    memfds_max = std::max(memfds_max, s.memfds);
  }
  // Under AddressSanitizer freed memory stays resident in its quarantine
  // (256 MB by default), so RSS climbs until that fills and this bound is
  // not checked there. (This soak does not read the worker's exit status;
  // LeakSanitizer's check of a worker comes from the e2e tests that stop
  // one with SIGTERM and expect exit 0.)
  if (!kAddressSanitizer) {
    EXPECT_LE(static_cast<double>(rss_max), 1.05 * static_cast<double>(warm.rss_kb))
        << "worker RSS grew from " << warm.rss_kb << " kB at warm-up to " << rss_max << " kB";
  }
  EXPECT_LE(end.fds, warm.fds) << "open descriptors at the end vs after warm-up: "
                               << absl::StrJoin(warm.targets, " ") << " -> "
                               << absl::StrJoin(end.targets, " ");
  EXPECT_LE(end.memfds, warm.memfds) << "shared-memory segments at the end vs after warm-up";
  if (warm_gpu_mib > 0) {
    EXPECT_LE(static_cast<double>(gpu_mib_max), 1.05 * static_cast<double>(warm_gpu_mib))
        << "the worker's GPU memory grew from " << warm_gpu_mib << " MiB at warm-up to "
        << gpu_mib_max << " MiB";
  }
  // The device's memory in use, over the quiet samples from warm-up on (the
  // rest row included): flat against the first.
  double gpu_quiet_first = std::numeric_limits<double>::quiet_NaN(), gpu_quiet_max = 0;
  int64_t gpu_quiet_rows = 0;
  std::vector<const Row*> quiet_rows;
  for (const Row& row : rows)
    if (row.phase != "start" && row.phase != "warm-up") quiet_rows.push_back(&row);
  quiet_rows.push_back(&rest);
  for (const Row* row : quiet_rows) {
    if (!row->gpu_quiet || std::isnan(row->gpu_used_bytes)) continue;
    if (gpu_quiet_rows++ == 0) gpu_quiet_first = row->gpu_used_bytes;
    gpu_quiet_max = std::max(gpu_quiet_max, row->gpu_used_bytes);
  }
  if (gpu_quiet_rows >= 2) {
    EXPECT_LE(gpu_quiet_max, 1.05 * gpu_quiet_first)
        << "GPU memory in use grew from " << gpu_quiet_first << " bytes to " << gpu_quiet_max
        << " over " << gpu_quiet_rows << " samples while the soak had the GPU alone";
  }

  int64_t total = 0, per_kind[kKinds] = {};
  std::string codes;
  for (const auto& [key, n] : outcomes) {
    total += n;
    per_kind[key.first] += n;
    absl::StrAppend(&codes, codes.empty() ? "" : ", ", kKindName[key.first], " ",
                    absl::StatusCodeToString(key.second), " ", n);
  }
  EXPECT_TRUE(unexpected.empty()) << unexpected.size() << " unexpected outcomes, e.g. "
                                  << unexpected.front();
  for (int k = 0; k < kKinds; ++k) EXPECT_GT(per_kind[k], 0) << kKindName[k] << " never sent";
  if (o.restart_every > 0) {
    EXPECT_GE(restarts, o.seconds >= 2 * o.restart_every ? 1 : 0);
  }
  std::printf(
      "[ soak     ] %lld s, backend %s, %lld clients, %lld expert-service restarts: %lld requests "
      "(%s); slowest %lld ms; worker RSS %lld kB after warm-up, max %lld kB (%+.1f%%), end %lld "
      "kB; fds %lld -> max %lld, end %lld; shm segments %lld -> max %lld, end %lld; GPU MiB "
      "(nvidia-smi) %lld -> max %lld, end %lld; GPU in use (device, %lld quiet samples) %.0f MiB "
      "-> max %.0f MiB; at rest: running %lld, waiting %lld, KV blocks %lld of %lld, slots %lld "
      "of %lld\n",
      static_cast<long long>(o.seconds), cuda ? "cuda" : "cpu", static_cast<long long>(o.clients),
      static_cast<long long>(restarts), static_cast<long long>(total), codes.c_str(),
      static_cast<long long>(slowest_ms), static_cast<long long>(warm.rss_kb),
      static_cast<long long>(rss_max),
      100.0 * (static_cast<double>(rss_max) / static_cast<double>(warm.rss_kb) - 1.0),
      static_cast<long long>(end.rss_kb), static_cast<long long>(warm.fds),
      static_cast<long long>(fds_max), static_cast<long long>(end.fds),
      static_cast<long long>(warm.memfds), static_cast<long long>(memfds_max),
      static_cast<long long>(end.memfds), static_cast<long long>(warm_gpu_mib),
      static_cast<long long>(gpu_mib_max), static_cast<long long>(end_row.gpu_proc_mib),
      static_cast<long long>(gpu_quiet_rows), gpu_quiet_first / 1048576.0,
      gpu_quiet_max / 1048576.0, static_cast<long long>(rest.running),
      static_cast<long long>(rest.waiting), static_cast<long long>(rest.kv_used),
      static_cast<long long>(rest.kv_total), static_cast<long long>(rest.slots.busy),
      static_cast<long long>(rest.slots.total));
  // Start, middle and end of the run for the note (every row is in the CSV).
  {
    std::printf("[ soak     ] %s\n", kCsvHeader);
    for (const Row* row : std::vector<const Row*>{&rows.front(), &rows[middle], &end_row, &rest})
      std::printf("[ soak     ] %s\n", Csv(*row).c_str());
  }
}

}  // namespace
}  // namespace hmoe
