// ReferenceExperts: the in-process reference RoutedExperts over checkpoint
// weights (routed_experts.h has the contract).
#pragma once

#include <memory>
#include <vector>

#include "common/runtime/thread_pool.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe::cpu {

class ReferenceExperts : public RoutedExperts {
 public:
  // Loads every MoE layer's routed experts (fp8 needs square weight blocks).
  static absl::StatusOr<std::unique_ptr<ReferenceExperts>> Create(const ModelConfig& config,
                                                                  const Checkpoint& ckpt,
                                                                  std::shared_ptr<ThreadPool> pool);
  absl::Status Forward(const ExpertBatch& batch, float* out) override;

 private:
  ReferenceExperts() = default;
  struct Expert {
    Matrix gate, up, down;
  };
  ModelConfig config_;
  std::shared_ptr<ThreadPool> pool_;
  std::vector<std::vector<Expert>> layers_;  // [layer][expert]; empty for dense layers
};

}  // namespace hmoe::cpu
