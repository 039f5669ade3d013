// Shared-secret tokens for our gRPC planes (the expert service's control and
// data planes, the worker's client API). A token lives in a file readable by
// its owner only, like an ssh key; both ends read the same file (or a copy).
// On the wire it is the `authorization: Bearer <token>` metadata of every call
// (common/transport/grpc_auth.h). A token authenticates; it does not encrypt:
// across untrusted networks put the planes on a private network or a tunnel.
//
// A token file holds one token per line. A server accepts every token in its
// file; a client sends the first one. So a token rotates without refused
// calls: put the new token first and the old one second, reload the servers
// (SIGHUP), then the clients (the worker reloads its expert token on SIGHUP;
// `hmoe` and the SDKs read their file when they start or connect), and once
// every client sends the new one, drop the old line and reload the servers
// again.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hmoe {

inline constexpr size_t kMinAuthTokenBytes = 16;
inline constexpr size_t kMaxAuthTokenBytes = 4096;
inline constexpr size_t kMaxAuthTokensPerFile = 8;

// The bytes of a small credential file (a token, a certificate, a key): a
// regular file, symlinks followed, of at most `max_bytes`; `what` begins
// every error message (e.g. "auth token file /etc/hmoe/t"). NOT_FOUND /
// PERMISSION_DENIED when it cannot be opened, FAILED_PRECONDITION when it is
// not a regular file (a FIFO is refused without blocking), INVALID_ARGUMENT
// when larger than `max_bytes`. `*mode` (if given) gets its permission bits.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, const std::string& what,
                                               int64_t max_bytes, uint32_t* mode = nullptr);

// Reads the tokens in `path`, one per line, in file order; blank lines and
// whitespace at line ends are ignored. Errors name the path (and the line
// when the file has several):
//   NOT_FOUND / PERMISSION_DENIED  the file cannot be opened;
//   FAILED_PRECONDITION            not a regular file, or group / other
//                                  users have any access (chmod 600 it;
//                                  through a symlink, the target's mode);
//   INVALID_ARGUMENT               no token, more than kMaxAuthTokensPerFile,
//                                  a token shorter than kMinAuthTokenBytes or
//                                  longer than kMaxAuthTokenBytes, or a byte
//                                  outside printable ASCII without space
//                                  (0x21-0x7e).
absl::StatusOr<std::vector<std::string>> ReadAuthTokensFile(const std::string& path);

// The token a client sends: the first of ReadAuthTokensFile(path).
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path);

// The tokens in force: those a server accepts, the first of which a client
// sends. Thread-safe; Reload replaces them while calls are being checked
// (the servers do on SIGHUP). Default-constructed: none, auth off, and it
// stays off (a reload cannot turn it on or off).
class AuthTokens {
 public:
  AuthTokens() = default;
  // `tokens` non-empty: auth on.
  explicit AuthTokens(std::vector<std::string> tokens);
  // Auth on with the tokens in `path` (ReadAuthTokensFile's errors).
  static absl::StatusOr<std::shared_ptr<AuthTokens>> FromFile(const std::string& path);

  bool enabled() const { return enabled_; }
  // Whether `token` equals one of the tokens in force (each compared in time
  // that depends on the lengths only). False when auth is off.
  bool Accepts(absl::string_view token) const;
  // The first token in force (what a client sends); empty when auth is off.
  std::string first() const;
  // Re-reads `path`: on success its tokens are in force and their count is
  // returned; on any error (ReadAuthTokensFile's, or FAILED_PRECONDITION
  // when auth is off) the tokens in force stay.
  absl::StatusOr<size_t> Reload(const std::string& path);
  // Reload, said in one log line: "PATH reloaded: N token(s)" or "kept the
  // tokens in force: WHY" (the servers' SIGHUP handlers).
  std::string ReloadForLog(const std::string& path);

 private:
  bool enabled_ = false;
  mutable std::mutex mu_;
  std::vector<std::string> tokens_;  // guarded by mu_
};

// Whether a gRPC listen address (HOST:PORT, or unix:PATH) is reachable from
// this host only (127.x, localhost, [::1], a unix socket): servers warn when
// they listen anywhere else without a token.
bool IsLoopbackListenAddress(absl::string_view listen);

// Whether `a` and `b` are equal, in time that depends on their lengths only.
bool AuthTokensEqual(absl::string_view a, absl::string_view b);

}  // namespace hmoe
