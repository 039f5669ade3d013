// Model: the model executor's API — load a checkpoint, keep per-request
// state in a Sequence (its KV cache), and run prefill / decode steps that
// return logits.
//
// One backend-neutral driver (gpu_worker/driver/) runs the layer schedule
// over a backend (ModelOptions::backend): the CPU reference (gpu_worker/cpu/:
// the exact forward pass of deepseek_v3, deepseek_v2, qwen3_moe and mixtral
// as transformers 5 computes it, in fp32 math, weights as stored: bf16 read
// in place, fp8 dequantized with its block scale_inv at load; the numerics
// ground truth for every faster path) or CUDA (gpu_worker/cuda/: weights on
// the GPU in ModelOptions::weights' format, a paged KV cache, cuBLAS and our
// kernels).
//
// Threading: a Model is immutable after Load; Forward may be called from
// several threads at once on different Sequences (the passes run one at a
// time). A Sequence must not be used by two calls at once.
//
// Errors (absl::Status): loading names the file or tensor (NOT_FOUND for a
// missing file/tensor, INVALID_ARGUMENT for bad shapes/dtypes/options,
// UNIMPLEMENTED for unsupported configs); Forward returns INVALID_ARGUMENT for
// an empty step, a token id outside [0, vocab_size) (naming the id and the
// size) or a Sequence of another Model, RESOURCE_EXHAUSTED when the tokens do
// not fit the Sequence's capacity, and passes on RoutedExperts errors (e.g.
// UNAVAILABLE). A failed Forward leaves the Sequence as it was.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/expert_placement.h"
#include "common/kv_quant.h"
#include "common/load_progress.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/routing_stats.h"
#include "common/safetensors.h"
#include "gpu_worker/cuda/cuda_options.h"
#include "gpu_worker/driver/prefill_plan.h"
#include "gpu_worker/hot_weights.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe {

// Precision of the model's own weights on the backend: attention, dense
// MLPs, shared experts, LM head (norms, biases, the router and its
// correction bias stay as stored; so do MLA's kv_b_proj, read by the
// attention kernels in bf16, and a head tied to the embedding). kAuto: the
// checkpoint's own, tensor by tensor (fp8 128 x 128 blocks as shipped, else
// bf16), lowered only as far as the memory plan needs. The CPU reference
// computes with the stored codes' values (gpu_worker/cpu/dense_weights.h).
enum class DenseWeights { kAuto, kBf16, kFp8, kInt8, kInt4 };
// "auto" | "bf16" | "fp8" | "int8" | "int4"
std::string_view DenseWeightsName(DenseWeights w);
std::optional<DenseWeights> ParseDenseWeights(std::string_view s);
// The stored form of a resolved (non-auto) choice, in the routed experts'
// format vocabulary: bf16; fp8 = kFp8 group 128 (e4m3, an f32 scale per
// 128 x 128 block, as DeepSeek's checkpoints ship it); int8 = kInt8 (an f32
// scale per output row); int4 = kInt4 group 128 (an f32 scale per 128).
struct DenseFormat {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
};
DenseFormat DenseFormatOf(DenseWeights w);  // w != kAuto

// Element type of the KV cache (MLA's latent + rope rows, GQA's keys and
// values). kFp8: e4m3 with one f32 scale per token per cache part (MLA: the
// latent and the rope part; GQA: each kv head's key and value). Values are
// rounded at cache write as common/kv_quant.h specifies, identically on
// every backend.
enum class KvDtype { kF32, kBf16, kFp8 };
std::string_view KvDtypeName(KvDtype d);  // "f32" | "bf16" | "fp8"
std::optional<KvDtype> ParseKvDtype(std::string_view s);
inline KvElem KvElemOf(KvDtype d) {
  return d == KvDtype::kBf16 ? KvElem::kBf16 : d == KvDtype::kFp8 ? KvElem::kFp8 : KvElem::kF32;
}

struct ModelOptions {
  // Where the model (all but the routed experts) runs: "cpu" (the reference),
  // "cuda" (gpu_worker/cuda/, needs a build with CUDA and a usable GPU) or
  // "auto" (cuda when a usable GPU is present, else cpu). Resolved by Create:
  // options() reports "cpu" or "cuda".
  std::string backend = "cpu";
  // The CUDA backend's own options (backend "cuda", or "auto" resolved to it).
  CudaOptions cuda;
  int num_threads = 0;      // worker threads for the parallel loops; 0: hardware concurrency
  int64_t max_seq_len = 0;  // Sequence capacity in tokens; 0: config max_position_embeddings
  // Expert Deferral: per token, the `deferred_experts` lowest-weighted routed
  // experts of each MoE layer but the last layer are submitted as a second
  // RoutedExperts call that is waited on only at the end of the next layer,
  // where their sum joins the residual (one layer late): the expert service
  // computes them while the next layer's attention runs. 0 (default): off,
  // the exact model; otherwise in [1, experts_per_token - 1]. Changes the
  // numbers (an approximation; bench/results has its perplexity cost).
  int deferred_experts = 0;
  DenseWeights weights = DenseWeights::kAuto;
  KvDtype kv_dtype = KvDtype::kBf16;
  // Borrowed, outlives the Model; null: no metrics. Load registers
  //   hmoe_expert_deferred_slots_total: routed (token, expert) slots whose
  //     result Expert Deferral joined one layer late, of passes that
  //     completed (ModelStats::deferred_expert_slots).
  MetricsRegistry* metrics = nullptr;
  // Borrowed, outlives Load; null: silent. Model::Load reports the bytes of
  // the tensors it takes (all but the routed experts) as "loading weights",
  // the CUDA backend its pinned copy of the routed experts (hybrid prefill)
  // as "pinning routed experts": each a LoadProgressReporter made from these.
  const LoadProgressOptions* load_progress = nullptr;
};

// Per-request state: the tokens seen so far, as each layer's KV cache.
//
// Cache layout of the CPU backend: MLA layers keep what MLA needs, per
// position the kv_a_layernorm'ed latent [kv_lora_rank] followed by the roped
// shared key [qk_rope_head_dim] (the per-head keys and values are never
// expanded: attention runs in the latent space with kv_b_proj absorbed into
// the query and the output); GQA layers keep the roped (and, for Qwen3,
// k-normed) keys and the values, [num_kv_heads * head_dim] each. All
// positions are kept, also for sliding-window layers (the mask skips old ones).
// Storage grows on demand up to capacity().
class Sequence {
 public:
  virtual ~Sequence() = default;
  virtual int64_t length() const = 0;    // tokens in the cache (the next token's position)
  virtual int64_t capacity() const = 0;  // max tokens
  virtual void Reset() = 0;              // forget all tokens (a paged cache returns its blocks)
};

enum class LogitsMode {
  kAll,   // one row per input token: [T, vocab_size]
  kLast,  // the last token's row only: [vocab_size]
};

// One sequence's part of Model::ForwardBatch; pointers are borrowed for the call.
struct ForwardStep {
  Sequence* seq = nullptr;
  absl::Span<const int32_t> tokens;  // T >= 1, appended at seq->length()
  LogitsMode mode = LogitsMode::kLast;
  std::vector<float>* logits = nullptr;  // resized as by Forward
};

// Cumulative counters of a Model's forward passes (for benchmarks).
struct ModelStats {
  int64_t passes = 0;
  int64_t tokens = 0;
  // Routed (token, expert) slots that Expert Deferral sent as a layer's
  // deferred part (ModelOptions::deferred_experts), whatever path called
  // them: tokens x deferred_experts per MoE layer but the last, per pass.
  int64_t deferred_expert_slots = 0;
  int64_t kernel_launches = 0;  // cuda: kernels and library GEMM calls launched
  int64_t gpu_busy_ns = 0;      // cuda: device time between each pass's first and last GPU work
  int64_t expert_wait_ns = 0;   // host time blocked on RoutedExperts::Wait (or a slot's)
  int64_t graph_launches = 0;   // cuda: CUDA Graph launches (one per replayed pass)
  int64_t graph_captures = 0;   // cuda: graphs captured (once per bucket, again after a
                                // workspace or slot move)
  // cuda, hybrid prefill: MoE layers of large passes by where their routed
  // experts ran, and the routed slots computed by streamed experts.
  int64_t prefill_cpu_layers = 0, prefill_stream_layers = 0, prefill_split_layers = 0;
  int64_t streamed_slots = 0;
  // Experts of the next MoE layer uploaded ahead (prefill_prefetch), and of
  // those the ones its layer then computed.
  int64_t prefetched_experts = 0, prefetch_used_experts = 0;
  // cuda: tokens whose attention ran by GEMMs (cuda_gemm_attention_tokens),
  // counted once per layer.
  int64_t gemm_attention_tokens = 0;
  // cuda: device memory the backend holds by its --gpu-mem-gb accounting
  // (weights, KV pool, workspaces, hot and streamed experts): what
  // gpu_worker/memory_plan.h plans.
  int64_t gpu_bytes = 0;
  // cuda: how expert calls go, chosen once at start ("host copy", "host
  // node", "device wait" or "device send"); "" on other backends.
  const char* expert_call_path = "";
};

class Model {
 public:
  virtual ~Model() = default;

  // Reads DIR/config.json and the checkpoint in DIR, validates the tensors
  // against the config (CheckWeights) and loads them. `experts`: where routed
  // experts are computed; null builds the in-process reference from the same
  // checkpoint (owned by the Model). A non-null one is borrowed and must
  // outlive the Model.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir,
                                                     const ModelOptions& options = {},
                                                     RoutedExperts* experts = nullptr);
  // Same, from a parsed config and an open checkpoint (the Model keeps what
  // it needs; `ckpt` may be closed afterwards).
  static absl::StatusOr<std::unique_ptr<Model>> Create(const ModelConfig& config,
                                                       const Checkpoint& ckpt,
                                                       const ModelOptions& options = {},
                                                       RoutedExperts* experts = nullptr);

  virtual const ModelConfig& config() const = 0;
  virtual const ModelOptions& options() const = 0;  // with defaults resolved
  virtual std::unique_ptr<Sequence> NewSequence() const = 0;
  // The paged KV cache, when the backend has one (cuda): a Sequence takes
  // blocks of kv_block_tokens() as it grows and returns them on Reset and
  // destruction; Forward fails RESOURCE_EXHAUSTED when the pool is empty.
  // 0: no shared pool (cpu: each Sequence grows its own storage).
  virtual int64_t kv_blocks_total() const { return 0; }
  virtual int64_t kv_block_tokens() const { return 16; }
  virtual ModelStats stats() const { return {}; }
  // Tokens routed to each routed expert of each MoE layer since load
  // (common/routing_stats.h), by the passes that completed: each routed
  // (token, slot) once, whatever path or backend computed it; a pass that
  // failed counts nothing (its tokens count when a later pass runs them).
  // Empty for a model without MoE layers.
  virtual RoutingTable routing_stats() const { return {}; }
  // OK while the model can run passes; otherwise the failure that stopped it
  // for good (cuda: a CUDA or cuBLAS error leaves the device context unusable,
  // so every later pass fails with it). Callable from any thread, also during
  // a pass, without waiting for it.
  virtual absl::Status health() const { return absl::OkStatus(); }

  // Appends `tokens` (T >= 1) to `seq` at positions length() .. length()+T-1
  // and writes logits to `logits` (resized: [T, V] for kAll, [V] for kLast).
  absl::Status Forward(Sequence& seq, absl::Span<const int32_t> tokens, LogitsMode mode,
                       std::vector<float>* logits) const;

  // Several sequences' steps as one forward pass: all their tokens share the
  // projections, MLPs and routed experts (one RoutedExperts call per MoE
  // layer for the whole batch); attention reads each token's own Sequence.
  // Each step gets the logits Forward would give it alone, up to the
  // rounding of expert kernels that depend on the batch (the CPU reference
  // with in-process experts: bit for bit). Errors are Forward's; a step's
  // validation error (token id, capacity, foreign Sequence) is prefixed
  // "step i: " when there are several steps, and a Sequence in two steps is
  // INVALID_ARGUMENT. All or nothing: on any error no Sequence changes.
  virtual absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const = 0;

  // Conveniences over Forward.
  absl::StatusOr<std::vector<float>> Prefill(Sequence& seq, absl::Span<const int32_t> tokens,
                                             LogitsMode mode = LogitsMode::kAll) const;
  absl::StatusOr<std::vector<float>> Decode(Sequence& seq, int32_t token) const;  // [V]
};

// The backend ModelOptions::backend names: "cpu" and "cuda" as themselves
// when usable, "auto" as cuda when a usable GPU is present, else cpu.
// INVALID_ARGUMENT for another name; cuda without a build with CUDA:
// UNIMPLEMENTED; cuda without a usable device: FAILED_PRECONDITION saying why.
absl::StatusOr<std::string> ResolveBackend(const std::string& name, int cuda_device = 0);

// A CUDA device's memory as its driver reports it (cudaMemGetInfo): `used`
// is every process's allocations on the device together (total - free).
struct DeviceMemory {
  int64_t used_bytes = 0;
  int64_t total_bytes = 0;
};
// Quick (no device synchronization), callable from any thread; selects
// `cuda_device` on the calling thread. UNIMPLEMENTED in a build without
// CUDA; FAILED_PRECONDITION naming the device when it cannot be queried.
absl::StatusOr<DeviceMemory> QueryDeviceMemory(int cuda_device);

}  // namespace hmoe
