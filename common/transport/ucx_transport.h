// UCX data plane (across hosts; any UCX transport: tcp, shared memory, verbs).
//
// Each side owns `lanes` UCP workers (one UCP context), each driven by its
// own progress thread; other threads hand a lane work through its queue and
// ucp_worker_signal. A lane is one endpoint pair, so over TCP its own
// connection: one connection driven by one thread tops out well below what
// the host moves (measured over loopback TCP: 2.2-2.5 GB/s for a 44 MB call
// on one lane vs 4.3-5 GB/s in UCX's own perftest). The workers' addresses
// are exchanged over the gRPC control plane (ExpertControl.UcxConnect: the
// client sends its lanes' addresses and a client id, the service connects to
// the first min(client's, its own) of them and answers with as many of its
// own; lane i pairs the client's worker i with the service's worker i). One
// lane travels as the bare worker address (as before lanes), several as an
// EncodeUcxAddresses list in the same bytes field. Every endpoint is created
// with UCP_ERR_HANDLING_MODE_PEER, so a dead peer surfaces as an endpoint
// error on some lane: the client fails that connection's calls UNAVAILABLE
// (once every lane has handled what already reached it: a service closing
// after its last answers closes every lane, and an idle lane may see that
// before another has taken in an answer) and reconnects every lane on a
// later Submit; the service drops the client (all its lanes). Once the
// service has closed its endpoints to a client, that client's requests are
// no longer delivered (measured: UCX reports nothing to the client's
// endpoint for seconds). So once a call ends in
// DEADLINE_EXCEEDED, the client's next Submit (at most once a second) first
// redoes the handshake with a 250 ms control-plane timeout, which that
// Submit waits for (an ExpertPool submits to its shards in turn); if the
// service answers, the new endpoints are used and calls still out on the
// old ones finish or end by their deadline; if not (e.g. a stopped service),
// the call goes out on the old endpoints and ends by its own deadline.
//
// The service closes its endpoints (UcxServer's destructor) only once the
// answers already computed have been handed to UCX on every lane and
// completed, up to close_timeout: a forced close would cancel a rendezvous
// answer the client has not fetched.
//
// Messages are UCP active messages: id 1 request (header UcxRequestHeader,
// data hidden | ids | weights), id 2 response (UcxResponseHeader, data = f32
// output or the error message). A payload over fragment_bytes goes as
// fragments of that size, each message carrying its offset, fragment j on
// lane j mod n (n = min(lanes, fragments); the service starts its answer's
// stripe on the lane whose thread computed it); a payload of one fragment
// (a decode call, an error) always goes on lane 0, so small calls see one
// lane exactly as before. The receiver lands each fragment in place, on the
// thread of the lane it came on, in one pooled buffer shared by the lanes
// (no copies beyond UCX's own and the caller's: Submit copies the call in,
// handing each fragment to its lane once copied; Wait copies the answer out,
// each fragment as it lands while the others arrive) and takes the payload
// once every fragment has arrived exactly once; the service then computes
// it on that lane's thread (MoeHandler::Handle is thread-safe; lanes
// compute concurrently).
// Fragments over UCX's rendezvous threshold take its rendezvous path.
// Transports are picked by UCX_TLS as usual (tests: UCX_TLS=tcp,sm,self).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/fragments.h"
#include "common/transport/moe_call.h"

namespace hmoe {

class ControlClient;

struct UcxRequestHeader {
  uint64_t client_id;
  uint64_t request_id;
  int32_t layer, tokens, top_k, pad;
  uint64_t hidden_bytes, ids_bytes, weights_bytes;
  // This message's place in the payload (hidden | ids | weights), cut every
  // frag_bytes (0: the payload is one message).
  uint64_t frag_offset, frag_bytes;
};
struct UcxResponseHeader {
  uint64_t request_id;
  int32_t code;
  uint32_t msg_len;
  uint64_t out_bytes;
  uint64_t compute_ns;
  uint64_t frag_offset, frag_bytes;  // as in UcxRequestHeader; payload: output or message
};

// Payloads over this are sent as fragments of it, back to back, striped
// over the lanes. Measured on the 16-core GPU host over TCP loopback with 4
// lanes (bench/results/README.md, "Transports that carry prefill"): 256 KiB
// fragments move a T=128 call in 1.05 ms of transport (5.3 GB/s) and a
// T=1024 one in 4.6 ms (9.5 GB/s), 1 MiB ones in 1.28 / 4.98 ms.
inline constexpr uint64_t kDefaultUcxFragmentBytes = 256 << 10;

// A UCX worker address is longer than this only if it is not one.
inline constexpr size_t kMaxUcxAddressBytes = 64 << 10;

// Lanes (UCP workers, each with its progress thread and connection) per side.
inline constexpr int kDefaultUcxLanes = 4;
inline constexpr int kMaxUcxLanes = 16;
// INVALID_ARGUMENT naming `field` unless 1 <= lanes <= kMaxUcxLanes.
absl::Status CheckUcxLanes(int lanes, const char* field = "lanes");

// Several lanes' worker addresses in one UcxConnect address field:
// "HMOELNS1", a u32 count, then each address as a u32 length and its bytes
// (little-endian). One address is sent bare (what a one-lane peer sends).
std::string EncodeUcxAddresses(const std::vector<std::string>& addresses);
// The addresses in such a field: a list (1..kMaxUcxLanes addresses of
// 1..kMaxUcxAddressBytes bytes, nothing after them) or one bare address.
// INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<std::vector<std::string>> DecodeUcxAddresses(const std::string& bytes,
                                                            const char* field);

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

// The network device (UCX_NET_DEVICES) that keeps UCX's TCP listeners on the
// host of a gRPC `listen` address (host:port, [v6]:port): the interface
// holding that address ("lo" for 127.0.0.1, ::1 and localhost); "" for a
// wildcard host (0.0.0.0, [::], empty: every device) and for a host name
// that is not a literal address (UCX's default, the caller says so).
// NOT_FOUND when no local interface holds the literal address.
absl::StatusOr<std::string> UcxNetDeviceFor(const std::string& listen);
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

struct UcxClientOptions {
  int spin_us = 50;  // progress busily this long before sleeping on the worker's event fd
  // Wait spins this long for the answer before it sleeps (0: sleeps at
  // once). Saves a futex wake on small calls where cores are spare.
  int wait_spin_us = 0;
  // Requests over this go out in fragments of it (>= 64 KiB; 0: one message).
  uint64_t fragment_bytes = kDefaultUcxFragmentBytes;
  // UCP workers with their progress threads (1..kMaxUcxLanes); the calls use
  // min(this, the service's lanes).
  int lanes = kDefaultUcxLanes;
};

class UcxClient : public MoeClient {
 public:
  static absl::StatusOr<std::unique_ptr<UcxClient>> Create(std::shared_ptr<ControlClient> control,
                                                           const ShardInfo& info,
                                                           const UcxClientOptions& opts = {});
  ~UcxClient() override;
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline) override;
  absl::Status Wait(uint64_t handle, absl::Time deadline) override;
  const char* transport() const override { return "ucx"; }
  // Lanes the current connection uses (0 while not connected).
  int lanes() const;
  // Fault injection: the client's endpoint on `lane` fails as if UCX had
  // reported an error on it (on that lane's thread).
  void FailLaneForTesting(int lane);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe
