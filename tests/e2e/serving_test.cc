// The pair as real processes: hmoe-expert-service + hmoe-gpu-worker, driven
// through the C++ client. Greedy output must equal transformers' for every
// fixture; concurrency, bad input, cancellation, load and failures of the
// expert service are exercised against the running worker.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/routing_stats.h"
#include "common/safetensors.h"
#include "common/text/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sdk/client.h"
#include "tests/e2e/serving_pair.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::Pair;
using testing::ServedWithin5s;
using testing::WorkerBinary;

struct Reference {
  std::vector<int32_t> prompt, greedy;
};

Reference LoadReference(const std::string& dir) {
  Reference r;
  auto f = SafetensorsFile::Open(dir + "/reference.safetensors");
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return r;
  for (float v : (*f)->Get("prompt_ids")->ToF32()) r.prompt.push_back(static_cast<int32_t>(v));
  for (float v : (*f)->Get("greedy_ids")->ToF32()) r.greedy.push_back(static_cast<int32_t>(v));
  return r;
}

api::v1::GenerateRequest IdsRequest(const std::vector<int32_t>& prompt, int max_tokens) {
  api::v1::GenerateRequest r;
  for (int32_t t : prompt) r.mutable_prompt_ids()->add_ids(t);
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(true);
  return r;
}

std::vector<std::string> Fixtures() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(testing::FixturesDir()))
    if (std::filesystem::exists(e.path() / "reference.safetensors") &&
        !absl::StartsWith(e.path().filename().string(), "deepseek_v4"))  // not served yet
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A sticky CUDA error (injected at the 4th pass, --debug-cuda-fault-after):
// the request in flight fails, health turns NOT_SERVING and the worker
// drains and exits 3, so that systemd (Restart=on-failure) starts a fresh
// one. Skips where the worker cannot run the cuda backend.
TEST(Serving, StickyCudaErrorFailsRequestsAndExitsNonZero) {
  Pair pair;
  pair.set_capture_logs();
  const std::string dir = testing::FixturesDir() + "/ds3_fortunes";
  if (!pair.Start(dir, 1, "tp", "shm", {"--backend=cuda", "--debug-cuda-fault-after=3"})) {
    std::ifstream f(pair.log("worker"));
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (log.find("CUDA") != std::string::npos || log.find("cuda") != std::string::npos)
      GTEST_SKIP() << "the worker cannot run --backend=cuda here: " << log;
    FAIL() << log;
  }
  api::v1::GenerateRequest r;
  r.set_prompt("Love is");
  r.set_max_tokens(20);
  r.set_ignore_eos(true);
  auto g = pair.client().Generate(r);
  EXPECT_FALSE(g.ok());
  const int status = pair.worker().WaitExit(30000);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
  std::ifstream f(pair.log("worker"));
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(log.find("failed for good, NOT_SERVING"), std::string::npos) << log;
}

// Loads say how far they are: off a terminal (stderr to a file here), the
// final line of each load with its bytes and mean rate, in the service's and
// the worker's logs.
TEST(Serving, LoadsLogTheirProgress) {
  Pair pair;
  pair.set_capture_logs();
  ASSERT_TRUE(pair.Start(testing::FixturesDir() + "/ds3_fortunes"));
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  const std::string expert = read(pair.log("expert0")), worker = read(pair.log("worker"));
  EXPECT_THAT(expert,
              ::testing::ContainsRegex(
                  R"(\]: loading experts: [0-9.]+ [KMG]?i?B in [0-9.]+ s, [0-9.]+ GB/s mean)"))
      << expert;
  EXPECT_THAT(worker, ::testing::ContainsRegex(
                          R"(hmoe-gpu-worker: loading weights: [0-9.]+ [KMG]?i?B in [0-9.]+ s, )"
                          R"([0-9.]+ GB/s mean)"))
      << worker;
  // Not a terminal: no line rewritten in place.
  EXPECT_EQ(worker.find('\r'), std::string::npos);
  EXPECT_EQ(expert.find('\r'), std::string::npos);
}

// Routing statistics leave the worker two ways: `hmoe stats --save` while it
// runs (the Stats RPC) and --routing-stats-out at shutdown; both are the
// routing table of every token the worker routed.
TEST(Serving, RoutingStatsAreServedAndWrittenAtShutdown) {
  testing::TempDir dir;
  const std::string model = testing::FixturesDir() + "/ds3_fortunes";
  const std::string at_exit = dir.file("routing-at-exit.json");
  Pair pair;
  ASSERT_TRUE(pair.Start(model, 1, "tp", "shm", {"--routing-stats-out=" + at_exit}));
  const Reference ref = LoadReference(model);
  auto r = pair.client().Generate(IdsRequest(ref.prompt, 8));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string saved = dir.file("routing.json");
  const std::string hmoe = std::string(HMOE_BINARY_DIR) + "/bin/hmoe";
  ASSERT_EQ(std::system((hmoe + " stats --server " + pair.worker().target() + " --save " + saved +
                         " >" + dir.file("stats.txt") + " 2>&1")
                            .c_str()),
            0);
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  EXPECT_NE(read(dir.file("stats.txt")).find("tokens routed per MoE layer"), std::string::npos);
  auto t = ParseRoutingTable(read(saved));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->model_type, "deepseek_v3");
  EXPECT_FALSE(t->layers.empty());
  // The prompt and every generated token but the last were routed (maybe
  // more: the engine may run a pass again after a failure).
  const uint64_t want = ref.prompt.size() + 8 - 1;
  EXPECT_EQ(t->routed_tokens(), want);
  const int status = pair.worker().Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  auto e = ParseRoutingTable(read(at_exit));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->routed_tokens(), want);
  ASSERT_EQ(e->layers.size(), t->layers.size());
  for (size_t i = 0; i < e->layers.size(); ++i) EXPECT_EQ(e->layers[i].tokens, t->layers[i].tokens);
}

// `hmoe bench-serve` against a worker whose queue holds one request: the
// refused requests are reported apart and make the exit non-zero (it was 0);
// with --retry they are sent again until every one completes.
TEST(Serving, BenchServeCountsRefusalsAndRetriesThem) {
  testing::TempDir dir;
  Pair pair;
  ASSERT_TRUE(pair.Start(testing::FixturesDir() + "/ds3_fortunes", 1, "tp", "shm",
                         {"--max-queue=1", "--max-batch=1"}));
  const std::string base =
      absl::StrCat("env -u HMOE_TOKEN_FILE -u HMOE_TLS_CA_FILE ", HMOE_BINARY_DIR,
                   "/bin/hmoe bench-serve --server ", pair.worker().target(),
                   " --clients 8 --requests 24 --max-tokens 16 ");
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  const int refused =
      std::system((base + ">" + dir.file("a.txt") + " 2>" + dir.file("a.err")).c_str());
  const std::string a = read(dir.file("a.txt"));
  EXPECT_THAT(a, HasSubstr("refused (queue full) "));
  EXPECT_THAT(a, ::testing::Not(HasSubstr("refused (queue full) 0,"))) << a;
  EXPECT_TRUE(WIFEXITED(refused) && WEXITSTATUS(refused) == 1) << refused << "\n" << a;
  EXPECT_THAT(read(dir.file("a.err")), HasSubstr("did not complete"));
  const int retried = std::system(
      (base + "--retry 100000 >" + dir.file("b.txt") + " 2>" + dir.file("b.err")).c_str());
  const std::string b = read(dir.file("b.txt"));
  EXPECT_EQ(retried, 0) << b << read(dir.file("b.err"));
  EXPECT_THAT(b, HasSubstr("completed 24, refused (queue full, after 100000 retries) 0, failed 0"));
}

// Whole stack (worker + expert service over shared memory, bf16 expert
// weights) against transformers' greedy tokens, for every fixture.
TEST(Serving, GreedyThroughTheWholeStackEqualsTransformers) {
  const auto fixtures = Fixtures();
  ASSERT_GE(fixtures.size(), 5u);
  for (const std::string& dir : fixtures) {
    SCOPED_TRACE(dir);
    const Reference ref = LoadReference(dir);
    // The cuda backend refuses DeepSeek sparse attention (deepseek_v32,
    // glm_moe_dsa): those fixtures run on the cpu backend wherever the worker
    // would pick cuda.
    std::ifstream config(dir + "/config.json");
    const std::string type = nlohmann::json::parse(config).value("model_type", "");
    const bool dsa = type == "deepseek_v32" || type == "glm_moe_dsa";
    Pair pair;
    ASSERT_TRUE(
        pair.Start(dir, 1, "tp", "shm",
                   dsa ? std::vector<std::string>{"--backend=cpu"} : std::vector<std::string>{}));
    auto r = pair.client().Generate(IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size())));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->token_ids, ref.greedy);
    EXPECT_EQ(r->finish_reason, api::v1::FINISH_REASON_LENGTH);
  }
}

std::string WriteToken(const testing::TempDir& dir, const std::string& name,
                       const std::string& token) {
  const std::string path = dir.file(name);
  std::ofstream(path) << token << "\n";
  std::filesystem::permissions(
      path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  return path;
}

// --auth-token-file on both processes: the worker reaches the expert service
// with --expert-auth-token-file, and clients need the worker's own token
// (the C++ client's ClientOptions::auth_token, hmoe's --token-file).
TEST(Serving, TokensGuardTheClientApiAndTheExpertPlane) {
  const std::string dir = testing::FixturesDir() + "/ds3_fortunes";
  const Reference ref = LoadReference(dir);
  testing::TempDir tmp;
  const std::string client_token = WriteToken(tmp, "client", "client-token-0123456789abcdef");
  const std::string expert_token = WriteToken(tmp, "expert", "expert-token-0123456789abcdef");
  Pair pair;
  ASSERT_TRUE(
      pair.Start(dir, 1, "tp", "shm",
                 {"--auth-token-file=" + client_token, "--expert-auth-token-file=" + expert_token},
                 {"--auth-token-file=" + expert_token}));
  const auto request = IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size()));
  auto refused = pair.client().Generate(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("--token-file"));
  EXPECT_EQ(pair.client().ModelInfo().status().code(), absl::StatusCode::kUnauthenticated);
  auto healthy = pair.client().Healthy();  // health stays open
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);

  ClientOptions o;
  o.target = pair.worker().target();
  o.auth_token = "client-token-0123456789abcdef";
  auto client = Client::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  auto r = (*client)->Generate(request);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_ids, ref.greedy);

  // The command line: with --token-file it generates, without it the error
  // names the code.
  const std::string hmoe = std::string(HMOE_BINARY_DIR) + "/bin/hmoe";
  const std::string base = absl::StrCat("env -u HMOE_TOKEN_FILE ", hmoe, " generate --server ",
                                        pair.worker().target(), " -p 'hello' --max-tokens 2 ");
  EXPECT_EQ(std::system((base + "--token-file " + client_token + " >/dev/null 2>&1").c_str()), 0);
  const std::string err = tmp.file("err");
  EXPECT_NE(std::system((base + ">/dev/null 2>" + err).c_str()), 0);
  std::ifstream in(err);
  const std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(said, HasSubstr("UNAUTHENTICATED"));
  // The Python client likewise (where Debian's python3-grpcio is installed).
  if (std::system("/usr/bin/python3 -c 'import grpc' >/dev/null 2>&1") == 0) {
    const std::string py = absl::StrCat(
        "env -u HMOE_TOKEN_FILE HMOE_PYTHON_STUBS=", HMOE_BINARY_DIR, "/python /usr/bin/python3 ",
        HMOE_SOURCE_DIR, "/sdk/python/hmoe_client.py --server ", pair.worker().target(), " ");
    const std::string gen = " generate hello --max-tokens 2 >/dev/null 2>";
    EXPECT_EQ(std::system((py + "--token-file " + client_token + gen + "/dev/null").c_str()), 0);
    const std::string py_err = tmp.file("py_err");
    EXPECT_NE(std::system((py + gen + py_err).c_str()), 0);
    std::ifstream py_in(py_err);
    const std::string py_said((std::istreambuf_iterator<char>(py_in)),
                              std::istreambuf_iterator<char>());
    EXPECT_THAT(py_said, HasSubstr("UNAUTHENTICATED"));
  }

  // A worker whose expert token is wrong stops at start with the reason.
  const std::string wrong = WriteToken(tmp, "wrong", "expert-token-0123456789abcdeX");
  testing::ServiceProcess worker;
  worker.set_binary(WorkerBinary());
  EXPECT_FALSE(worker.Start({"--model=" + dir, "--experts=" + pair.expert().target(),
                             "--transport=shm", "--expert-auth-token-file=" + wrong},
                            tmp.file("worker2.port")));
  EXPECT_TRUE(WIFEXITED(worker.exit_status()) && WEXITSTATUS(worker.exit_status()) == 1)
      << worker.exit_status();
}

// Both planes' tokens rotate on running processes (SIGHUP; one token per
// line, the new one first): no restart, no refused call on the way.
TEST(Serving, SighupRotatesBothPlanesTokens) {
  const std::string dir = testing::FixturesDir() + "/ds3_fortunes";
  const Reference ref = LoadReference(dir);
  testing::TempDir tmp;
  const std::string a = "client-token-0123456789abcdef", b = "client-token-rotated-0123456789";
  const std::string e1 = "expert-token-0123456789abcdef", e2 = "expert-token-rotated-0123456789";
  const std::string client_file = WriteToken(tmp, "client", a);
  // One expert token file for both processes, as on one host.
  const std::string expert_file = WriteToken(tmp, "expert", e1);
  Pair pair;
  pair.set_capture_logs();
  ASSERT_TRUE(
      pair.Start(dir, 1, "tp", "shm",
                 {"--auth-token-file=" + client_file, "--expert-auth-token-file=" + expert_file},
                 {"--auth-token-file=" + expert_file}));
  const auto request = IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size()));
  auto served = [&](const std::string& token) -> absl::Status {
    ClientOptions o;
    o.target = pair.worker().target();
    o.auth_token = token;
    auto c = Client::Connect(o);
    if (!c.ok()) return c.status();
    auto r = (*c)->Generate(request);
    if (!r.ok()) return r.status();
    EXPECT_EQ(r->token_ids, ref.greedy);
    return absl::OkStatus();
  };
  ASSERT_TRUE(served(a).ok());

  // The expert plane: the service takes both, the worker moves to e2, the
  // service drops e1. The worker's health (an authenticated call to the
  // service every second) would turn NOT_SERVING if it still sent e1.
  WriteToken(tmp, "expert", e2 + "\n" + e1);
  pair.expert().Signal(SIGHUP);
  ASSERT_TRUE(testing::FileSays(pair.log("expert0"), "reloaded: 2 token(s)"));
  pair.worker().Signal(SIGHUP);
  ASSERT_TRUE(testing::FileSays(pair.log("worker"),
                                "--expert-auth-token-file " + expert_file + " reloaded: 2"));
  WriteToken(tmp, "expert", e2);
  pair.expert().Signal(SIGHUP);
  ASSERT_TRUE(testing::FileSays(pair.log("expert0"), "reloaded: 1 token(s)"));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // two health rounds
  auto healthy = pair.client().Healthy();
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
  EXPECT_TRUE(served(a).ok());

  // The client API: both tokens, then only the new one.
  WriteToken(tmp, "client", b + "\n" + a);
  pair.worker().Signal(SIGHUP);
  ASSERT_TRUE(
      testing::FileSays(pair.log("worker"), "--auth-token-file " + client_file + " reloaded: 2"));
  EXPECT_TRUE(served(a).ok());
  EXPECT_TRUE(served(b).ok());
  WriteToken(tmp, "client", b);
  pair.worker().Signal(SIGHUP);
  // Each SIGHUP reloads both files: the first (the expert plane's) logged
  // this line already.
  ASSERT_TRUE(testing::FileSays(pair.log("worker"),
                                "--auth-token-file " + client_file + " reloaded: 1", 2));
  EXPECT_EQ(served(a).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(served(b).ok());
  // A file that fails its checks: the worker keeps serving with b.
  WriteToken(tmp, "client", "short");
  pair.worker().Signal(SIGHUP);
  ASSERT_TRUE(testing::FileSays(pair.log("worker"), "kept the tokens in force: auth token file " +
                                                        client_file + ": token of 5 bytes"));
  EXPECT_TRUE(served(b).ok());
}

// TLS on both gRPC planes: the service's port (the worker verifies it with
// --expert-tls-ca-file) and the worker's client API (verified by the
// client's CA); a plaintext client cannot connect; hmoe --tls-ca-file works.
TEST(Serving, TlsOnBothPlanes) {
  const std::string dir = testing::FixturesDir() + "/ds3_fortunes";
  const std::string tls = testing::FixturesDir() + "/tls/";
  const Reference ref = LoadReference(dir);
  Pair pair;
  pair.set_client_tls({tls + "ca.pem", "", ""});
  ASSERT_TRUE(pair.Start(
      dir, 1, "tp", "shm",
      {"--tls-cert-file=" + tls + "server.pem", "--tls-key-file=" + tls + "server.key",
       "--expert-tls-ca-file=" + tls + "ca.pem"},
      {"--tls-cert-file=" + tls + "server.pem", "--tls-key-file=" + tls + "server.key"}));
  auto r = pair.client().Generate(IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size())));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_ids, ref.greedy);
  ClientOptions plain;
  plain.target = pair.worker().target();
  plain.connect_timeout = absl::Seconds(1);
  EXPECT_FALSE(Client::Connect(plain).ok());
  const std::string hmoe = absl::StrCat("env -u HMOE_TLS_CA_FILE -u HMOE_TOKEN_FILE ",
                                        HMOE_BINARY_DIR, "/bin/hmoe generate --server ",
                                        pair.worker().target(), " -p 'hello' --max-tokens 2 ");
  EXPECT_EQ(std::system((hmoe + "--tls-ca-file " + tls + "ca.pem >/dev/null 2>&1").c_str()), 0);
  if (std::system("/usr/bin/python3 -c 'import grpc' >/dev/null 2>&1") == 0) {
    const std::string py = absl::StrCat(
        "env -u HMOE_TLS_CA_FILE -u HMOE_TOKEN_FILE HMOE_PYTHON_STUBS=", HMOE_BINARY_DIR,
        "/python /usr/bin/python3 ", HMOE_SOURCE_DIR, "/sdk/python/hmoe_client.py --server ",
        pair.worker().target(), " --tls-ca-file ", tls,
        "ca.pem generate hello --max-tokens 2 >/dev/null 2>&1");
    EXPECT_EQ(std::system(py.c_str()), 0) << py;
  }
}

// Sharded expert service (2 and 3 shards, both splits, every transport) gives
// the same greedy tokens.
TEST(Serving, ShardsAndTransportsAgree) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v3_tiny";
  const Reference ref = LoadReference(dir);
  struct Case {
    int shards;
    const char* split;
    const char* transport;
  };
  for (const Case& c : {Case{2, "tp", "grpc"}, Case{3, "ep", "shm"}, Case{2, "ep", "ucx"}}) {
    SCOPED_TRACE(::testing::Message() << c.shards << " " << c.split << " " << c.transport);
    Pair pair;
    ASSERT_TRUE(pair.Start(dir, c.shards, c.split, c.transport));
    auto r = pair.client().Generate(IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size())));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->token_ids, ref.greedy);
  }
}

// With --transport ucx and every shard on loopback, the worker's UCX TCP
// listeners are on loopback only (they were on every interface: the
// worker's UCX_NET_DEVICES is now the targets' devices).
TEST(Serving, UcxOnLoopbackListensOnLoopbackOnly) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v3_tiny";
  const Reference ref = LoadReference(dir);
  Pair pair;
  ASSERT_TRUE(pair.Start(dir, 1, "tp", "ucx"));
  auto r = pair.client().Generate(IdsRequest(ref.prompt, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<std::string> listening = testing::ListeningAddresses(pair.worker().pid());
  EXPECT_GE(listening.size(), 1u);
  for (const std::string& a : listening)
    EXPECT_TRUE(testing::IsLoopbackAddress(a))
        << "the worker listens on " << a << " beyond loopback";
}

// Shards that take 3 tokens per call: the worker's prefill chunks and
// batched decode steps (more tokens) go as several calls and give the same
// tokens, alone and with concurrent clients; with Expert Deferral (three
// calls in flight at once) too, within the shm slots (tokens: its own).
TEST(Serving, BatchesOverTheShardsMaxTokensGoAsSeveralCalls) {
  const std::string dir = testing::FixturesDir() + "/deepseek_v3_tiny";
  const Reference ref = LoadReference(dir);
  ASSERT_GT(ref.prompt.size(), 3u);
  for (const char* transport : {"shm", "grpc", "shm+defer"}) {
    SCOPED_TRACE(transport);
    const bool defer = std::string(transport) == "shm+defer";
    Pair pair;
    ASSERT_TRUE(pair.Start(
        dir, 2, "tp", defer ? "shm" : transport,
        defer ? std::vector<std::string>{"--defer-experts=1"} : std::vector<std::string>{},
        {"--max-tokens=3"}));
    const auto req = IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size()));
    std::vector<std::vector<int32_t>> got(6);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < got.size(); ++i)
      threads.emplace_back([&, i] {
        auto r = pair.client().Generate(req);
        if (r.ok())
          got[i] = r->token_ids;
        else
          ADD_FAILURE() << r.status();
      });
    for (auto& t : threads) t.join();
    for (const auto& g : got) EXPECT_EQ(g, defer ? got[0] : ref.greedy);
    EXPECT_EQ(got[0].size(), ref.greedy.size());
  }
}

// A tokenizer.json this build cannot run (here a normalizer it lacks) does
// not stop the worker: token ids are served, and the text calls name why
// they are refused.
TEST(Serving, AnUnsupportedTokenizerLeavesTokenIdsServed) {
  testing::TempDir dir;
  const std::string model = dir.file("model");
  std::filesystem::copy(testing::FixturesDir() + "/ds3_fortunes", model);
  {
    auto j = nlohmann::json::parse(std::ifstream(model + "/tokenizer.json"));
    j["normalizer"] = {{"type", "NFKC"}};
    std::ofstream(model + "/tokenizer.json") << j.dump();
  }
  const Reference ref = LoadReference(model);
  Pair pair;
  pair.set_capture_logs();
  ASSERT_TRUE(pair.Start(model));
  auto r = pair.client().Generate(IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size())));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_ids, ref.greedy);
  EXPECT_TRUE(r->text.empty());
  auto t = pair.client().Tokenize("Love is");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("the model's tokenizer is not supported here"));
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("normalizer type \"NFKC\""));
  // The client is not shown the server's path (the log is).
  EXPECT_THAT(std::string(t.status().message()), ::testing::Not(HasSubstr(model)));
  api::v1::GenerateRequest req;
  req.set_prompt("Love is");
  req.set_max_tokens(2);
  auto g = pair.client().Generate(req);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("send prompt_ids"));
  EXPECT_TRUE(testing::FileSays(pair.log("worker"),
                                "warning: the model's tokenizer is not "
                                "supported here"));
}

class TrainedModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FixturesDir() + "/ds3_fortunes";
    ASSERT_TRUE(pair_.Start(dir_));
  }
  std::string dir_;
  Pair pair_;
};

// The tiny trained model continues its prompt exactly as transformers did,
// text and all, through text prompts and the server's tokenizer.
TEST_F(TrainedModel, ProducesItsReferenceContinuation) {
  const Reference ref = LoadReference(dir_);
  auto r = pair_.client().Generate(IdsRequest(ref.prompt, static_cast<int>(ref.greedy.size())));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->token_ids, ref.greedy);
  auto tok = Tokenizer::FromFile(dir_ + "/tokenizer.json");
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(r->text, *(*tok)->Decode(ref.greedy, /*skip_special_tokens=*/true));
  // Text in, text out: same tokens when the prompt text is tokenized by the server.
  auto text = (*tok)->Decode(ref.prompt, /*skip_special_tokens=*/true);
  ASSERT_TRUE(text.ok());
  api::v1::GenerateRequest req;
  req.set_prompt(*text);
  req.set_add_special_tokens(ref.prompt[0] == 0);  // BOS
  req.set_max_tokens(static_cast<int>(ref.greedy.size()));
  req.set_ignore_eos(true);
  auto t = pair_.client().Generate(req);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->token_ids, ref.greedy);
  EXPECT_FALSE(t->text.empty());
}

// 16 concurrent clients, different prompts: each gets exactly what it gets
// alone; the same seed gives the same sampled text.
TEST_F(TrainedModel, ConcurrentClientsGetTheirSoloOutputs) {
  const std::vector<std::string> starts = {"Love is",   "A wise man", "The trouble with",
                                           "Never",     "Why",        "In the beginning",
                                           "Computers", "If you",     "Money",
                                           "Time",      "The best",   "Life",
                                           "When",      "A fool",     "Work",
                                           "Nothing"};
  std::vector<api::v1::GenerateRequest> reqs;
  for (size_t i = 0; i < starts.size(); ++i) {
    api::v1::GenerateRequest r;
    r.set_prompt(starts[i]);
    r.set_add_special_tokens(true);
    r.set_max_tokens(12);
    if (i % 2) {
      r.mutable_sampling()->set_temperature(0.9f);
      r.mutable_sampling()->set_seed(100 + i);
    }
    reqs.push_back(r);
  }
  std::vector<std::string> solo;
  for (const auto& r : reqs) {
    auto g = pair_.client().Generate(r);
    ASSERT_TRUE(g.ok()) << g.status();
    solo.push_back(g->text);
  }
  std::vector<std::string> together(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i)
    threads.emplace_back([&, i] {
      auto g = pair_.client().Generate(reqs[i]);
      together[i] = g.ok() ? g->text : "ERROR " + g.status().ToString();
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(together, solo);
  auto again = pair_.client().Generate(reqs[1]);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->text, solo[1]);
}

TEST_F(TrainedModel, BadInputIsRefusedByFieldAndServingGoesOn) {
  auto expect = [&](api::v1::GenerateRequest r, const char* field) {
    auto g = pair_.client().Generate(r);
    ASSERT_FALSE(g.ok()) << field;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
    EXPECT_THAT(std::string(g.status().message()), HasSubstr(field));
  };
  api::v1::GenerateRequest ok;
  ok.set_prompt("Love is");
  ok.set_max_tokens(4);
  api::v1::GenerateRequest r = ok;
  r.set_prompt("");
  expect(r, "prompt");
  r = ok;
  r.set_max_tokens(0);
  expect(r, "max_tokens");
  r = ok;
  r.set_max_tokens(-5);
  expect(r, "max_tokens");
  r = IdsRequest({5, 99999}, 4);
  expect(r, "99999");
  // Malformed UTF-8 reaches the server's checks (it was a message gRPC could
  // not parse: INTERNAL with no message).
  r = ok;
  r.set_prompt("caf\xe9");
  expect(r, "prompt");
  r = ok;
  r.add_stop("\xff");
  expect(r, "stop[0] is not valid UTF-8");
  r = ok;
  for (int i = 0; i < 100000; ++i) r.add_stop("\x01");
  expect(r, "stop: 100000 strings; at most 64");
  {
    auto ids = pair_.client().Tokenize("caf\xe9");
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
    EXPECT_THAT(std::string(ids.status().message()), HasSubstr("text"));
  }
  r = ok;
  r.mutable_sampling()->set_temperature(std::nanf(""));
  expect(r, "temperature");
  r = ok;
  r.mutable_sampling()->set_temperature(-0.5f);
  expect(r, "temperature");
  r = ok;
  r.mutable_sampling()->set_top_p(0.0f);
  expect(r, "top_p");
  r = ok;
  r.mutable_sampling()->set_top_p(1.01f);
  expect(r, "top_p");
  r = ok;
  r.mutable_sampling()->set_top_k(-1);
  expect(r, "top_k");
  auto info = pair_.client().ModelInfo();
  ASSERT_TRUE(info.ok());
  r = IdsRequest(std::vector<int32_t>(static_cast<size_t>(info->max_context()) + 5, 7), 4);
  expect(r, "context");
  auto fine = pair_.client().Generate(ok);
  EXPECT_TRUE(fine.ok()) << fine.status();
}

TEST_F(TrainedModel, CancelAndDeadlineFreeKvBlocks) {
  api::v1::GenerateRequest r;
  r.set_prompt("A wise man once said");
  r.set_max_tokens(900);
  r.set_ignore_eos(true);
  std::atomic<int64_t> max_used{0};
  int chunks = 0;
  auto g = pair_.client().Generate(r, [&](const api::v1::GenerateResponse&) {
    if (++chunks == 5) {
      auto s = pair_.client().Stats();
      if (s.ok()) max_used = s->kv_blocks_used();
      return false;  // cancel mid-stream
    }
    return true;
  });
  EXPECT_EQ(g.status().code(), absl::StatusCode::kCancelled);
  EXPECT_GT(max_used.load(), 0);
  auto wait_free = [&] {
    for (int i = 0; i < 200; ++i) {
      auto s = pair_.client().Stats();
      if (s.ok() && s->kv_blocks_used() == 0 && s->running() == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  EXPECT_TRUE(wait_free());
  auto d = pair_.client().Generate(r, nullptr, absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded) << d.status();
  EXPECT_TRUE(wait_free());
}

// 100 clients at once: each request completes with the right token count or
// is refused with RESOURCE_EXHAUSTED; nothing leaks.
TEST_F(TrainedModel, HundredClientsAtOnce) {
  std::atomic<int> completed{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 100; ++i)
    threads.emplace_back([&, i] {
      ClientOptions o;
      o.target = pair_.worker().target();
      auto c = Client::Connect(o);
      if (!c.ok()) {
        ++other;
        return;
      }
      api::v1::GenerateRequest r;
      r.set_prompt(i % 2 ? "Love is" : "Never");
      r.set_max_tokens(8);
      r.set_ignore_eos(true);
      auto g = (*c)->Generate(r);
      if (g.ok() && g->token_ids.size() == 8 && g->usage.completion_tokens() == 8)
        ++completed;
      else if (g.status().code() == absl::StatusCode::kResourceExhausted)
        ++refused;
      else
        ++other;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(completed.load() + refused.load(), 100);
  EXPECT_GE(completed.load(), 64);  // the queue holds 64 beyond the running batch
  auto s = pair_.client().Stats();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->kv_blocks_used(), 0);
  EXPECT_EQ(s->running() + s->waiting(), 0);
}

// Expert service killed: requests fail UNAVAILABLE within a bound, health goes
// NOT_SERVING; after a restart on the same port, requests succeed again.
TEST_F(TrainedModel, ExpertServiceDeathAndRecovery) {
  api::v1::GenerateRequest r;
  r.set_prompt("Love is");
  r.set_max_tokens(4);
  ASSERT_TRUE(pair_.client().Generate(r).ok());
  // grpc.health.v1 answers for the service's own name as for the server
  // (it was NOT_FOUND), and follows it below.
  auto named = pair_.client().Healthy("hmoe.api.v1.Generation");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(*named);
  pair_.expert().Kill(SIGKILL);
  const absl::Time t0 = absl::Now();
  auto g = pair_.client().Generate(r);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnavailable) << g.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  bool not_serving = false;
  for (int i = 0; i < 50 && !not_serving; ++i) {
    auto h = pair_.client().Healthy();
    auto hn = pair_.client().Healthy("hmoe.api.v1.Generation");
    not_serving = h.ok() && !*h && hn.ok() && !*hn;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(not_serving);
  ASSERT_TRUE(pair_.expert().Restart());
  EXPECT_TRUE(ServedWithin5s(pair_.client(), r));
  bool serving = false;
  for (int i = 0; i < 50 && !serving; ++i) {
    auto h = pair_.client().Healthy();
    serving = h.ok() && *h;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(serving);
}

// Expert service hung (stopped): the worker's expert call runs out its
// --expert-timeout-ms and the client sees UNAVAILABLE (api.proto), not a
// DEADLINE_EXCEEDED it never asked for. Four requests at once cost one
// timeout, not four (the others fail fast behind it); once continued,
// requests succeed.
TEST_F(TrainedModel, HungExpertServiceIsUnavailableToTheClient) {
  api::v1::GenerateRequest r;
  r.set_prompt("Love is");
  r.set_max_tokens(4);
  ASSERT_TRUE(pair_.client().Generate(r).ok());
  pair_.expert().Signal(SIGSTOP);
  const absl::Time t0 = absl::Now();
  std::vector<absl::Status> got(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] { got[i] = pair_.client().Generate(r).status(); });
  for (auto& t : threads) t.join();
  int timed_out = 0;
  for (const absl::Status& g : got) {
    EXPECT_EQ(g.code(), absl::StatusCode::kUnavailable) << g;
    timed_out += std::string(g.message()).find("did not answer within 2s") != std::string::npos;
  }
  EXPECT_GE(timed_out, 1);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));  // one 2 s expert timeout, not four
  // Once health says NOT_SERVING and the miss's fail-fast second is over, a
  // new request still costs no timeout (it cost the full 2 s): the shard is
  // known down until a health check reaches it.
  bool not_serving = false;
  for (int i = 0; i < 50 && !not_serving; ++i) {
    auto h = pair_.client().Healthy();
    not_serving = h.ok() && !*h;
    if (!not_serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(not_serving);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  for (int i = 0; i < 3; ++i) {
    const absl::Time t1 = absl::Now();
    const absl::Status down = pair_.client().Generate(r).status();
    EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
    EXPECT_THAT(std::string(down.message()), HasSubstr("last health check")) << down;
    EXPECT_LT(absl::Now() - t1, absl::Milliseconds(500)) << down;
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
  }
  pair_.expert().Signal(SIGCONT);
  EXPECT_TRUE(ServedWithin5s(pair_.client(), r));
}

// The Python client (sdk/python, Debian's python3-grpcio) gets the same text.
TEST_F(TrainedModel, PythonClientAgrees) {
  if (std::system("/usr/bin/python3 -c 'import grpc' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "Debian's python3-grpcio is not installed";
  api::v1::GenerateRequest r;
  r.set_prompt("Love is");
  r.set_add_special_tokens(true);
  r.set_max_tokens(30);
  auto want = pair_.client().Generate(r);
  ASSERT_TRUE(want.ok()) << want.status();
  testing::TempDir tmp;
  const std::string cmd =
      absl::StrCat("HMOE_PYTHON_STUBS=", HMOE_BINARY_DIR, "/python /usr/bin/python3 ",
                   HMOE_SOURCE_DIR, "/sdk/python/hmoe_client.py --server ", pair_.worker().target(),
                   " generate 'Love is' --add-special-tokens --max-tokens 30 > ", tmp.file("out"),
                   " 2>", tmp.file("err"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto read = [&](const std::string& name) {
    std::ifstream in(tmp.file(name));
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(read("out"), "Love is" + want->text + "\n");

  // With a stop string (bytes on the wire) and a regular package named
  // `proto` ahead on the path (proto-plus has one): the stubs still load.
  ASSERT_GT(want->text.size(), 12u);
  const std::string stop = want->text.substr(8, 3);
  ASSERT_EQ(stop.find('\''), std::string::npos);
  r.add_stop(stop);
  auto stopped = pair_.client().Generate(r);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  std::filesystem::create_directories(tmp.file("shadow/proto"));
  std::ofstream(tmp.file("shadow/proto/__init__.py")) << "\n";
  const std::string py =
      absl::StrCat("PYTHONPATH=", tmp.file("shadow"), " HMOE_PYTHON_STUBS=", HMOE_BINARY_DIR,
                   "/python /usr/bin/python3 ", HMOE_SOURCE_DIR,
                   "/sdk/python/hmoe_client.py --server ", pair_.worker().target());
  const std::string cmd2 =
      absl::StrCat(py, " generate 'Love is' --add-special-tokens --max-tokens 30 --stop '", stop,
                   "' > ", tmp.file("out2"), " 2>", tmp.file("err2"));
  ASSERT_EQ(std::system(cmd2.c_str()), 0) << cmd2 << ": " << read("err2");
  EXPECT_EQ(read("out2"), "Love is" + stopped->text + "\n");
  auto ids = pair_.client().Tokenize("Love is");
  ASSERT_TRUE(ids.ok()) << ids.status();
  const std::string cmd3 =
      absl::StrCat(py, " tokenize 'Love is' > ", tmp.file("out3"), " 2>", tmp.file("err3"));
  ASSERT_EQ(std::system(cmd3.c_str()), 0) << cmd3 << ": " << read("err3");
  EXPECT_EQ(read("out3"), absl::StrCat("[", absl::StrJoin(*ids, ", "), "]\n"));
}

// SIGTERM: the in-flight request finishes, then the worker exits 0.
TEST_F(TrainedModel, SigtermDrains) {
  api::v1::GenerateRequest r;
  r.set_prompt("A wise man once said");
  r.set_max_tokens(300);
  r.set_ignore_eos(true);
  std::atomic<bool> started{false}, returned{false};
  absl::StatusOr<GenerateResult> result;
  std::thread t([&] {
    result = pair_.client().Generate(r, [&](const api::v1::GenerateResponse&) {
      started = true;
      return true;
    });
    returned = true;
  });
  for (int i = 0; i < 3000 && !started && !returned; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!started) {
    t.join();
    FAIL() << "generation never started: " << result.status();
  }
  const int status = pair_.worker().Kill(SIGTERM);
  t.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->token_ids.size(), 300u);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace hmoe
