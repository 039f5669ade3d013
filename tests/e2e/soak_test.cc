// Soak: mixed load on the serving pair (ds3_fortunes, shm) while the expert
// service is killed and restarted, for HMOE_SOAK_SECONDS (default 120; the
// test command runs that, 45 under ASan; a long run: 1800). Client threads
// send streamed text prompts, token-id prompts, requests they cancel after a
// few chunks, requests with short deadlines and bad requests; a restarter
// kills the expert service (SIGKILL and SIGTERM in turn) every
// HMOE_SOAK_RESTART_SECONDS (default 20) and starts it again on its port.
// Checked: every request ends, within its deadline, with a code its kind
// allows; after warm-up the worker's RSS stays within 5% of its warm-up
// level and its open descriptors and shared-memory segments do not grow;
// the pair serves again at the end. One summary line for the note.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/e2e/serving_pair.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t n = 0;
  return v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 ? n : fallback;
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

enum Kind { kStream, kIds, kCancel, kDeadline, kBad, kKinds };
const char* const kKindName[kKinds] = {"stream", "ids", "cancel", "deadline", "bad"};

TEST(Soak, MixedLoadWithExpertServiceRestarts) {
  const int64_t seconds = EnvInt("HMOE_SOAK_SECONDS", 120);
  const int64_t restart_every = EnvInt("HMOE_SOAK_RESTART_SECONDS", 20);
  const int clients = static_cast<int>(EnvInt("HMOE_SOAK_CLIENTS", 6));
  testing::Pair pair;
  ASSERT_TRUE(pair.Start(testing::FixturesDir() + "/ds3_fortunes", 1, "tp", "shm",
                         {"--max-batch=8", "--max-queue=64"}));
  const int worker_pid = pair.worker().pid();
  ASSERT_GT(worker_pid, 0);

  const absl::Time start = absl::Now(), stop_at = start + absl::Seconds(seconds);
  const absl::Time warm_at = start + absl::Seconds(std::max<int64_t>(20, seconds / 4));
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<std::pair<int, absl::StatusCode>, int64_t> outcomes;  // (kind, code) -> count
  std::vector<std::string> unexpected;
  int64_t slowest_ms = 0;
  auto record = [&](Kind k, const absl::Status& st, bool allowed, absl::Duration took) {
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
      if (k == kIds) {
        for (int i = 0; i < 6; ++i)
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
      // for the deadline kind, whose deadline is the point.
      const absl::Duration limit =
          k == kDeadline ? absl::Milliseconds(20 + rng() % 80) : absl::Seconds(20);
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

  std::vector<ProcSample> after_warm;
  ProcSample warm;
  int64_t restarts = 0;
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) threads.emplace_back(load, i);
  absl::Time next_restart = start + absl::Seconds(restart_every);
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
      next_restart = absl::Now() + absl::Seconds(restart_every);
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
      warm = Sample(worker_pid);
      warmed = true;
    } else if (warmed) {
      after_warm.push_back(Sample(worker_pid));
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
  const ProcSample end = Sample(worker_pid);
  after_warm.push_back(end);
  ASSERT_TRUE(warmed);
  int64_t rss_max = warm.rss_kb, fds_max = warm.fds, memfds_max = warm.memfds;
  for (const ProcSample& s : after_warm) {
    rss_max = std::max(rss_max, s.rss_kb);
    fds_max = std::max(fds_max, s.fds);
    memfds_max = std::max(memfds_max, s.memfds);
  }
  EXPECT_LE(static_cast<double>(rss_max), 1.05 * static_cast<double>(warm.rss_kb))
      << "worker RSS grew from " << warm.rss_kb << " kB at warm-up to " << rss_max << " kB";
  EXPECT_LE(end.fds, warm.fds) << "open descriptors at the end vs after warm-up: "
                               << absl::StrJoin(warm.targets, " ") << " -> "
                               << absl::StrJoin(end.targets, " ");
  EXPECT_LE(end.memfds, warm.memfds) << "shared-memory segments at the end vs after warm-up";

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
  EXPECT_GE(restarts, seconds >= 2 * restart_every ? 1 : 0);
  std::printf(
      "[ soak     ] %lld s, %d clients, %lld expert-service restarts: %lld requests (%s); "
      "slowest %lld ms; worker RSS %lld kB after warm-up, max %lld kB (%+.1f%%), end %lld kB; "
      "fds %lld -> max %lld, end %lld; shm segments %lld -> max %lld, end %lld\n",
      static_cast<long long>(seconds), clients, static_cast<long long>(restarts),
      static_cast<long long>(total), codes.c_str(), static_cast<long long>(slowest_ms),
      static_cast<long long>(warm.rss_kb), static_cast<long long>(rss_max),
      100.0 * (static_cast<double>(rss_max) / static_cast<double>(warm.rss_kb) - 1.0),
      static_cast<long long>(end.rss_kb), static_cast<long long>(warm.fds),
      static_cast<long long>(fds_max), static_cast<long long>(end.fds),
      static_cast<long long>(warm.memfds), static_cast<long long>(memfds_max),
      static_cast<long long>(end.memfds));
}

}  // namespace
}  // namespace hmoe
