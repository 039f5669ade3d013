// LayerBackend: the narrow set of per-backend operations the model driver
// (model_driver.h) schedules. A backend (gpu_worker/cpu/, gpu_worker/cuda/)
// owns the weights, the activations of one pass and the KV caches; the driver
// owns everything that is the same on every backend: step validation, token
// positions and rope rows, the layer schedule, the routed-expert calls and
// Expert Deferral's split and join.
//
// A pass runs, on one thread, in this order:
//   Begin(tokens)                       x = embed(ids)
//   per layer l:
//     Attention(l)                      x += attn_l(input_norm(x)); h = post_norm(x)
//     dense layer: DenseMlp(l)          x += mlp_l(h)
//     MoE layer:   Route(l)             router on h -> ids, weights, h on the host
//                  StartSharedExperts(l)  y = shared_l(h), may run asynchronously
//                  AddExperts(l, out)   x += out (+ y)
//     AddToResidual(v)                  x += v (a deferred call's sum, any time)
//   Logits(out)                         lm_head(final_norm(x)) for the kept rows
// then Commit (success) or Abort (any error after Begin). A backend runs one
// pass at a time; the driver serializes them. "x +=" is the plain residual
// scheme; a backend joins sublayers through the config's scheme
// (residual.h), runs each layer's attention by its kind (attention.h) and
// routes by the GateSpec's kind (routing.h).
//
// Device-side expert calls. A backend that took the routed experts
// (AttachExperts returned true) may run a pass's expert calls itself through
// fixed slots (gpu_worker/transport/expert_slots.h): when pass_uses_slots()
// after Begin, a MoE layer is
//     RouteToSlots(l, gate, n)   router, Deferral's split, both parts submitted
//     StartSharedExperts(l)
//     JoinSlot(l, 0)             wait; x += the routed sum (+ y)
// and, with n > 0, JoinSlot(l, 1) (the deferred part) where the driver
// joins deferred calls. When replayed() after Begin, the backend has
// already run the whole pass (a CUDA Graph): the driver goes straight to
// Logits and Commit. When Logits fails and capture_fell_back(), the pass
// was only captured, not run, and the capture failed: Abort and run the
// pass again (the backend now runs it without a graph).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/model.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe {

// One Sequence's KV storage in a backend.
class KvCache {
 public:
  virtual ~KvCache() = default;
  // Makes room for positions [0, n) (n <= the capacity it was made with);
  // RESOURCE_EXHAUSTED when the backend's block pool cannot supply it.
  virtual absl::Status Reserve(int64_t n) = 0;
  // Keeps positions [0, n) and returns what holds later ones to the pool,
  // when there is one (Shrink(0): all).
  virtual void Shrink(int64_t n) = 0;
};

// The tokens of one pass, in step order.
struct PassTokens {
  std::vector<int32_t> ids;         // [T]
  std::vector<KvCache*> kv;         // [T] each token's Sequence's cache
  std::vector<int64_t> pos;         // [T] each token's position
  int64_t max_pos = 0;              // max of pos
  int64_t rope_dim = 0;             // floats per rope row
  std::vector<float> rope_cs;       // [T, rope_dim] RopeCosSin rows
  std::vector<int32_t> logit_rows;  // tokens whose logits Logits returns, in order
  int64_t size() const { return static_cast<int64_t>(ids.size()); }
};

// A MoE layer's routed work as Route leaves it on the host: pointers owned by
// the backend, valid until the next Route or the end of the pass.
struct RoutedInput {
  const float* hidden = nullptr;   // [T, H] post-attention-norm hidden states
  const int32_t* ids = nullptr;    // [T, k]
  const float* weights = nullptr;  // [T, k] final routing weights
};

class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  virtual const char* name() const = 0;  // "cpu", "cuda"
  virtual std::unique_ptr<KvCache> NewKvCache(int64_t capacity) = 0;
  virtual int64_t kv_blocks_total() const { return 0; }
  virtual int64_t kv_block_tokens() const { return 16; }
  // Launch counts and GPU time (ModelStats' backend fields).
  virtual void AddStats(ModelStats* stats) const { (void)stats; }
  // Model::health(): any thread, never blocked by a running pass.
  virtual absl::Status health() const { return absl::OkStatus(); }

  // The pass protocol above. `tokens` stays valid until Commit / Abort; each
  // token's cache has been Reserved for its position.
  virtual absl::Status Begin(const PassTokens& tokens) = 0;
  virtual absl::Status Attention(int layer) = 0;
  virtual absl::Status DenseMlp(int layer) = 0;
  virtual absl::Status Route(int layer, const GateSpec& gate, RoutedInput* out) = 0;
  virtual absl::Status StartSharedExperts(int layer) = 0;
  // Large passes (not through slots; hybrid prefill): the backend may
  // compute some of layer `layer`'s routed slots itself. It writes ids_out =
  // in.ids ([T, k]) with the slots it took set to kNoExpert (what the
  // caller sends to the routed experts) and adds their sum in AddExperts.
  // Returns the slots taken; 0: none, ids_out unspecified.
  virtual absl::StatusOr<int64_t> TakeRoutedSlots(int layer, const RoutedInput& in, int64_t T,
                                                  int k, int32_t* ids_out) {
    (void)layer, (void)in, (void)T, (void)k, (void)ids_out;
    return int64_t{0};
  }
  // `routed`: [T, H] host f32, the routed experts' sum for the pass's tokens
  // (less what TakeRoutedSlots took, which the backend adds itself);
  // nullptr when TakeRoutedSlots took every slot (nothing to upload).
  virtual absl::Status AddExperts(int layer, const float* routed) = 0;
  virtual absl::Status AddToResidual(const float* v) = 0;  // [T, H] host f32

  // Device-side expert calls (see above). `experts` outlives the backend.
  virtual bool AttachExperts(RoutedExperts* experts) {
    (void)experts;
    return false;
  }
  virtual bool pass_uses_slots() const { return false; }
  virtual bool replayed() const { return false; }
  virtual bool capture_fell_back() { return false; }
  virtual absl::Status RouteToSlots(int layer, const GateSpec& gate, int deferred) {
    (void)layer, (void)gate, (void)deferred;
    return absl::UnimplementedError("RouteToSlots: this backend has no expert slots");
  }
  virtual absl::Status JoinSlot(int layer, int part) {
    (void)layer, (void)part;
    return absl::UnimplementedError("JoinSlot: this backend has no expert slots");
  }
  // out: [logit_rows.size(), vocab] host f32.
  virtual absl::Status Logits(float* out) = 0;
  // After a slot pass's Logits succeeded, before Commit: calls add(layer,
  // ids, n) with host arrays of n ids each that together hold every routed
  // (token, slot) of the pass's MoE layers once, whoever computed it (the
  // expert service, a hot expert on the device; the deferred part too).
  // Negative ids fill a slot that another array holds. The driver counts
  // them (routing stats); a pass not through slots calls nothing.
  virtual void SlotPassRoutes(
      const std::function<void(int32_t layer, const int32_t* ids, int64_t n)>& add) const {
    (void)add;
  }
  // Ends the pass (the driver then advances the Sequences or not).
  virtual absl::Status Commit() { return absl::OkStatus(); }
  virtual void Abort() {}
};

}  // namespace hmoe
