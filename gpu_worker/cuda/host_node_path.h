// The host node path (expert_call_path.h): the pass's expert calls go
// through fixed slots whose memory is registered for the GPU's copies; a host
// node on the stream submits each layer's calls and another waits for the
// answer, which is copied back to the device. The base of the device paths
// (they share the slots and their registration). Internal to gpu_worker/cuda/.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gpu_worker/cuda/expert_call_path.h"

namespace hmoe::cuda {

// Registers `slots`' memory (cudaHostRegister, mapped) for the GPU's copies;
// INTERNAL naming the transport when it fails.
absl::Status RegisterSlotMemory(ExpertSlots& slots);

class HostNodePath : public ExpertCallPath {
 public:
  // `slots` are prepared (generation `gen`) and registered.
  HostNodePath(std::unique_ptr<ExpertSlots> slots, uint64_t gen);
  const char* name() const override { return "host node"; }
  const char* description() const override { return "sent and waited for by host nodes"; }
  ExpertSlots* slots() override { return slots_.get(); }
  absl::StatusOr<bool> Prepare() override;
  void BeginPass(const int32_t* tokens) override { tokens_ = tokens; }
  absl::Status Submit(const LayerCalls& c, bool capturing, CallRecord* record,
                      StreamOps& ops) override;
  absl::StatusOr<ResidualPart> Wait(int layer, int part, int64_t T, float* staging,
                                    CallRecord* record, StreamOps& ops) override;
  // Every slot path: the submits' ids (host nodes), the armed calls' (device sends).
  void Routes(const CallRecord& record, int64_t T,
              const std::function<void(int32_t, const int32_t*, int64_t)>& add) const override;
  absl::Status TakeStatus() override { return slots_->TakeStatus(); }
  int64_t TakeWaitNs() override { return slots_->TakeWaitNs(); }
  int64_t AbortPass() override;

 protected:
  // After Prepare moved the slots: registers them again (and what a derived
  // path maps of them).
  virtual absl::Status Register();
  // The abort word a submit node sets when a call failed (device waits), or null.
  virtual uint32_t* abort_word() const { return nullptr; }
  // Copies slot `slot`'s answer ([T, H]) to `staging`.
  absl::StatusOr<ResidualPart> CopyAnswer(int slot, int64_t T, float* staging, StreamOps& ops);

  std::unique_ptr<ExpertSlots> slots_;
  uint64_t gen_ = 0;
  std::vector<SlotView> views_;  // per slot, its regions as the host sees them
  const int32_t* tokens_ = nullptr;
};

}  // namespace hmoe::cuda
