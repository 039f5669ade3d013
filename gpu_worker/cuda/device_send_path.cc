#include "gpu_worker/cuda/device_send_path.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cuda/expert_call_kernels.h"

namespace hmoe::cuda {

bool MapDeviceSends(const ExpertSlots& slots, std::vector<DeviceSlot>* dev) {
  bool ok = !dev->empty() && std::all_of(dev->begin(), dev->end(),
                                         [](const DeviceSlot& w) { return w.request != 0; });
  // The device writes the requests and reads the answers in place.
  for (int i = 0; i < slots.num_slots() && ok; ++i) {
    const SlotView v = slots.view(i);
    DeviceSlot& w = (*dev)[static_cast<size_t>(i)];
    void *h = nullptr, *d = nullptr, *wt = nullptr, *o = nullptr;
    ok = cudaHostGetDevicePointer(&h, v.hidden, 0) == cudaSuccess &&
         cudaHostGetDevicePointer(&d, v.ids, 0) == cudaSuccess &&
         cudaHostGetDevicePointer(&wt, v.weights, 0) == cudaSuccess &&
         cudaHostGetDevicePointer(&o, const_cast<float*>(v.out), 0) == cudaSuccess;
    w.hidden = static_cast<uint16_t*>(h);
    w.ids = static_cast<int32_t*>(d);
    w.weights = static_cast<float*>(wt);
    w.out = static_cast<const float*>(o);
  }
  cudaGetLastError();
  return ok;
}

absl::Status DeviceSendPath::Register() {
  RETURN_IF_ERROR(DeviceWaitPath::Register());
  if (!MapDeviceSends(*slots_, &dev_))
    return absl::InternalError(absl::StrCat("the ", slots_->kind(),
                                            " expert slots moved and their regions are no "
                                            "longer mapped for device sends"));
  return absl::OkStatus();
}

void DeviceSendPath::BeginPass(const int32_t* tokens) {
  DeviceWaitPath::BeginPass(tokens);
  slots_->SetDeviceSends(true);
}

void DeviceSendPath::ArmCalls(const std::vector<SlotCall>& calls) {
  const int32_t T = *tokens_;
  uint32_t* armed = ctl_->armed_host();
  for (const SlotCall& c : calls) armed[c.slot] = slots_->Arm(c.slot, c.layer, T, c.k) ? 1u : 0u;
  // A call not armed for a failure (e.g. its slot still holds an abandoned
  // call): the pass's waits end at once rather than spin on that slot.
  if (slots_->has_failure()) __atomic_store_n(ctl_->abort_host(), 1u, __ATOMIC_RELEASE);
}

absl::Status DeviceSendPath::Submit(const LayerCalls& c, bool capturing, CallRecord* record,
                                    StreamOps& ops) {
  // The host arms the calls (now, or at the graph's launch); one kernel per
  // call writes its request into the slot and sends it.
  const int l = c.layer;
  const SlotCall sc[2] = {{2 * l, l, c.k, c.hot_ids}, {2 * l + 1, l, c.later_k}};
  const int32_t* ids[2] = {c.ids, c.later_ids};
  const float* ws[2] = {c.weights, c.later_weights};
  for (int i = 0; i < (c.later_k > 0 ? 2 : 1); ++i) {
    record->slot_calls.push_back(sc[i]);
    if (!capturing) ArmCalls({sc[i]});
    const DeviceSlot& w = dev_[static_cast<size_t>(sc[i].slot)];
    RETURN_IF_ERROR(
        ops.Launched(SendExpertCall(c.hidden, c.T, c.H, ids[i], ws[i], sc[i].k, w.hidden, w.ids,
                                    w.weights, w.word, w.request, ctl_->armed_dev() + sc[i].slot,
                                    ctl_->abort_dev(), ctl_->send_counter(), ops.stream()),
                     "SendExpertCall"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ResidualPart> DeviceSendPath::Wait(int layer, int part, int64_t T, float* staging,
                                                  CallRecord* record, StreamOps& ops) {
  (void)T, (void)staging, (void)record;
  const int slot = 2 * layer + part;
  RETURN_IF_ERROR(EnqueueWait(slot, ops));
  // The sum is read in place from the slot.
  return ResidualPart::In(dev_[static_cast<size_t>(slot)].out);
}

void DeviceSendPath::AfterDrain() { slots_->SetDeviceSends(false); }

int64_t DeviceSendPath::AbortPass() {
  in_pass_.store(false);
  __atomic_store_n(ctl_->waited_host(), 0ull, __ATOMIC_RELEASE);
  // Armed calls the device never sent are released at once.
  slots_->SetDeviceSends(false);
  return HostNodePath::AbortPass();
}

}  // namespace hmoe::cuda
