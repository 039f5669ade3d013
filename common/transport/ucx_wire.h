// UCX data plane (across hosts; any UCX transport: tcp, shared memory, verbs):
// the protocol and message headers both ends follow (the service's end:
// expert_service/transport/ucx_server.h; the worker's:
// gpu_worker/transport/ucx_client.h; the UCP plumbing both use: ucx_lanes.h).
//
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

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe {

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
// Whether `bytes` is an EncodeUcxAddresses list (not one bare address).
bool IsUcxAddressList(const std::string& bytes);

// The network device (UCX_NET_DEVICES) that keeps UCX's TCP listeners on the
// host of a gRPC `listen` address (host:port, [v6]:port): the interface
// holding that address ("lo" for 127.0.0.1, ::1 and localhost); "" for a
// wildcard host (0.0.0.0, [::], empty: every device) and for a host name
// that is not a literal address (UCX's default, the caller says so).
// NOT_FOUND when no local interface holds the literal address.
absl::StatusOr<std::string> UcxNetDeviceFor(const std::string& listen);

// The network devices (UCX_NET_DEVICES, comma-separated) for a client of
// `targets` (host:port, [v6]:port): for each literal host, the interface a
// packet to it leaves by ("lo" for loopback hosts), so that UCX's TCP
// listeners stay off interfaces no target is reached by; "" (every device,
// UCX's default) when a host is not a literal address or no route to it is
// known here.
std::string UcxNetDevicesForTargets(const std::vector<std::string>& targets);

}  // namespace hmoe
