#include "gpu_worker/cuda/host_node_path.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gpu_worker/cuda/device_memory.h"

namespace hmoe::cuda {
namespace {

void CUDART_CB SubmitHost(void* p) {
  const auto* c = static_cast<const HostCall*>(p);
  const int32_t T = *c->tokens;
  c->slots->Submit(c->a, c->layer, T, c->ka);
  if (c->b >= 0) c->slots->Submit(c->b, c->layer, T, c->kb);
  if (c->abort != nullptr && c->slots->has_failure())
    __atomic_store_n(c->abort, 1u, __ATOMIC_RELEASE);
}
void CUDART_CB WaitHost(void* p) {
  const auto* c = static_cast<const HostCall*>(p);
  c->slots->Wait(c->a);
}

}  // namespace

absl::Status RegisterSlotMemory(ExpertSlots& slots) {
  for (const HostRegion& r : slots.regions()) {
    cudaError_t e = cudaHostRegister(r.base, static_cast<size_t>(r.bytes),
                                     cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("cudaHostRegister of the ", slots.kind(),
                                              " expert slots (", r.bytes,
                                              " bytes): ", cudaGetErrorString(e)));
    }
    cudaGetLastError();
  }
  return absl::OkStatus();
}

HostNodePath::HostNodePath(std::unique_ptr<ExpertSlots> slots, uint64_t gen)
    : slots_(std::move(slots)), gen_(gen) {
  views_.resize(static_cast<size_t>(slots_->num_slots()));
  for (int i = 0; i < slots_->num_slots(); ++i) views_[static_cast<size_t>(i)] = slots_->view(i);
}

absl::Status HostNodePath::Register() {
  RETURN_IF_ERROR(RegisterSlotMemory(*slots_));
  for (int i = 0; i < slots_->num_slots(); ++i) views_[static_cast<size_t>(i)] = slots_->view(i);
  return absl::OkStatus();
}

absl::StatusOr<bool> HostNodePath::Prepare() {
  // A reconnect gets what a call gets (the slots fail fast while the
  // service is known down).
  ASSIGN_OR_RETURN(uint64_t gen, slots_->Prepare(absl::Now() + slots_->call_timeout()));
  if (gen == gen_) return false;
  RETURN_IF_ERROR(Register());
  gen_ = gen;
  return true;
}

absl::Status HostNodePath::Submit(const LayerCalls& c, bool capturing, CallRecord* record,
                                  StreamOps& ops) {
  (void)capturing;
  // Straight into the slots: bf16 rows (the post-attention norm's), ids, weights.
  auto to_slot = [&](int slot, const int32_t* ids, const float* w, int64_t k) -> absl::Status {
    const SlotView& v = views_[static_cast<size_t>(slot)];
    RETURN_IF_ERROR(
        ops.Copy(v.hidden, c.hidden, c.T * c.H * 2, cudaMemcpyDeviceToHost, "expert input copy"));
    RETURN_IF_ERROR(ops.Copy(v.ids, ids, c.T * k * 4, cudaMemcpyDeviceToHost, "expert ids copy"));
    return ops.Copy(v.weights, w, c.T * k * 4, cudaMemcpyDeviceToHost, "expert weights copy");
  };
  const int l = c.layer, n = c.later_k;
  RETURN_IF_ERROR(to_slot(2 * l, c.ids, c.weights, c.k));
  if (n > 0) RETURN_IF_ERROR(to_slot(2 * l + 1, c.later_ids, c.later_weights, n));
  HostCall& h = record->host_calls.emplace_back();
  h.slots = slots_.get();
  h.a = 2 * l;
  h.b = n > 0 ? 2 * l + 1 : -1;
  h.layer = l;
  h.ka = c.k;
  h.kb = n;
  h.tokens = tokens_;
  h.ids_a = views_[static_cast<size_t>(2 * l)].ids;
  h.ids_b = n > 0 ? views_[static_cast<size_t>(2 * l + 1)].ids : nullptr;
  h.abort = abort_word();
  h.hot_ids = c.hot_ids;
  cudaError_t e = cudaLaunchHostFunc(ops.stream(), SubmitHost, &h);
  if (e != cudaSuccess) return ops.Failed(CudaError(e, "expert submit node"));
  return absl::OkStatus();
}

absl::StatusOr<ResidualPart> HostNodePath::CopyAnswer(int slot, int64_t T, float* staging,
                                                      StreamOps& ops) {
  RETURN_IF_ERROR(ops.Copy(staging, views_[static_cast<size_t>(slot)].out, T * slots_->hidden() * 4,
                           cudaMemcpyHostToDevice, "expert output copy"));
  return ResidualPart::Scratch(staging);
}

absl::StatusOr<ResidualPart> HostNodePath::Wait(int layer, int part, int64_t T, float* staging,
                                                CallRecord* record, StreamOps& ops) {
  const int slot = 2 * layer + part;
  HostCall& h = record->host_calls.emplace_back();
  h.slots = slots_.get();
  h.a = slot;
  h.layer = layer;
  h.tokens = tokens_;
  cudaError_t e = cudaLaunchHostFunc(ops.stream(), WaitHost, &h);
  if (e != cudaSuccess) return ops.Failed(CudaError(e, "expert wait node"));
  return CopyAnswer(slot, T, staging, ops);
}

void HostNodePath::Routes(const CallRecord& record, int64_t T,
                          const std::function<void(int32_t, const int32_t*, int64_t)>& add) const {
  // The slots' ids are the device's copies (host nodes) or its writes
  // (device sends), still in place after the pass; the hot slots' were
  // copied out beside them. A hot split leaves kNoExpert in both arrays
  // where the other holds the slot.
  for (const HostCall& h : record.host_calls) {
    if (h.ids_a == nullptr) continue;  // a wait
    add(h.layer, h.ids_a, T * h.ka);
    if (h.hot_ids != nullptr) add(h.layer, h.hot_ids, T * h.ka);
    if (h.b >= 0) add(h.layer, h.ids_b, T * h.kb);
  }
  for (const SlotCall& c : record.slot_calls) {
    add(c.layer, views_[static_cast<size_t>(c.slot)].ids, T * c.k);
    if (c.hot_ids != nullptr) add(c.layer, c.hot_ids, T * c.k);
  }
}

int64_t HostNodePath::AbortPass() {
  // Calls the pass submitted and never waited on (it stopped half way).
  slots_->Drain();
  slots_->TakeStatus().IgnoreError();
  return slots_->TakeWaitNs();
}

}  // namespace hmoe::cuda
