// TLS on the expert service's gRPC port (--tls-cert-file / --tls-key-file,
// mutual with --tls-client-ca-file), as real processes on loopback over
// every transport; certificates: tests/fixtures/tls (make_certs.sh).
#include <sys/stat.h>
#include <sys/wait.h>

#include <fstream>
#include <string>
#include <vector>

#include "common/transport/grpc_tls.h"
#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::MakeRandomCall;
using ::hmoe::testing::ServiceProcess;
using ::hmoe::testing::TempDir;

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }
std::string Pem(const std::string& name) { return ::hmoe::testing::FixturesDir() + "/tls/" + name; }

class TlsTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override { setenv("UCX_TLS", "tcp,sm,self", 0); }
  // Connects a pool with `tls` (plaintext when none is set) and runs one
  // call of 3 tokens through it.
  // `expect_ok`: a long connect timeout (a loaded machine); else 2 s (a
  // refused handshake is retried until then).
  absl::Status ConnectAndRun(const ServiceProcess& proc, const TlsClientFiles& tls,
                             bool expect_ok) {
    ExpertPoolOptions po;
    po.targets = {proc.target()};
    po.transport = GetParam();
    po.connect_timeout = expect_ok ? absl::Seconds(30) : absl::Seconds(2);
    if (tls.enabled()) {
      auto creds = ChannelCredentialsFrom(tls);
      if (!creds.ok()) return creds.status();
      po.credentials = *creds;
    }
    auto pool = ExpertPool::Connect(po);
    if (!pool.ok()) return pool.status();
    const ShardInfo& info = (*pool)->model();
    auto call = MakeRandomCall(info, info.moe_layers[0], 3, 1);
    std::vector<float> out(static_cast<size_t>(3 * info.hidden));
    return (*pool)->Run(call.call(), out.data(), absl::Now() + absl::Seconds(10));
  }
};

TEST_P(TlsTest, ServerCertificateVerifiedByItsCa) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(proc.Start({"--model-dir=" + ModelDir(), "--tls-cert-file=" + Pem("server.pem"),
                          "--tls-key-file=" + Pem("server.key")},
                         dir.file("port")));
  const absl::Status ok = ConnectAndRun(proc, {Pem("ca.pem"), "", ""}, true);
  EXPECT_TRUE(ok.ok()) << ok;
  // Plaintext against a TLS port, and a CA that did not sign the server's
  // certificate: no handshake, no call.
  EXPECT_FALSE(ConnectAndRun(proc, {}, false).ok());
  absl::Status other = ConnectAndRun(proc, {Pem("other_ca.pem"), "", ""}, false);
  EXPECT_EQ(other.code(), absl::StatusCode::kUnavailable) << other;
}

TEST_P(TlsTest, MutualTlsRefusesClientsWithoutACertificate) {
  TempDir dir;
  ServiceProcess proc;
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + ModelDir(), "--tls-cert-file=" + Pem("server.pem"),
                  "--tls-key-file=" + Pem("server.key"), "--tls-client-ca-file=" + Pem("ca.pem")},
                 dir.file("port")));
  absl::Status no_cert = ConnectAndRun(proc, {Pem("ca.pem"), "", ""}, false);
  EXPECT_EQ(no_cert.code(), absl::StatusCode::kUnavailable) << no_cert;
  absl::Status with_cert =
      ConnectAndRun(proc, {Pem("ca.pem"), Pem("client.pem"), Pem("client.key")}, true);
  EXPECT_TRUE(with_cert.ok()) << with_cert;
}

INSTANTIATE_TEST_SUITE_P(Transports, TlsTest,
                         ::testing::Values(TransportKind::kGrpc, TransportKind::kShm,
                                           TransportKind::kUcx),
                         [](const auto& p) { return std::string(TransportKindName(p.param)); });

TEST(TlsFiles, BadFilesAreRefusedNamingTheFlag) {
  TempDir dir;
  const std::string not_pem = dir.file("not.pem");
  std::ofstream(not_pem) << "hello\n";
  struct Case {
    TlsServerFiles files;
    absl::StatusCode code;
    std::string says;
  };
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  const Case cases[] = {
      {{Pem("server.pem"), dir.file("fifo"), ""},
       absl::StatusCode::kFailedPrecondition,
       "--tls-key-file " + dir.file("fifo") + ": not a regular file"},
      {{Pem("server.pem"), "", ""},
       absl::StatusCode::kInvalidArgument,
       "--tls-cert-file and --tls-key-file go together"},
      {{dir.file("missing.pem"), Pem("server.key"), ""},
       absl::StatusCode::kNotFound,
       "--tls-cert-file " + dir.file("missing.pem")},
      {{Pem("server.pem"), not_pem, ""},
       absl::StatusCode::kInvalidArgument,
       "--tls-key-file " + not_pem + ": no PEM block"},
      {{Pem("server.pem"), Pem("server.key"), dir.file("nope")},
       absl::StatusCode::kNotFound,
       "--tls-client-ca-file"},
  };
  for (const Case& c : cases) {
    auto creds = ServerCredentialsFrom(c.files);
    ASSERT_FALSE(creds.ok()) << c.says;
    EXPECT_EQ(creds.status().code(), c.code) << creds.status();
    EXPECT_THAT(creds.status().message(), ::testing::HasSubstr(c.says));
  }
  auto client = ChannelCredentialsFrom({Pem("ca.pem"), Pem("client.pem"), ""}, "--expert-tls");
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(client.status().message(), ::testing::HasSubstr("--expert-tls-cert-file and"));
  // The service stops at start (exit 2) on the same mistakes.
  ServiceProcess proc;
  EXPECT_FALSE(proc.Start({"--model-dir=" + ModelDir(), "--tls-cert-file=" + Pem("server.pem")},
                          dir.file("port")));
  EXPECT_TRUE(WIFEXITED(proc.exit_status()) && WEXITSTATUS(proc.exit_status()) == 2)
      << proc.exit_status();
}

}  // namespace
}  // namespace hmoe
