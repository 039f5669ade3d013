// ExpertPool: the worker's view of all shards of the expert service. One MoE
// call (a layer's routed tokens) fans out to every shard: in tp mode each
// shard computes a slice of every expert's intermediate dim and the f32
// partials are summed; in ep mode each token goes only to the shards owning
// one of its experts, and rows are scattered back. Several calls (layers) may
// be in flight; every wait has a deadline. This is the asynchronous
// submit/wait that Expert Deferral pipelines on.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth_token.h"
#include "common/metrics.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/transport/expert_slots.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gpu_worker/transport/ucx_client.h"

namespace hmoe {

enum class TransportKind { kGrpc, kShm, kUcx };
const char* TransportKindName(TransportKind t);
absl::StatusOr<TransportKind> ParseTransportKind(const std::string& s);  // grpc | shm | ucx

struct ExpertPoolOptions {
  std::vector<std::string> targets;  // host:port of each shard's gRPC endpoint (any order)
  TransportKind transport = TransportKind::kGrpc;
  absl::Duration connect_timeout = absl::Seconds(10);  // per shard, waiting for READY
  // Calls in flight per shard over shared memory (more wait for a slot until
  // their deadline).
  uint32_t shm_slots = 8;
  // After a shard misses a call's deadline, calls to that shard fail
  // UNAVAILABLE at once for this long (0: off): a hung shard then costs one
  // deadline, not one per call queued behind it.
  absl::Duration fail_fast_after_miss = absl::ZeroDuration();
  // After CheckHealth finds a shard not serving, calls to it fail
  // UNAVAILABLE at once for this long (0: off), or until a later
  // CheckHealth finds it serving: a shard known down costs no call
  // deadline. Checking more often than this keeps it failing fast while
  // down; a shard back up is served from the next check.
  absl::Duration fail_fast_after_failed_check = absl::ZeroDuration();
  // The first token in force is sent with every control and gRPC data call
  // (the service's --auth-token-file; common/auth_token.h); a reload of it
  // applies to the calls that start afterwards. Null or off: none.
  std::shared_ptr<const AuthTokens> auth_tokens;
  // TLS to the shards' gRPC endpoints (grpc_tls.h ChannelCredentialsFrom);
  // null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  UcxClientOptions ucx;  // transport kUcx
  // Borrowed; outlives the pool. Null: no metrics. Connect registers, with
  // shard = the target (host:port) and transport = TransportKindName:
  //   hmoe_expert_calls_total{transport,shard,outcome}: a call's part for
  //     one shard, outcome the status code in lower case (ok, unavailable,
  //     deadline_exceeded, ...; failing fast counts too);
  //   hmoe_expert_call_seconds{transport,shard}: from Submit to Wait seeing
  //     that shard's answer or failure, calls sent to it only (a caller that
  //     waits late, as Expert Deferral does, adds its own delay);
  //   hmoe_expert_call_tokens_total{transport,shard}: token rows of the
  //     calls sent to it;
  //   hmoe_expert_call_bytes_total{transport,shard,direction}: payload
  //     bytes of those calls, direction "sent" (bf16 rows, ids, weights) or
  //     "received" (the f32 answers of the calls that succeeded);
  //   hmoe_expert_shard_up{shard}: 1/0 as the last observation of the shard
  //     found it: a call's outcome as ShardsUp, or a CheckHealth.
  // Every call is counted alike, whoever sends it: Submit / Wait, and the
  // slots of MakeSlots (a call a device sends is counted when its Wait sees
  // the outcome, after the device's pass; its latency runs from Arm).
  MetricsRegistry* metrics = nullptr;
};

class ExpertPool;
class ShmClient;

// Slots over an ExpertPool (any transport, any number of shards): the
// regions are this object's own page-aligned host memory and each call goes
// through ExpertPool::Submit / Wait (the staging copy; shm then copies once
// more into its own segment).
absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeStagedExpertSlots(ExpertPool* pool,
                                                                   const ExpertSlotsOptions& opts);
// Zero-copy slots: slot i is slot i of `client`'s own segment (which must
// have been made with opts.num_slots slots of opts.max_tokens tokens and be
// used for nothing else).
absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeShmExpertSlots(std::unique_ptr<ShmClient> client,
                                                                int64_t hidden,
                                                                const ExpertSlotsOptions& opts);

class ExpertPool {
 public:
  // Connects to every shard, checks that they are the n shards of one model
  // (same geometry and split, indices 0..n-1 each once) and opens the data plane.
  static absl::StatusOr<std::unique_ptr<ExpertPool>> Connect(const ExpertPoolOptions& opts);
  ~ExpertPool();

  // The model's expert geometry (shard-independent fields of ShardInfo).
  const ShardInfo& model() const { return model_; }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  // Calls that may be in flight at once (submitted, not yet waited on)
  // before a shard refuses more: the shm slots; 0 when the transport sets
  // no such limit.
  int max_in_flight() const { return max_in_flight_; }
  // The tickets a caller may hold at once and still have each make progress:
  // the model's MoE calls (with Expert Deferral: the previous layer's
  // deferred call, this layer's call and its deferred call).
  static constexpr int kTicketsInFlight = 3;
  // How many calls one of those tickets may keep in flight at a time (a
  // ticket split into more calls submits the rest as earlier ones are waited
  // on): max_in_flight() / kTicketsInFlight, at least 1; 64 when the
  // transport sets no limit. Within it, kTicketsInFlight tickets stay within
  // the shm slots together; more calls at once could overrun them (a
  // RESOURCE_EXHAUSTED failure, not a hang).
  int calls_per_ticket() const {
    return max_in_flight_ > 0 ? std::max(1, max_in_flight_ / kTicketsInFlight) : 64;
  }
  SplitMode split() const { return model_.split; }

  // Validates `call` (INVALID_ARGUMENT naming the field), sends it to the
  // shards that own its experts; out [tokens][hidden] f32 is written by Wait.
  // Returns by `deadline` (MoeClient::Submit); a shard that could not take
  // the call in time reports DEADLINE_EXCEEDED from Wait.
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline);
  // OK, or the first shard's failure (annotated with the shard):
  // UNAVAILABLE when a shard is gone (or failing fast after a miss),
  // DEADLINE_EXCEEDED when one is late, FAILED_PRECONDITION when one was
  // restarted serving something else (CheckHealth, or the transport's own
  // check when it reconnects).
  absl::Status Wait(uint64_t handle, absl::Time deadline);
  absl::Status Run(const MoeCall& call, float* out, absl::Time deadline);

  // Fixed expert-call slots (expert_slots.h) over this pool: zero copy in
  // the shard's own shared memory when the pool is one shm shard (a segment
  // of its own, beside the one Submit uses), else staged through
  // Submit / Wait. Either way the slots' calls are this pool's: counted in
  // its metrics, failing fast as Submit's do (FailingFast) and updating
  // ShardsUp and the fail-fast state (opts.ledger is replaced). FAILED_PRECONDITION when the shards
  // take fewer tokens per call than opts.max_tokens, or a smaller top-k than opts.top_k.
  absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeSlots(const ExpertSlotsOptions& opts);

  // Last known state per shard: false after an UNAVAILABLE, a refused
  // token or a shard found serving something else; true after success.
  std::vector<bool> ShardsUp() const;
  // Per shard: whether its data path is broken while its control plane may
  // still answer: its last kDataPathBrokenAfter calls all failed DATA_LOSS
  // (answers for another call or epoch, garbage). Cleared by a call it
  // serves or a transport reconnect that succeeds. The worker's health is
  // NOT_SERVING while any shard's is.
  std::vector<bool> DataPathsBroken() const;
  static constexpr int kDataPathBrokenAfter = 3;
  // grpc.health.v1 of every shard, asked now; a SERVING shard is also asked
  // to describe itself (a token-checked call: a shard refusing our token is
  // kNotServing). One that now serves something else than at Connect
  // (restarted with another model, format, part or checkpoint:
  // ServedDifference) is kNotServing, and calls to it fail
  // FAILED_PRECONDITION naming the difference until a later check finds it
  // serving the original again. (Every transport also checks when it
  // reconnects, before its first call there: the window until this check
  // runs is not served.)
  std::vector<Health> CheckHealth(absl::Duration timeout = absl::Seconds(1));
  // What each shard described at Connect, by shard index.
  std::vector<ShardInfo> shard_infos() const;

 private:
  struct Shard {
    std::string target;
    ShardInfo info;
    std::shared_ptr<ControlClient> control;
    std::unique_ptr<MoeClient> client;
    bool up = true;                                     // guarded by mu_
    int data_loss_streak = 0;                           // guarded by mu_
    absl::Time fail_fast_until = absl::InfinitePast();  // guarded by mu_
    // The last CheckHealth that found it not serving (InfinitePast: the
    // last one found it serving), and until when calls fail fast for it.
    absl::Time check_failed_at = absl::InfinitePast();   // guarded by mu_
    absl::Time check_fail_until = absl::InfinitePast();  // guarded by mu_
    // ServedDifference from `info` seen by the last CheckHealth (a shard
    // restarted with other weights); calls to it are refused while set.
    std::string changed;  // guarded by mu_
    // With ExpertPoolOptions::metrics: this shard's children.
    Counter* calls_ok = nullptr;
    Counter* tokens = nullptr;
    Counter* bytes_sent = nullptr;
    Counter* bytes_received = nullptr;
    Histogram* call_seconds = nullptr;
    Gauge* up_gauge = nullptr;
  };
  class ShardLedger;
  struct Sub {
    int shard = 0;
    int32_t tokens = 0, top_k = 0;
    uint64_t handle = 0;
    absl::Status submit_status;
    // The deadline had passed before this shard was sent the call (an earlier
    // shard's Submit, or the caller, used it up): not this shard's miss.
    bool late = false;
    absl::Time started;  // with metrics only
    // Where the shard's answer lands: the caller's `out` itself (tp, first
    // shard) or `scratch` (a recycled buffer, summed / scattered in Wait).
    float* dst = nullptr;
    std::vector<float> scratch;
    std::vector<int32_t> rows;  // ep: the call's token index of each sub-row
  };
  struct Op {
    float* out = nullptr;
    int32_t tokens = 0;
    std::vector<Sub> subs;
  };

  ExpertPool() = default;
  // UNAVAILABLE while `sh` fails fast after a missed deadline;
  // FAILED_PRECONDITION while it serves something else (Shard::changed);
  // else OK.
  absl::Status FailingFast(const Shard& sh) const;
  // Scratch buffers are recycled so that a call neither allocates nor
  // page-faults its partial outputs (a T=128, H=7168 partial is 3.7 MB).
  std::vector<float> TakeScratch(size_t n);
  void ReturnScratch(std::vector<float> buf);
  // Registers the metrics and caches each shard's children (Connect).
  absl::Status RegisterMetrics(MetricsRegistry& reg);
  // The one accounting point of a call's part for shard `shard`, whoever
  // sent it: ShardsUp, the fail-fast state after a miss, the metrics.
  // `sent`: it reached the shard (its latency `took` counts); `late`: its
  // deadline had passed before it was sent (not the shard's miss).
  void Account(int shard, const absl::Status& st, bool sent, bool late, absl::Duration took,
               int64_t tokens, int64_t top_k);

  ShardInfo model_;
  TransportKind transport_ = TransportKind::kGrpc;
  absl::Duration fail_fast_after_miss_;
  absl::Duration fail_fast_after_failed_check_;
  int max_in_flight_ = 0;
  std::vector<Shard> shards_;                               // by shard index
  std::vector<std::unique_ptr<ExpertCallLedger>> ledgers_;  // ShardLedger by shard index
  std::optional<CounterFamily> calls_metric_;               // with ExpertPoolOptions::metrics
  mutable std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, std::unique_ptr<Op>> ops_;
  std::vector<std::vector<float>> free_scratch_;  // guarded by mu_
};

}  // namespace hmoe
