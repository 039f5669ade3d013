// RoutedExperts over the expert service: the model's MoE calls go to an
// ExpertPool (all shards, any transport). Hidden states are rounded to bf16
// on the way out (the wire format); results are the shards' f32 sums.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/time/time.h"
#include "common/transport/expert_pool.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe {

class PoolRoutedExperts final : public RoutedExperts {
 public:
  // Checks that the pool serves this model's experts (hidden size, expert
  // count, top-k, MoE layers): FAILED_PRECONDITION naming the mismatch.
  // Each call gets `call_timeout`; a shard that misses it is UNAVAILABLE, and
  // for the next kFailFast every call fails UNAVAILABLE at once (a hung
  // shard costs one timeout, not one per request and layer).
  static absl::StatusOr<std::unique_ptr<PoolRoutedExperts>> Create(const ModelConfig& config,
                                                                   ExpertPool* pool,
                                                                   absl::Duration call_timeout);

  absl::Status Forward(const ExpertBatch& batch, float* out) override;
  absl::StatusOr<uint64_t> Submit(const ExpertBatch& batch, float* out) override;
  absl::Status Wait(uint64_t ticket) override;

 private:
  PoolRoutedExperts(const ModelConfig& config, ExpertPool* pool, absl::Duration timeout)
      : config_(config), pool_(pool), timeout_(timeout) {}
  absl::Status ExpertFailure(const absl::Status& st);
  static constexpr absl::Duration kFailFast = absl::Seconds(1);
  const ModelConfig& config_;
  ExpertPool* pool_;
  absl::Duration timeout_;
  std::mutex mu_;
  std::map<uint64_t, absl::Time> deadlines_;  // pool handle -> deadline
  absl::Time fail_fast_until_ = absl::InfinitePast();
};

}  // namespace hmoe
