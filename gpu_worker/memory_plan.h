// The GPU memory plan: what the CUDA backend holds on the device for a model
// and its options, part by part, from the config alone (no checkpoint, no
// CUDA): the weights at their formats, the paged KV cache for a context and
// a batch, the workspaces, what is left for hot experts, and whether it fits
// a bound; when it does not, the smallest changes that would. One function
// shared by `hmoe inspect --gpu-mem-gb` (sdk/inspect.h) and the CUDA backend,
// which plans before it allocates and refuses with the plan's message.
//
// What the backend holds (gpu_worker/cuda/cuda_backend.cc), as planned here:
//   embedding bf16 [V, H] (or in host memory: a row lookup per token);
//   attention, dense MLPs, shared experts and an untied LM head at the dense
//   format (DenseFormatOf: codes + scales, common/experts/format_codes.h
//   MatrixBytes), their biases f32; norms f32; the router an f32 copy [E, H]
//   and its correction bias f32;
//   the KV pool: whole blocks of kKvBlockTokens tokens, per layer the key
//   row (MLA: latent + rope part) and the value row (GQA) at the KV dtype;
//   fp8 adds one f32 scale per token per cache part (MLA: 2; GQA: one per kv
//   head for keys and one for values);
//   workspaces: cuBLAS's (32 MiB), PagedAttention's split-key scratch
//   (8 MiB), the pass workspace for `pass_tokens` tokens (its pieces as
//   CudaBackend::EnsureWorkspace carves them), hot experts' and streamed
//   experts' buffers. GEMM attention's scratch is not planned: it grows into
//   what is left (at most 1 GiB) and falls back to PagedAttention without.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/expert_placement.h"
#include "common/experts/format_codes.h"
#include "common/model_config.h"
#include "gpu_worker/model.h"

namespace hmoe {

inline constexpr int64_t kKvBlockTokens = 16;  // the paged pool's block (cuda kBlockTokens)

struct PlanRequest {
  double gpu_mem_gb = 0;  // the bound in GiB (> 0)
  int64_t context = 0;    // tokens per sequence; 0: config max_position_embeddings
  int64_t batch = 1;      // sequences of `context` the KV pool holds at once (>= 1)
  int64_t kv_blocks = 0;  // > 0: the pool's blocks exactly, instead of context x batch
  // kAuto: the checkpoint's own precision (fp8 for config.quantization
  // "fp8", else bf16), lowered along auto_order only as far as needed to fit.
  DenseWeights weights = DenseWeights::kAuto;
  // The formats auto may choose, from high to low precision. Those above the
  // checkpoint's own are skipped (unless that leaves none). int8 is not in
  // the default order: it saves nothing over fp8 (both a byte per weight).
  std::vector<DenseWeights> auto_order = {DenseWeights::kBf16, DenseWeights::kFp8,
                                          DenseWeights::kInt4};
  KvDtype kv_dtype = KvDtype::kF32;
  // The embedding may stay in host memory when the plan needs the room
  // (tried before lowering a format: it costs no accuracy).
  bool host_embedding = false;
  // Hot experts already placed (CudaOptions::hot_experts), at hot_format.
  const Placement* hot_experts = nullptr;
  // Fill what is left with hot experts at hot_format (reports how many fit).
  bool fill_hot_experts = false;
  WeightFormat hot_format = WeightFormat::kInt4;
  int hot_group = 64;
  // The workspace is planned for passes of up to this many tokens (the
  // backend makes it for 256 at start and grows it for larger passes).
  int64_t pass_tokens = 256;
  // Slot passes (routed experts called from the device): their block table
  // covers kSlotTokens sequences.
  bool expert_slots = true;
  // Hybrid prefill's streamed experts (CudaOptions::prefill_experts not kCpu,
  // without Expert Deferral): one MoE layer's experts at hot_format, two
  // with prefill_prefetch (when that still fits).
  bool streamed_experts = false;
  int64_t prefill_stream_tokens = 8192;
  bool prefill_prefetch = true;
};

struct PlanPart {
  std::string name;  // "embedding", "attention (mla)", "KV cache", "workspace: pass" ...
  int64_t params = 0;
  std::string format;  // "bf16", "fp8", "f32", ... ("" for workspaces)
  int64_t bytes = 0;
  bool on_gpu = true;  // false: in host memory (not counted in the total)
};

struct MemoryPlan {
  int64_t limit_bytes = 0;
  DenseWeights weights = DenseWeights::kBf16;  // resolved
  KvDtype kv_dtype = KvDtype::kF32;
  bool host_embedding = false;  // the plan keeps the embedding in host memory
  int64_t context = 0, batch = 0;
  int64_t kv_blocks = 0;
  int64_t pass_tokens = 0;         // the pass workspace's tokens
  bool prefetch_stage = false;     // streamed experts' prefetch stage planned (it fits)
  int64_t kv_bytes_per_token = 0;  // all layers, one token
  std::vector<PlanPart> parts;     // weights, then the KV cache, then workspaces
  int64_t weight_bytes = 0, kv_bytes = 0, workspace_bytes = 0, hot_bytes = 0;
  int64_t total_bytes = 0;  // on the GPU
  int64_t left_bytes = 0;   // limit - total (negative: over the bound)
  // Hot experts: one expert's bytes at hot_format, and with fill_hot_experts
  // how many fit in what is left (of hot_experts_max routed experts).
  int64_t hot_expert_bytes = 0, hot_experts_fit = 0, hot_experts_max = 0;
  bool fits = false;
  // The largest context per sequence (a multiple of kKvBlockTokens) that
  // fits at this plan's formats and batch; 0 when none does.
  int64_t max_context = 0;
  // When it does not fit: single changes that would make it fit, smallest
  // first (e.g. "--kv-dtype fp8", "--gpu-weights int4", "--context 40960").
  std::vector<std::string> changes;
  // "fits: ..." or "does not fit: ...; the smallest change: ...".
  std::string message;
};

// INVALID_ARGUMENT naming the field for a bound that is not a positive
// finite number, a negative context, a batch < 1, a negative kv_blocks or
// pass_tokens < 1; UNIMPLEMENTED for an attention kind the plan cannot size. A plan that does
// not fit is not an error: see MemoryPlan::fits and message.
absl::StatusOr<MemoryPlan> PlanGpuMemory(const ModelConfig& config, const PlanRequest& request);

// The request the CUDA backend plans with under a bound of `limit_bytes`:
// options.max_seq_len (resolved) per sequence, cuda.kv_sequences of them or
// exactly cuda.kv_blocks blocks, the weights and KV dtype asked for (auto
// among `loads`, the formats the backend loads), its hot experts, streamed
// experts (prefill_experts not kCpu, without Expert Deferral; then passes of
// prefill_stream_tokens, else of 256 tokens) and expert slots.
PlanRequest PlanRequestFor(const ModelConfig& config, const ModelOptions& options,
                           int64_t limit_bytes, std::vector<DenseWeights> loads);

// The precision a checkpoint stores its dense weights in: kFp8 for an fp8
// (128 x 128 block) checkpoint, else kBf16. --gpu-weights auto at this
// precision keeps each tensor as stored.
DenseWeights CheckpointDenseWeights(const ModelConfig& config);

// The dense formats the CUDA backend loads, highest precision first: what
// its --gpu-weights auto chooses among (the `loads` below).
std::vector<DenseWeights> CudaBackendFormats();

// The CUDA backend's plan under a bound of `limit_bytes`: PlanRequestFor's;
// when cuda.kv_sequences sequences do not fit (and cuda.kv_blocks is 0), as
// many whole sequences as fit. RESOURCE_EXHAUSTED with the plan's message
// (what does not fit, the smallest change) when not even one sequence fits
// or cuda.kv_blocks do not; PlanGpuMemory's errors otherwise.
absl::StatusOr<MemoryPlan> PlanCudaBackend(const ModelConfig& config, const ModelOptions& options,
                                           int64_t limit_bytes, std::vector<DenseWeights> loads);

// KV cache bytes of one token over all layers at `dtype` (fp8 with its scales).
absl::StatusOr<int64_t> KvBytesPerToken(const ModelConfig& config, KvDtype dtype);

// The plan as a table (one row per part, then the totals and the verdict).
std::string FormatPlan(const MemoryPlan& plan);

}  // namespace hmoe
