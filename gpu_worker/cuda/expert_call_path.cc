#include "gpu_worker/cuda/expert_call_path.h"

#include <cstdio>

#include "absl/time/clock.h"
#include "gpu_worker/cuda/device_send_path.h"
#include "gpu_worker/cuda/device_wait_path.h"
#include "gpu_worker/cuda/host_copy_path.h"
#include "gpu_worker/cuda/host_node_path.h"

namespace hmoe::cuda {

std::unique_ptr<ExpertCallPath> ChooseExpertCallPath(RoutedExperts* experts,
                                                     const ExpertCallOptions& options,
                                                     std::string* why) {
  if (!options.slots) {
    *why = "--cuda-expert-slots off";
    return std::make_unique<HostCopyPath>();
  }
  auto made = experts->MakeSlots(options.slot_options);
  if (!made.ok()) {
    *why = made.status().ToString();
    return std::make_unique<HostCopyPath>();
  }
  std::unique_ptr<ExpertSlots> slots = std::move(*made);
  std::unique_ptr<WaitControl> ctl;
  if (options.slot_calls != SlotCalls::kHostNodes) {
    auto c = WaitControl::Create(slots->num_slots());
    if (c.ok()) {
      ctl = std::move(*c);
    } else {
      std::fprintf(stderr, "hmoe cuda backend: expert calls through host nodes: %s\n",
                   c.status().ToString().c_str());
    }
  }
  auto gen = slots->Prepare(absl::Now() + absl::Seconds(10));
  if (!gen.ok()) {
    *why = gen.status().ToString();
    return std::make_unique<HostCopyPath>();
  }
  if (absl::Status st = RegisterSlotMemory(*slots); !st.ok()) {
    *why = st.ToString();
    return std::make_unique<HostCopyPath>();
  }
  std::vector<DeviceSlot> dev;
  if (ctl == nullptr || !MapDeviceWaits(*slots, &dev))
    return std::make_unique<HostNodePath>(std::move(slots), *gen);
  if (options.slot_calls == SlotCalls::kDeviceSends && MapDeviceSends(*slots, &dev))
    return std::make_unique<DeviceSendPath>(std::move(slots), *gen, std::move(ctl), std::move(dev));
  return std::make_unique<DeviceWaitPath>(std::move(slots), *gen, std::move(ctl), std::move(dev));
}

}  // namespace hmoe::cuda
