// The device send path (expert_call_path.h): as the device wait path, and
// the device also sends each call. One kernel per call (SendExpertCall)
// writes the request into the slot's mapped regions and stores REQUEST into
// its state word, which the service polls; the answer is read in place. The
// host only arms the calls (at once, or when a captured graph is launched);
// what they routed is read from the slots after the pass (Routes). Internal to gpu_worker/cuda/.
#pragma once

#include "gpu_worker/cuda/device_wait_path.h"

namespace hmoe::cuda {

// Maps each slot's request and answer regions for the device into `dev`
// (from MapDeviceWaits); false when some slot has no REQUEST word or a
// region cannot be mapped.
bool MapDeviceSends(const ExpertSlots& slots, std::vector<DeviceSlot>* dev);

class DeviceSendPath final : public DeviceWaitPath {
 public:
  using DeviceWaitPath::DeviceWaitPath;
  const char* name() const override { return "device send"; }
  const char* description() const override { return "sent and waited for by the device"; }
  void BeginPass(const int32_t* tokens) override;
  absl::Status Submit(const LayerCalls& c, bool capturing, CallRecord* record,
                      StreamOps& ops) override;
  absl::StatusOr<ResidualPart> Wait(int layer, int part, int64_t T, float* staging,
                                    CallRecord* record, StreamOps& ops) override;
  void Arm(const CallRecord& record) override { ArmCalls(record.slot_calls); }
  int64_t AbortPass() override;

 private:
  absl::Status Register() override;
  void AfterDrain() override;
  // Arms `calls` for the device to send, with the pass's real T.
  void ArmCalls(const std::vector<SlotCall>& calls);
};

}  // namespace hmoe::cuda
