#include "gpu_worker/cuda/device_wait_path.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "gpu_worker/cuda/expert_call_kernels.h"

namespace hmoe::cuda {

absl::StatusOr<std::unique_ptr<WaitControl>> WaitControl::Create(int num_slots) {
  auto w = std::make_unique<WaitControl>();
  const int64_t ctl_bytes = 64 + 4 * static_cast<int64_t>(num_slots);
  absl::Status st = w->ctl_.Allocate(ctl_bytes);
  void* d = nullptr;
  if (st.ok() && cudaHostGetDevicePointer(&d, w->ctl_.as<void>(), 0) != cudaSuccess) {
    cudaGetLastError();
    st = absl::InternalError("cudaHostGetDevicePointer of the wait words");
  }
  if (st.ok()) st = w->send_counter_.Allocate(4);
  if (st.ok() && cudaMemset(w->send_counter_.as<void>(), 0, 4) != cudaSuccess) {
    cudaGetLastError();
    st = absl::InternalError("cudaMemset of the send counter");
  }
  RETURN_IF_ERROR(st);
  std::memset(w->ctl_.as<void>(), 0, static_cast<size_t>(ctl_bytes));
  w->abort_host_ = w->ctl_.as<uint32_t>();
  w->abort_dev_ = static_cast<uint32_t*>(d);
  w->armed_host_ = reinterpret_cast<uint32_t*>(w->ctl_.as<uint8_t>() + 64);
  w->armed_dev_ = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(d) + 64);
  w->waited_host_ = reinterpret_cast<unsigned long long*>(w->ctl_.as<uint8_t>() + 8);
  w->waited_dev_ = reinterpret_cast<unsigned long long*>(static_cast<uint8_t*>(d) + 8);
  return w;
}

bool MapDeviceWaits(const ExpertSlots& slots, std::vector<DeviceSlot>* out) {
  std::vector<DeviceSlot> w(static_cast<size_t>(slots.num_slots()));
  bool all = true;
  for (int i = 0; i < slots.num_slots() && all; ++i) {
    const ExpertSlots::DeviceWait dw = slots.device_wait(i);
    void* d = nullptr;
    all = dw.word != nullptr && cudaHostGetDevicePointer(&d, dw.word, 0) == cudaSuccess;
    w[static_cast<size_t>(i)] =
        DeviceSlot{static_cast<uint32_t*>(d), dw.busy_lo, dw.busy_hi, dw.request};
  }
  cudaGetLastError();
  if (all) *out = std::move(w);
  return all;
}

DeviceWaitPath::DeviceWaitPath(std::unique_ptr<ExpertSlots> slots, uint64_t gen,
                               std::unique_ptr<WaitControl> ctl, std::vector<DeviceSlot> dev)
    : HostNodePath(std::move(slots), gen), ctl_(std::move(ctl)), dev_(std::move(dev)) {
  watchdog_ = std::thread([this] { Watchdog(); });
}

DeviceWaitPath::~DeviceWaitPath() {
  {
    std::lock_guard<std::mutex> lock(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  watchdog_.join();
}

void DeviceWaitPath::Watchdog() {
  std::unique_lock<std::mutex> lock(wd_mu_);
  while (!wd_stop_) {
    wd_cv_.wait_for(lock, std::chrono::milliseconds(10));
    // Under wd_mu_, as BeginPass's reset: a late store cannot land in the
    // next pass.
    if (!wd_stop_ && in_pass_.load() && !slots_->service_alive())
      __atomic_store_n(ctl_->abort_host(), 1u, __ATOMIC_RELEASE);
  }
}

absl::Status DeviceWaitPath::Register() {
  RETURN_IF_ERROR(HostNodePath::Register());
  if (!MapDeviceWaits(*slots_, &dev_))
    return absl::InternalError(absl::StrCat(
        "the ", slots_->kind(), " expert slots moved and their state words are no longer mapped"));
  return absl::OkStatus();
}

void DeviceWaitPath::BeginPass(const int32_t* tokens) {
  HostNodePath::BeginPass(tokens);
  std::lock_guard<std::mutex> lock(wd_mu_);
  __atomic_store_n(ctl_->abort_host(), 0u, __ATOMIC_RELEASE);
  in_pass_.store(true);
}

absl::Status DeviceWaitPath::EnqueueWait(int slot, StreamOps& ops) {
  // Polls the slot's state word; the host's Wait follows after the pass.
  const DeviceSlot& w = dev_[static_cast<size_t>(slot)];
  const uint64_t timeout_ns =
      static_cast<uint64_t>(std::max<int64_t>(1, absl::ToInt64Nanoseconds(slots_->call_timeout())));
  return ops.Launched(WaitHostWord(w.word, w.lo, w.hi, ctl_->abort_dev(), timeout_ns,
                                   ctl_->waited_dev(), ops.stream()),
                      "WaitHostWord");
}

absl::StatusOr<ResidualPart> DeviceWaitPath::Wait(int layer, int part, int64_t T, float* staging,
                                                  CallRecord* record, StreamOps& ops) {
  (void)record;
  const int slot = 2 * layer + part;
  RETURN_IF_ERROR(EnqueueWait(slot, ops));
  return CopyAnswer(slot, T, staging, ops);
}

absl::Status DeviceWaitPath::FinishPass(const CallRecord* /*record*/) {
  if (!in_pass_.load()) return absl::OkStatus();
  in_pass_.store(false);
  slots_->Drain();
  AfterDrain();
  // A wait the device gave up (its timeout, the watchdog, a failed arm or
  // submit) may have let the adds read a stale answer, even when every call
  // was answered by the time of the host's Wait: the pass is dropped.
  if (__atomic_load_n(ctl_->abort_host(), __ATOMIC_ACQUIRE) != 0)
    return absl::UnavailableError(
        "routed experts: the device stopped waiting for an expert answer (the call's deadline "
        "passed or the expert service went away); the pass is dropped");
  return absl::OkStatus();
}

int64_t DeviceWaitPath::TakeWaitNs() {
  int64_t wait = slots_->TakeWaitNs();
  wait += static_cast<int64_t>(__atomic_load_n(ctl_->waited_host(), __ATOMIC_ACQUIRE));
  __atomic_store_n(ctl_->waited_host(), 0ull, __ATOMIC_RELEASE);
  return wait;
}

int64_t DeviceWaitPath::AbortPass() {
  in_pass_.store(false);
  __atomic_store_n(ctl_->waited_host(), 0ull, __ATOMIC_RELEASE);
  return HostNodePath::AbortPass();
}

}  // namespace hmoe::cuda
