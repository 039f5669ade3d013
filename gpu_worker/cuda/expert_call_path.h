// How a CUDA pass's routed experts are called (driver/backend.h, "Device-side
// expert calls"). One ExpertCallPath is chosen once, when the backend takes
// the routed experts (ChooseExpertCallPath), from the options and what the
// transport offers:
//   host copy    no slots: the driver calls RoutedExperts with host copies
//                (Route / AddExperts); passes are never captured.
//   host node    slots; host nodes on the stream submit each call and wait
//                for its answer (HostNodePath).
//   device wait  slots; a host node submits, a kernel polls the slot's state
//                word for the answer (DeviceWaitPath).
//   device send  slots; one kernel writes the request into the slot and
//                sends it, a kernel polls for the answer; the host only arms
//                the calls (DeviceSendPath).
// A slot path enqueues its work on the backend's stream through StreamOps,
// so that it is captured into the pass's graph like the layer ops. Internal
// to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/cuda/cuda_options.h"
#include "gpu_worker/routed_experts.h"
#include "gpu_worker/transport/expert_slots.h"

namespace hmoe::cuda {

// The backend's stream as a path enqueues on it: launches counted and
// failures made sticky (or, while capturing, a fallback) as the backend's own.
class StreamOps {
 public:
  virtual ~StreamOps() = default;
  virtual cudaStream_t stream() const = 0;
  // A kernel launch's result (counted).
  virtual absl::Status Launched(cudaError_t e, const char* what) = 0;
  // cudaMemcpyAsync on the stream (not counted).
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                            const char* what) = 0;
  // Any other failed enqueue (a host node).
  virtual absl::Status Failed(absl::Status st) = 0;
};

// A term of JoinResidual (residual_join.h): a device [rows, H] f32 buffer,
// `scratch` when the join may sum into it; null data: absent.
struct ResidualPart {
  const float* data = nullptr;
  bool scratch = false;
  static ResidualPart In(const float* p) { return {p, false}; }
  static ResidualPart Scratch(float* p) { return {p, true}; }
};

// A host node's arguments: submit slot a (and b when >= 0) or wait for slot a.
struct HostCall {
  ExpertSlots* slots = nullptr;
  int a = -1, b = -1;
  int32_t layer = 0, ka = 0, kb = 0;
  const int32_t* tokens = nullptr;  // pinned: the pass's real token count
  // A submit's: the slots' ids (null: a wait), for ExpertCallPath::Routes.
  const int32_t *ids_a = nullptr, *ids_b = nullptr;
  uint32_t* abort = nullptr;  // device waits: set when a call failed (later waits end at once)
  const int32_t* hot_ids = nullptr;  // pinned: slot a's hot slots (hot experts), or null
};
// One routed-expert call the device sends (armed by the host).
struct SlotCall {
  int slot = 0;
  int32_t layer = 0, k = 0;
  const int32_t* hot_ids = nullptr;  // pinned: the call's hot slots (hot experts), or null
};
// What a pass's expert calls leave for the host: they live as long as the
// graph that captured them (or the eager pass).
struct CallRecord {
  std::deque<HostCall> host_calls;
  std::vector<SlotCall> slot_calls;
  void Clear() {
    host_calls.clear();
    slot_calls.clear();
  }
};

// One MoE layer's calls of a slot pass (device pointers unless said).
struct LayerCalls {
  int layer = 0;
  const uint16_t* hidden = nullptr;  // bf16 [T, H]
  int64_t T = 0, H = 0;
  const int32_t* ids = nullptr;  // [T, k]: the call (hot slots already kNoExpert)
  const float* weights = nullptr;
  int32_t k = 0;
  const int32_t* later_ids = nullptr;  // [T, later_k]: Deferral's part (later_k 0: none)
  const float* later_weights = nullptr;
  int32_t later_k = 0;
  const int32_t* hot_ids = nullptr;  // pinned: the call's hot slots (for Routes), or null
};

class ExpertCallPath {
 public:
  virtual ~ExpertCallPath() = default;
  virtual const char* name() const = 0;  // "host copy", "host node", "device wait", "device send"
  // Who sends the calls and waits for the answers, for the log.
  virtual const char* description() const = 0;
  // False: the host copy path (no slot passes; the rest is not called).
  virtual bool uses_slots() const { return true; }
  virtual ExpertSlots* slots() { return nullptr; }

  // Before a slot pass: reconnects to a restarted service; true when the
  // slots moved (graphs that captured the old ones must go).
  virtual absl::StatusOr<bool> Prepare() { return false; }
  // A slot pass begins; `tokens` (pinned) holds its real token count.
  virtual void BeginPass(const int32_t* tokens) { (void)tokens; }
  // Enqueues layer calls' submission (slot 2l, and 2l+1 for the later part);
  // host-side arguments go to `record`. `capturing`: a graph is being
  // captured (what must be done at launch is done by Arm).
  virtual absl::Status Submit(const LayerCalls& c, bool capturing, CallRecord* record,
                              StreamOps& ops) {
    (void)c, (void)capturing, (void)record, (void)ops;
    return absl::UnimplementedError("Submit: the host copy path has no slots");
  }
  // Enqueues the wait for slot 2l + part and returns its answer ([T, H] f32
  // on the device), `staging` ([T, H] device) when it must be copied there.
  virtual absl::StatusOr<ResidualPart> Wait(int layer, int part, int64_t T, float* staging,
                                            CallRecord* record, StreamOps& ops) {
    (void)layer, (void)part, (void)T, (void)staging, (void)record, (void)ops;
    return absl::UnimplementedError("Wait: the host copy path has no slots");
  }
  // A captured graph is launched (once captured, or replayed) with `record`.
  virtual void Arm(const CallRecord& record) { (void)record; }
  // After a slot pass's last GPU work (synchronized): the host side of what
  // the device did. UNAVAILABLE when the device stopped waiting for an answer.
  virtual absl::Status FinishPass(const CallRecord* record) {
    (void)record;
    return absl::OkStatus();
  }
  // After a slot pass that completed (FinishPass OK), with its `record` and
  // real token count T: calls add(layer, ids, n) with the host's copies of
  // what its calls routed (each slot's ids, the hot slots split off), which
  // together hold every routed (token, slot) of the pass once
  // (LayerBackend::SlotPassRoutes).
  virtual void Routes(const CallRecord& record, int64_t T,
                      const std::function<void(int32_t, const int32_t*, int64_t)>& add) const {
    (void)record, (void)T, (void)add;
  }
  // The calls' failures since the last take (an expert call that failed
  // inside the pass fails the pass).
  virtual absl::Status TakeStatus() { return absl::OkStatus(); }
  // Host time waited for the experts since the last take.
  virtual int64_t TakeWaitNs() { return 0; }
  // The pass stopped half way (its GPU work drained): calls left are
  // released. Returns the host time waited.
  virtual int64_t AbortPass() { return 0; }
};

// The options a path is chosen from.
struct ExpertCallOptions {
  bool slots = true;                               // CudaOptions::expert_slots
  SlotCalls slot_calls = SlotCalls::kDeviceSends;  // CudaOptions::slot_calls
  ExpertSlotsOptions slot_options;
};

// The path for `experts`: host copy when slots are off or the transport has
// none (`why` says why, for the log), else the most the transport offers of
// device send, device wait and host node, up to options.slot_calls.
std::unique_ptr<ExpertCallPath> ChooseExpertCallPath(RoutedExperts* experts,
                                                     const ExpertCallOptions& options,
                                                     std::string* why);

}  // namespace hmoe::cuda
