// TLS for our gRPC planes (the expert service's control and data planes,
// the worker's client API): server and channel credentials from PEM files.
// With TLS the bearer tokens (grpc_auth.h) travel encrypted; the UCX and
// shared-memory data planes are not affected (UCX is not encrypted).
// Header-only, like grpc_auth.h, so thin clients (sdk/) use it without the
// transports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth_token.h"
#include "common/flags.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace hmoe {

// A server's certificate chain and key (both, or neither: plaintext), and
// optionally the CA that client certificates must chain to (mutual TLS:
// clients without one are refused during the handshake).
struct TlsServerFiles {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  bool enabled() const {
    return !cert_file.empty() || !key_file.empty() || !client_ca_file.empty();
  }
};

// A client's view: the CA the server's certificate must chain to (empty with
// TLS on: gRPC's bundled roots, or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH), and a
// client certificate and key for mutual TLS (both, or neither). TLS is on
// when any is set.
struct TlsClientFiles {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// The TLS flags on `fs`: PREFIX-cert-file, PREFIX-key-file and
// PREFIX-client-ca-file (server) / PREFIX-ca-file (client), PREFIX without
// the dashes ("tls", "expert-tls").
inline void AddTlsFlags(FlagSet& fs, TlsServerFiles* f, const std::string& prefix = "tls") {
  fs.String(prefix + "-cert-file", &f->cert_file, "PEM",
            "TLS: this certificate chain (with the key file)");
  fs.String(prefix + "-key-file", &f->key_file, "PEM", "TLS: the certificate's private key");
  fs.String(prefix + "-client-ca-file", &f->client_ca_file, "PEM",
            "mutual TLS: clients need a certificate signed by this CA");
}
inline void AddTlsFlags(FlagSet& fs, TlsClientFiles* f, const std::string& prefix = "tls") {
  fs.String(prefix + "-ca-file", &f->ca_file, "PEM", "TLS on, the server verified against this CA");
  fs.String(prefix + "-cert-file", &f->cert_file, "PEM",
            "mutual TLS: the client certificate (with the key file)");
  fs.String(prefix + "-key-file", &f->key_file, "PEM", "mutual TLS: the client key");
}

// The PEM text of `path` (ReadCredentialFile, at most kMaxPemBytes); `what`
// names the flag in errors; INVALID_ARGUMENT when it holds no PEM block.
inline constexpr int64_t kMaxPemBytes = 1 << 20;
inline absl::StatusOr<std::string> ReadPemFile(const std::string& path, const std::string& what) {
  const std::string where = absl::StrCat(what, " ", path);
  auto pem = ReadCredentialFile(path, where, kMaxPemBytes);
  if (!pem.ok()) return pem.status();
  if (pem->find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no PEM block in it"));
  }
  return pem;
}

// Insecure credentials when `f` is not enabled; else TLS from the files.
// INVALID_ARGUMENT when only one of cert / key is given.
inline absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(
    const TlsServerFiles& f, const std::string& flag_prefix = "--tls") {
  if (!f.enabled()) return grpc::InsecureServerCredentials();
  if (f.cert_file.empty() || f.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "-cert-file and ", flag_prefix,
                                                   "-key-file go together (TLS needs both)"));
  }
  grpc::SslServerCredentialsOptions o(
      f.client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                               : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPemFile(f.cert_file, flag_prefix + "-cert-file");
  if (!cert.ok()) return cert.status();
  auto key = ReadPemFile(f.key_file, flag_prefix + "-key-file");
  if (!key.ok()) return key.status();
  pair.cert_chain = std::move(*cert);
  pair.private_key = std::move(*key);
  o.pem_key_cert_pairs.push_back(std::move(pair));
  if (!f.client_ca_file.empty()) {
    auto ca = ReadPemFile(f.client_ca_file, flag_prefix + "-client-ca-file");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = std::move(*ca);
  }
  return grpc::SslServerCredentials(o);
}

// Insecure credentials when `f` is not enabled; else TLS from the files.
inline absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFrom(
    const TlsClientFiles& f, const std::string& flag_prefix = "--tls") {
  if (!f.enabled()) return grpc::InsecureChannelCredentials();
  if (f.cert_file.empty() != f.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "-cert-file and ", flag_prefix,
                                                   "-key-file go together (a client certificate "
                                                   "needs its key)"));
  }
  grpc::SslCredentialsOptions o;
  if (!f.ca_file.empty()) {
    auto ca = ReadPemFile(f.ca_file, flag_prefix + "-ca-file");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = std::move(*ca);
  }
  if (!f.cert_file.empty()) {
    auto cert = ReadPemFile(f.cert_file, flag_prefix + "-cert-file");
    if (!cert.ok()) return cert.status();
    auto key = ReadPemFile(f.key_file, flag_prefix + "-key-file");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = std::move(*cert);
    o.pem_private_key = std::move(*key);
  }
  return grpc::SslCredentials(o);
}

}  // namespace hmoe
