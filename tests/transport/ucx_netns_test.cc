// UCX across a real network: the service in one network namespace, the
// worker (hmoe-expert-bench) in another, joined by a veth pair, UCX_TLS=tcp.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"

namespace hmoe {
namespace {

int Sh(const std::string& cmd) {
  const int st = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

class Netns {
 public:
  Netns() {
    const int id = static_cast<int>(getpid() % 200) + 20;
    a_ = absl::StrCat("hmoe-a-", getpid());
    b_ = absl::StrCat("hmoe-b-", getpid());
    const std::string va = absl::StrCat("hva", getpid() % 100000);
    const std::string vb = absl::StrCat("hvb", getpid() % 100000);
    ip_a_ = absl::StrCat("10.213.", id, ".1");
    const std::string ip_b = absl::StrCat("10.213.", id, ".2");
    if (Sh("ip netns add " + a_) != 0) return;
    created_a_ = true;
    if (Sh("ip netns add " + b_) != 0) return;
    created_b_ = true;
    ok_ = Sh(absl::StrCat("ip link add ", va, " type veth peer name ", vb)) == 0 &&
          Sh(absl::StrCat("ip link set ", va, " netns ", a_)) == 0 &&
          Sh(absl::StrCat("ip link set ", vb, " netns ", b_)) == 0 &&
          Sh(absl::StrCat("ip -n ", a_, " addr add ", ip_a_, "/24 dev ", va)) == 0 &&
          Sh(absl::StrCat("ip -n ", b_, " addr add ", ip_b, "/24 dev ", vb)) == 0 &&
          Sh(absl::StrCat("ip -n ", a_, " link set ", va, " up")) == 0 &&
          Sh(absl::StrCat("ip -n ", b_, " link set ", vb, " up")) == 0 &&
          Sh(absl::StrCat("ip -n ", a_, " link set lo up")) == 0 &&
          Sh(absl::StrCat("ip -n ", b_, " link set lo up")) == 0;
  }
  ~Netns() {
    if (created_a_) Sh("ip netns del " + a_);
    if (created_b_) Sh("ip netns del " + b_);
  }
  bool ok() const { return ok_; }
  const std::string& a() const { return a_; }
  const std::string& b() const { return b_; }
  const std::string& ip_a() const { return ip_a_; }

 private:
  std::string a_, b_, ip_a_;
  bool created_a_ = false, created_b_ = false, ok_ = false;
};

TEST(UcxNetns, ServiceAndWorkerInDifferentNamespacesOverVeth) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for ip netns";
  if (Sh("ip -V") != 0) GTEST_SKIP() << "no ip(8)";
  Netns ns;
  if (!ns.ok()) GTEST_SKIP() << "cannot create network namespaces with a veth pair here";
  ::hmoe::testing::TempDir dir;
  const std::string model = ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny";
  ::hmoe::testing::ServiceProcess proc;
  setenv("UCX_TLS", "tcp", 1);  // the service inherits it: no shared-memory shortcut
  const bool started = proc.Start({"--model-dir=" + model, "--no-shm", "--shard=0/1"},
                                  dir.file("port"), 0, ns.ip_a(), {"ip", "netns", "exec", ns.a()});
  unsetenv("UCX_TLS");
  setenv("UCX_TLS", "tcp,sm,self", 1);
  ASSERT_TRUE(started);
  const std::string cmd = absl::StrCat("ip netns exec ", ns.b(), " env UCX_TLS=tcp ",
                                       ::hmoe::testing::BenchBinary(), " --targets=", proc.target(),
                                       " --transport=ucx --tokens=1,9 --iters=5 --warmup=1",
                                       " --verify-model-dir=", model, " 2>&1");
  const auto [st, output] = ::hmoe::testing::RunCommand(cmd);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << output;
  EXPECT_NE(output.find("\"transport\": \"ucx\""), std::string::npos) << output;
  EXPECT_NE(output.find("\"tokens\": 9"), std::string::npos) << output;
}

}  // namespace
}  // namespace hmoe
