// The unit of work between a GPU worker and an expert-service shard, and the
// two interfaces every transport is built from:
//   MoeHandler  (server side): validates and computes one call;
//   MoeClient   (worker side): submit -> handle; Wait(handle, deadline).
// No gRPC, UCX or shared-memory types here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_config.h"

namespace hmoe {

// An empty routing slot: no expert; its weight is ignored. Lets a call keep
// a fixed top_k while some of a token's experts are computed elsewhere (hot
// experts on the GPU).
inline constexpr int32_t kNoExpert = -1;

enum class SplitMode { kTp, kEp };
const char* SplitModeName(SplitMode m);  // "tp" | "ep"

// One MoE request: T tokens of one layer. Byte sizes travel separately from the
// shape so that a server can reject a mismatch (INVALID_ARGUMENT naming the field).
struct MoeCall {
  int32_t layer = 0;
  int32_t tokens = 0;
  int32_t top_k = 0;
  const uint16_t* hidden = nullptr;  // bf16 [tokens][hidden]
  uint64_t hidden_bytes = 0;
  const int32_t* ids = nullptr;  // global expert ids [tokens][top_k], or kNoExpert
  uint64_t ids_bytes = 0;
  const float* weights = nullptr;  // [tokens][top_k]
  uint64_t weights_bytes = 0;

  // Fills the byte sizes from the shape (for well-formed calls).
  static MoeCall Make(int32_t layer, int32_t tokens, int32_t top_k, int64_t hidden_dim,
                      const uint16_t* hidden, const int32_t* ids, const float* weights);
};

// What a shard serves: the model's expert geometry and its own part of it.
struct ShardInfo {
  std::string model_type;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;  // max accepted top_k
  std::vector<int32_t> moe_layers;
  int32_t shard_index = 0;
  int32_t num_shards = 1;
  SplitMode split = SplitMode::kTp;
  int64_t expert_begin = 0, expert_end = 0;
  int64_t i_begin = 0, i_end = 0;
  int64_t max_tokens = 0;
  std::string weight_format;
  // The packed files' conversion (PackedExperts::conversion_id); empty when
  // the shard quantized a checkpoint at load. Shards of one pool with
  // different non-empty ids hold different weights.
  std::string conversion_id;
  // RoutedExpertsFingerprint of the checkpoint the weights come from; empty
  // when unknown (synthetic weights, packed files without one).
  std::string source_fingerprint;
  int64_t pid = 0;
  bool shm_available = false;
  bool ucx_available = false;
};

// "" when a shard now describing itself as `now` serves what it served as
// `was` (same model, part and weights; pid, max_tokens growth and the data
// planes may change; an empty fingerprint or conversion id on either side
// is unknown, not a difference); else the first difference, e.g. "weight format int8
// (was bf16)" or "routed experts of another checkpoint (fingerprint X, was
// Y)". For a shard that restarted while a worker was connected.
std::string ServedDifference(const ShardInfo& was, const ShardInfo& now);

// Whether what `served` serves covers `config`'s routed experts (hidden and
// intermediate sizes, the expert count, a top-k of at least the model's,
// every MoE layer); FAILED_PRECONDITION "<who> serves a different model:
// ..." / "<who> does not serve MoE layer L" otherwise.
absl::Status CheckServesModel(const ShardInfo& served, const ModelConfig& config,
                              const std::string& who);
// OK when `now` serves what `was` did; else FAILED_PRECONDITION "expert
// service (<transport>): restarted serving something else than when the
// worker connected: <difference>" (a transport's check at reconnect).
absl::Status CheckServesTheSame(const ShardInfo& was, const ShardInfo& now, const char* transport);

// Server side. Handle() validates `call` against info() (INVALID_ARGUMENT
// naming the field: layer, tokens, top_k, hidden, expert_ids,
// expert_weights), then writes the f32 partial sum [tokens][hidden] to `out`.
// Thread-safe.
class MoeHandler {
 public:
  virtual ~MoeHandler() = default;
  virtual const ShardInfo& info() const = 0;
  virtual absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) = 0;
  // A call the transport refused before Handle (its sizes or ranges cannot
  // be valid; nothing was copied): counted like Handle's own refusals.
  virtual void Refused(const absl::Status& status) { (void)status; }
};

// Worker side: one connection to one shard.
//
// Submit() has consumed the call's buffers when it returns (they may be
// reused); `out` ([tokens][hidden] f32) must stay valid until Wait() on the
// handle returns, and is written only inside Wait() or before it returns OK.
// Submit() returns by `deadline` whatever the service does: a reconnect
// handshake, a wait for a free shared-memory slot or for room in a stalled
// stream's send queue is cut there (DEADLINE_EXCEEDED; no handle). A hung
// service must not hold the caller past the call's own deadline.
// Wait() returns the call's status: OK, the server's error, UNAVAILABLE (peer
// gone; the client reconnects on a later Submit), or DEADLINE_EXCEEDED (the
// handle is then abandoned: a late answer is dropped and `out` is not touched).
// Every handle must be waited on once. Thread-safe.
class MoeClient {
 public:
  virtual ~MoeClient() = default;
  virtual absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline) = 0;
  virtual absl::Status Wait(uint64_t handle, absl::Time deadline) = 0;
  virtual const char* transport() const = 0;
};

// Validates a call against a shard's description (the server's check).
absl::Status ValidateMoeCall(const ShardInfo& info, const MoeCall& call);
// The part of ValidateMoeCall that needs no buffers: layer, tokens, top_k
// and the byte sizes (a server checks these before copying anything; the
// data pointers may be null).
absl::Status ValidateMoeCallShape(const ShardInfo& info, const MoeCall& call);
// A client's check before it copies a call's buffers: INVALID_ARGUMENT when
// hidden_bytes + ids_bytes + weights_bytes (summed without wrapping) exceed
// `limit`. The sizes are otherwise sent as given for the server to judge.
absl::Status CheckMoeCallBytes(const MoeCall& call, uint64_t limit, const char* transport);

}  // namespace hmoe
