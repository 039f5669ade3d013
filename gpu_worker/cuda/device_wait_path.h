// The device wait path (expert_call_path.h): as the host node path, but a
// kernel (WaitHostWord) polls each slot's state word in the registered
// segment for the answer, so that a pass's waits need no host node. The host
// side of the waits runs after the pass (FinishPass); a watchdog ends the
// device's waits when the service is gone. Internal to gpu_worker/cuda/.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/cuda/host_node_path.h"

namespace hmoe::cuda {

// Mapped host words the device paths share with the host: the abort word,
// the nanoseconds the device waited and, per slot, whether its call is armed
// (device sends); and the device's send counter.
class WaitControl {
 public:
  // INTERNAL when the memory cannot be made or mapped.
  static absl::StatusOr<std::unique_ptr<WaitControl>> Create(int num_slots);
  uint32_t* abort_host() const { return abort_host_; }
  uint32_t* abort_dev() const { return abort_dev_; }
  uint32_t* armed_host() const { return armed_host_; }
  uint32_t* armed_dev() const { return armed_dev_; }
  unsigned long long* waited_host() const { return waited_host_; }
  unsigned long long* waited_dev() const { return waited_dev_; }
  unsigned int* send_counter() const { return send_counter_.as<unsigned int>(); }

 private:
  PinnedBuffer ctl_;
  DeviceBuffer send_counter_;
  uint32_t *abort_host_ = nullptr, *abort_dev_ = nullptr;
  uint32_t *armed_host_ = nullptr, *armed_dev_ = nullptr;
  unsigned long long *waited_host_ = nullptr, *waited_dev_ = nullptr;
};

// Per slot, its state word (and, for device sends, its regions) as the
// device sees them.
struct DeviceSlot {
  uint32_t* word = nullptr;
  uint32_t lo = 0, hi = 0, request = 0;
  uint16_t* hidden = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  const float* out = nullptr;
};
// The device's view of every slot's state word; false when the transport has
// none for some slot (staged slots) or one cannot be mapped.
bool MapDeviceWaits(const ExpertSlots& slots, std::vector<DeviceSlot>* out);

class DeviceWaitPath : public HostNodePath {
 public:
  DeviceWaitPath(std::unique_ptr<ExpertSlots> slots, uint64_t gen, std::unique_ptr<WaitControl> ctl,
                 std::vector<DeviceSlot> dev);
  ~DeviceWaitPath() override;
  const char* name() const override { return "device wait"; }
  const char* description() const override {
    return "sent by host nodes, waited for by the device";
  }
  void BeginPass(const int32_t* tokens) override;
  absl::StatusOr<ResidualPart> Wait(int layer, int part, int64_t T, float* staging,
                                    CallRecord* record, StreamOps& ops) override;
  absl::Status FinishPass(const CallRecord* record) override;
  int64_t TakeWaitNs() override;
  int64_t AbortPass() override;

 protected:
  absl::Status Register() override;
  uint32_t* abort_word() const override { return ctl_->abort_host(); }
  // FinishPass, once the slots are drained: the host side of what the
  // device sent.
  virtual void AfterDrain() {}
  // Polls slot `slot`'s state word on the stream.
  absl::Status EnqueueWait(int slot, StreamOps& ops);

  std::unique_ptr<WaitControl> ctl_;
  std::vector<DeviceSlot> dev_;
  std::atomic<bool> in_pass_{false};  // a slot pass with device waits is queued

 private:
  // Sets the abort word while a pass runs and the service is gone (the
  // device cannot see a dead process).
  void Watchdog();
  std::thread watchdog_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;  // guarded by wd_mu_
};

}  // namespace hmoe::cuda
