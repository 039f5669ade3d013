// The pair with the worker on --backend=cuda (its decode steps CUDA Graphs
// of device-sent expert calls over shm): a KV pool run dry by many long
// requests and SIGTERM with requests in flight. Skips where the worker
// cannot run the cuda backend.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "sdk/client.h"
#include "tests/e2e/serving_pair.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using testing::Pair;

// Starts `pair` on the cuda backend; false with `why` set when this machine
// cannot run it (a failure for any other reason fails the test).
bool StartCuda(Pair& pair, const std::vector<std::string>& extra, std::string* why) {
  pair.set_capture_logs();
  std::vector<std::string> args = {"--backend=cuda"};
  args.insert(args.end(), extra.begin(), extra.end());
  if (pair.Start(testing::FixturesDir() + "/ds3_fortunes", 1, "tp", "shm", args)) return true;
  std::ifstream f(pair.log("worker"));
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (log.find("CUDA") != std::string::npos || log.find("cuda") != std::string::npos) {
    // The log's last line that names it.
    std::string line;
    for (size_t end = log.size(); end > 0 && why->empty();) {
      const size_t start = log.rfind('\n', end - 1);
      line = log.substr(start == std::string::npos ? 0 : start + 1,
                        end - (start == std::string::npos ? 0 : start + 1));
      if (line.find("cuda") != std::string::npos || line.find("CUDA") != std::string::npos)
        *why = line;
      end = start == std::string::npos ? 0 : start;
    }
    return false;
  }
  ADD_FAILURE() << log;
  *why = "the pair did not start";
  return false;
}

// Sixteen long requests at once against 8 KV blocks: each is served in full
// or refused RESOURCE_EXHAUSTED (HTTP 429), never a crash or a hang; the
// worker serves afterwards with every block back.
TEST(CudaServing, AnExhaustedKvPoolIsQueuedOrRefusedNeverACrash) {
  Pair pair;
  std::string why;
  if (!StartCuda(pair, {"--kv-blocks=8", "--max-batch=8", "--max-queue=4"}, &why)) {
    if (!HasFailure()) GTEST_SKIP() << "the worker cannot run --backend=cuda here: " << why;
    return;
  }
  api::v1::GenerateRequest r;
  r.set_prompt("A wise man once said");
  r.set_max_tokens(90);
  r.set_ignore_eos(true);
  std::vector<absl::StatusOr<GenerateResult>> got(16, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] { got[i] = pair.client().Generate(r); });
  for (auto& t : threads) t.join();
  int served = 0;
  for (const auto& g : got) {
    if (g.ok()) {
      ++served;
      EXPECT_EQ(g->token_ids.size(), 90u);
    } else {
      EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted) << g.status();
    }
  }
  EXPECT_GE(served, 1);
  EXPECT_EQ(::waitpid(pair.worker().pid(), nullptr, WNOHANG), 0) << "the worker exited";
  auto again = pair.client().Generate(r);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->token_ids.size(), 90u);
}

// SIGTERM with four generations in flight on the cuda path: each finishes
// in full, then the worker exits 0.
TEST(CudaServing, SigtermDrainsTheRequestsInFlight) {
  Pair pair;
  std::string why;
  if (!StartCuda(pair, {}, &why)) {
    if (!HasFailure()) GTEST_SKIP() << "the worker cannot run --backend=cuda here: " << why;
    return;
  }
  api::v1::GenerateRequest r;
  r.set_prompt("A wise man once said");
  r.set_max_tokens(200);
  r.set_ignore_eos(true);
  constexpr int kN = 4;
  std::atomic<int> started{0};
  std::vector<absl::StatusOr<GenerateResult>> got(kN, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      bool first = true;
      got[static_cast<size_t>(i)] =
          pair.client().Generate(r, [&](const api::v1::GenerateResponse&) {
            if (std::exchange(first, false)) ++started;
            return true;
          });
    });
  }
  for (int i = 0; i < 3000 && started.load() < kN; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(started.load(), kN) << "not every generation started";
  const int status = pair.worker().Kill(SIGTERM);
  for (auto& t : threads) t.join();
  for (const auto& g : got) {
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->token_ids.size(), 200u);
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace hmoe
