// RoutedExperts over an in-process MoeHandler (an ExpertShard loaded in this
// process): the expert service's own validation, packing and CPU kernels,
// with no transport in between. For accuracy tools and tests that run a
// model on the service's numerics (its weight formats) in one process.
//
// As over the wire (PoolRoutedExperts), hidden states are rounded to bf16;
// a batch of more tokens than the handler takes (ShardInfo::max_tokens) goes
// as several calls. Submit/Wait are the synchronous defaults (no overlap).
// Errors: ValidateExpertBatch's INVALID_ARGUMENT, else the handler's status.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe {

class HandlerRoutedExperts final : public RoutedExperts {
 public:
  // `handler` (borrowed, must outlive this) must serve all of this model's
  // routed experts: the only shard (1 of 1), with the config's hidden size,
  // expert count, intermediate size, top-k and MoE layers; else
  // FAILED_PRECONDITION naming the mismatch.
  static absl::StatusOr<std::unique_ptr<HandlerRoutedExperts>> Create(const ModelConfig& config,
                                                                      MoeHandler* handler);

  absl::Status Forward(const ExpertBatch& batch, float* out) override;

 private:
  HandlerRoutedExperts(const ModelConfig& config, MoeHandler* handler)
      : config_(config), handler_(handler) {}
  ModelConfig config_;
  MoeHandler* handler_;
};

}  // namespace hmoe
