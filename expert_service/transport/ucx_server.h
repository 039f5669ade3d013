// The UCX data plane's service end (the protocol: common/transport/ucx_wire.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/moe_call.h"
#include "common/transport/ucx_wire.h"

namespace hmoe {

struct UcxServerOptions {
  // argv of the address checker: a child process that reads client worker
  // addresses and answers whether this host's UCX creates an endpoint to
  // each (UcxAddressCheckMain; the service runs itself with
  // --check-ucx-address). UCX 1.13 aborts the process on a malformed address
  // (an assertion in its address parser), so every UcxConnect address is
  // tried in the child first: a bad one ends that call INVALID_ARGUMENT and
  // that child (restarted by the next connect), not the service. The child
  // starts with the server (Create fails if it cannot) and keeps UCX up, so
  // a check costs one endpoint creation. It predicts the service's own parse
  // of the same bytes (both zero-padded); it cannot vouch for an address
  // that parses differently against a changed local UCX. Empty: no check
  // (trusted peers only).
  std::vector<std::string> address_checker;
  // Longest wait for the child's start or for one verdict (UNAVAILABLE then).
  absl::Duration check_timeout = absl::Seconds(5);
  // The destructor waits up to this long for answers already handed to UCX
  // to reach their clients before it closes the endpoints.
  absl::Duration close_timeout = absl::Seconds(5);
  // Clients with endpoints at once (a client counts once, whatever its
  // lanes); a new client over it: RESOURCE_EXHAUSTED (a client reconnecting
  // under its id replaces all its own endpoints).
  size_t max_endpoints = 1024;
  // UCP workers with their progress threads (1..kMaxUcxLanes); a client
  // gets min(its lanes, these).
  int lanes = kDefaultUcxLanes;
  // Answers over this go out in fragments of it (>= 64 KiB; 0: one message).
  uint64_t fragment_bytes = kDefaultUcxFragmentBytes;
  // Requests still missing fragments this long after their first are
  // dropped (a client that stopped sending part-way).
  absl::Duration assembly_timeout = absl::Seconds(60);
};

// The checker's body: reads framed addresses from `in_fd` (u32 length, then
// at most kMaxUcxAddressBytes) until EOF, creates an endpoint to each as
// UcxServer::Connect would, and answers one byte on `out_fd` for each (after
// one ready byte). Returns 0 at EOF, 2 on a bad frame, 3 if UCX cannot start
// here; an address UCX cannot parse may instead end the process (abort; no
// core file), which the server reads as a refusal.
int UcxAddressCheckMain(int in_fd, int out_fd);

// The fd the checker child finds its socket at (stdin / stdout / stderr stay
// the service's: UCX logs to stdout).
inline constexpr int kCheckerFd = 3;

class UcxServer {
 public:
  static absl::StatusOr<std::unique_ptr<UcxServer>> Create(MoeHandler* handler,
                                                           const UcxServerOptions& opts = {});
  ~UcxServer();
  // Connects to a client's workers (`client_address`: one bare address or an
  // EncodeUcxAddresses list; each used one passes the address checker) on
  // min(their number, lanes) lanes; returns this service's worker addresses
  // for those lanes, in the same form. RESOURCE_EXHAUSTED when max_endpoints
  // other clients are connected.
  // `caller_gone` (optional) says whether the client has given up (e.g. the
  // control call's deadline passed while the address check ran): asked
  // before and after the check; then CANCELLED and no endpoint is made.
  absl::StatusOr<std::string> Connect(const std::string& client_address, uint64_t client_id,
                                      const std::function<bool()>& caller_gone = nullptr);
  uint64_t endpoints() const;
  uint64_t peer_failures() const;
  // Fault injection: every peer's endpoint on `lane` fails as if UCX had
  // reported an error on it (on that lane's thread), so the peer is dropped
  // with all its lanes; the clients are not told. Peers without that lane
  // are left alone.
  void FailPeersForTesting(int lane = 0);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe
