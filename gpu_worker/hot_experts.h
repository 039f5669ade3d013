// HotColdExperts: a model's routed experts split by a placement
// (common/expert_placement.h). Each call's slots whose expert is hot go to
// `hot` (in the worker: the GPU; on the CPU backend and in tests any
// RoutedExperts, e.g. the in-process reference), the others to `cold` (the
// expert service), both with the call's full shape and the other side's
// slots empty (kNoExpert), and the two partial sums are added:
// out = cold + hot. A token's result therefore differs from the unsplit call
// only by fp32 summation order (and by whatever the two sides' own formats
// differ by). A side with no slot in a call is not called.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/expert_placement.h"
#include "common/model_config.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe {

class HotColdExperts final : public RoutedExperts {
 public:
  // `placement` must describe `config` (FAILED_PRECONDITION otherwise:
  // another model type or expert count, a hot layer that is not MoE, an
  // expert id out of range). hot and cold are borrowed and must outlive this.
  static absl::StatusOr<std::unique_ptr<HotColdExperts>> Create(const ModelConfig& config,
                                                                const Placement& placement,
                                                                RoutedExperts* hot,
                                                                RoutedExperts* cold);
  absl::Status Forward(const ExpertBatch& batch, float* out) override;
  // Submit sends the cold part and computes the hot part before returning;
  // Wait joins the cold part and adds the hot sums.
  absl::StatusOr<uint64_t> Submit(const ExpertBatch& batch, float* out) override;
  absl::Status Wait(uint64_t ticket) override;

  // Routed slots (token x expert) served by each side so far.
  uint64_t hot_slots() const { return hot_slots_.load(); }
  uint64_t cold_slots() const { return cold_slots_.load(); }

 private:
  HotColdExperts(const ModelConfig& config, RoutedExperts* hot, RoutedExperts* cold)
      : config_(config), hot_(hot), cold_(cold) {}
  struct Pending {
    bool cold = false;  // a cold ticket to wait for
    uint64_t cold_ticket = 0;
    float* out = nullptr;
    std::vector<float> hot_sum;     // empty: no hot slots
    std::vector<int32_t> cold_ids;  // what the cold call reads until its Wait
  };
  ModelConfig config_;
  RoutedExperts* hot_;
  RoutedExperts* cold_;
  std::vector<std::vector<uint8_t>> is_hot_;  // [layer][expert]
  std::atomic<uint64_t> hot_slots_{0}, cold_slots_{0};
  std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, Pending> pending_;
};

}  // namespace hmoe
