// RoutedExperts over the expert service: the model's MoE calls go to an
// ExpertPool (all shards, any transport). Hidden states are rounded to bf16
// on the way out (the wire format); results are the shards' f32 sums.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gpu_worker/routed_experts.h"
#include "gpu_worker/transport/expert_pool.h"

namespace hmoe {

class PoolRoutedExperts final : public RoutedExperts {
 public:
  // Checks that the pool serves this model's experts (hidden size, expert
  // count, top-k, MoE layers; with `source_fingerprint`, the worker's own
  // RoutedExpertsFingerprint, the checkpoint the shards' weights come from
  // when they know it): FAILED_PRECONDITION naming the mismatch.
  // Each call gets `call_timeout`; a shard that misses it is UNAVAILABLE (the
  // pool's fail_fast_after_miss then spares the calls queued behind it). A
  // batch of more tokens than the shards take (ShardInfo::max_tokens) is sent
  // as several calls under the one deadline. An answer holding a non-finite
  // value is refused (INTERNAL naming its place; CheckAnswer).
  static absl::StatusOr<std::unique_ptr<PoolRoutedExperts>> Create(
      const ModelConfig& config, ExpertPool* pool, absl::Duration call_timeout,
      const std::string& source_fingerprint = "");

  absl::Status Forward(const ExpertBatch& batch, float* out) override;
  absl::StatusOr<uint64_t> Submit(const ExpertBatch& batch, float* out) override;
  absl::Status Wait(uint64_t ticket) override;
  // The pool's slots (ExpertPool::MakeSlots: zero copy over one shm shard),
  // each call under this object's call timeout, failures mapped as Wait's.
  absl::StatusOr<std::unique_ptr<ExpertSlots>> MakeSlots(const ExpertSlotsOptions& opts) override;

 private:
  PoolRoutedExperts(const ModelConfig& config, ExpertPool* pool, absl::Duration timeout)
      : config_(config), pool_(pool), timeout_(timeout) {}
  absl::Status ExpertFailure(const absl::Status& st) const;
  const ModelConfig& config_;
  ExpertPool* pool_;
  absl::Duration timeout_;
  // One Submit's calls: pieces of at most `piece` tokens, at most the pool's
  // calls_per_ticket() of them submitted at a time (the rest as earlier ones
  // are waited on).
  struct Pending {
    ExpertBatch batch;  // the caller's pointers, valid until Wait returns
    float* out = nullptr;
    std::vector<uint16_t> hidden;  // batch.hidden as bf16
    int64_t piece = 1;
    int64_t next = 0;              // first token not yet submitted
    std::deque<uint64_t> handles;  // the pool's calls in flight, oldest first
    absl::Time deadline;
    absl::Status first;  // the first failure
  };
  void SubmitMore(Pending& p);
  std::mutex mu_;
  uint64_t next_ticket_ = 1;                              // guarded by mu_
  std::map<uint64_t, std::unique_ptr<Pending>> pending_;  // guarded by mu_
};

}  // namespace hmoe
