// Shared-secret tokens for our gRPC planes (the expert service's control and
// data planes, the worker's client API). A token lives in a file readable by
// its owner only, like an ssh key; both ends read the same file (or a copy).
// On the wire it is the `authorization: Bearer <token>` metadata of every call
// (common/transport/grpc_auth.h). A token authenticates; it does not encrypt:
// across untrusted networks put the planes on a private network or a tunnel.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hmoe {

inline constexpr size_t kMinAuthTokenBytes = 16;
inline constexpr size_t kMaxAuthTokenBytes = 4096;

// The bytes of a small credential file (a token, a certificate, a key): a
// regular file, symlinks followed, of at most `max_bytes`; `what` begins
// every error message (e.g. "auth token file /etc/hmoe/t"). NOT_FOUND /
// PERMISSION_DENIED when it cannot be opened, FAILED_PRECONDITION when it is
// not a regular file (a FIFO is refused without blocking), INVALID_ARGUMENT
// when larger than `max_bytes`. `*mode` (if given) gets its permission bits.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, const std::string& what,
                                               int64_t max_bytes, uint32_t* mode = nullptr);

// Reads the token in `path`: the file's bytes without trailing whitespace
// (a final newline). Errors name the path:
//   NOT_FOUND / PERMISSION_DENIED  the file cannot be opened;
//   FAILED_PRECONDITION            not a regular file, or group / other
//                                  users have any access (chmod 600 it;
//                                  through a symlink, the target's mode);
//   INVALID_ARGUMENT               shorter than kMinAuthTokenBytes, longer
//                                  than kMaxAuthTokenBytes, or a byte outside
//                                  printable ASCII without space (0x21-0x7e).
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path);

// Whether a gRPC listen address (HOST:PORT, or unix:PATH) is reachable from
// this host only (127.x, localhost, [::1], a unix socket): servers warn when
// they listen anywhere else without a token.
bool IsLoopbackListenAddress(absl::string_view listen);

// Whether `a` and `b` are equal, in time that depends on their lengths only.
bool AuthTokensEqual(absl::string_view a, absl::string_view b);

}  // namespace hmoe
