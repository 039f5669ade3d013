// The CUDA backend's options (ModelOptions::cuda). CUDA-free: the model API
// and the flag edges include it in every build; without CUDA they are unused.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "common/expert_placement.h"
#include "common/experts/format_codes.h"
#include "gpu_worker/driver/prefill_plan.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe {

// Where the routed experts of a large pass (hybrid prefill) run, per MoE layer.
enum class PrefillExperts {
  kCpu,     // the expert service, as a decode step's cold experts
  kStream,  // every expert with tokens uploaded and computed on the GPU
  kAuto,    // PlanPrefillLayer's choice: cpu, stream or a split of the two
};
std::string_view PrefillExpertsName(PrefillExperts p);  // "cpu" | "stream" | "auto"
std::optional<PrefillExperts> ParsePrefillExperts(std::string_view s);

// Who sends a slot pass's expert calls and waits for their answers: at most
// this, as far as the transport allows (gpu_worker/cuda/expert_call_path.h).
enum class SlotCalls {
  kHostNodes,    // host nodes on the stream submit and wait
  kDeviceWaits,  // host nodes submit, the device polls the slot's state word
  kDeviceSends,  // the device writes and sends the call, and polls for its answer
};

struct CudaOptions {
  int device = 0;  // the device ordinal
  // Bound on weights + KV cache + workspaces in GiB (emulates a smaller
  // card); 0: the device's free memory less 1 GiB. What does not fit fails at
  // load with RESOURCE_EXHAUSTED naming the sizes.
  double gpu_mem_gb = 0;
  // Blocks of kv_block_tokens() tokens in the paged KV cache; 0: enough for
  // kv_sequences sequences of max_seq_len, or for as many whole sequences as
  // fit (gpu_worker/memory_plan.h; not even one: RESOURCE_EXHAUSTED at load
  // with the plan's smallest change).
  int64_t kv_blocks = 0;
  int64_t kv_sequences = 16;  // the worker's --max-batch
  // Passes of up to 32 tokens (decode steps, small chunks) run with their
  // routed experts called from the device through fixed slots, padded to a
  // bucket of 1, 2, 4, 8, 16 or 32 tokens; with `graphs` each bucket's pass
  // is captured once as a CUDA Graph and replayed (false: the same work
  // launched kernel by kernel).
  bool graphs = true;
  // false: every pass's routed experts go the host-copy way (no slots, no
  // graphs).
  bool expert_slots = true;
  // Slots over shm: the device sends each expert call itself (a kernel
  // storing REQUEST into the slot's state word in the registered segment,
  // which the service then polls) and waits for the answer itself (a kernel
  // polling that word), so a slot pass has no host nodes. A transport
  // without such words (staged slots) gets host nodes.
  SlotCalls slot_calls = SlotCalls::kDeviceSends;
  // Hot experts: this placement's routed experts, quantized from the
  // checkpoint as the expert service does (`hot_format`, int4 with
  // `hot_group`; use the service's --format), are computed on the GPU in
  // passes of up to 32 tokens, and those calls' slots reach the service
  // empty (kNoExpert). Larger passes send every expert to the service; a
  // deferred part always goes there. Null: none.
  std::shared_ptr<const Placement> hot_experts;
  WeightFormat hot_format = WeightFormat::kBf16;
  int hot_group = 64;
  // Where the GPU's copies of routed experts (hot, streamed) come from;
  // empty: the checkpoint. The benchmark passes the service's synthetic
  // experts (SyntheticExpertSource) so both sides hold the same model.
  ExpertSourceFn expert_source;
  // Hybrid prefill: where the routed experts of a pass of more than 32
  // tokens (and at most prefill_stream_tokens) run, per MoE layer. kStream:
  // over bf16 copies of the service's quantized weights, by cuBLAS; kAuto:
  // PlanPrefillLayer from the PCIe and GEMM rates measured at load and the
  // service's rates measured at the first such pass, so both finish
  // together. kStream and kAuto keep a pinned host copy of every routed
  // expert in `hot_format` (as much host memory as the service's weights)
  // and one layer's experts on the GPU. Not with deferred_experts (those
  // passes stay kCpu).
  PrefillExperts prefill_experts = PrefillExperts::kCpu;
  // kAuto: the cost model's rates from here instead of measured; the backend
  // logs what it measured in this form (PrefillRatesJson) for a file the
  // worker's --prefill-rates reads.
  std::optional<PrefillRates> prefill_rates;
  int64_t prefill_stream_tokens = 8192;
  // kStream / kAuto: a second device stage into which, once a layer's
  // streamed experts are enqueued, the next MoE layer's are uploaded ahead (a
  // guess: every expert when this layer streamed every expert, else the
  // experts that layer streamed in the last large pass). Costs one more
  // layer's experts of GPU memory (without room for it: one stage).
  bool prefill_prefetch = true;
  // A run of at least this many consecutive positions of one sequence in a
  // pass (a prompt chunk) computes its attention by tensor-core GEMMs over
  // its gathered keys; shorter runs and slot passes use PagedAttention
  // (fp32). 0: PagedAttention for every pass.
  int64_t gemm_attention_tokens = 64;
  // GEMM attention's inputs rounded to TF32 (tensor cores); false: full-fp32
  // GEMMs (PagedAttention's rounding up to summation order).
  bool gemm_attention_tf32 = true;
  bool log_prefill_plans = false;  // one stderr line per streamed pass: each layer's choice
  // Fault tests only: > 0 injects a sticky device error (a trapping kernel)
  // at the start of pass number debug_fault_after + 1.
  int64_t debug_fault_after = 0;
};

}  // namespace hmoe
