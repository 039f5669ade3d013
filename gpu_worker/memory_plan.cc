#include "gpu_worker/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/experts/weight_format.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/driver/attention.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// The CUDA backend's fixed workspaces (cuda_backend.cc): cuBLAS's own and
// PagedAttention's split-key scratch.
constexpr int64_t kBlasWorkspaceBytes = 32 << 20;
constexpr int64_t kAttentionScratchBytes = 8 << 20;
// The bound on that bf16 workspace for quantized dense weights.
constexpr int64_t kDenseSlabBytes = int64_t{64} << 20;
// Slot passes: up to this many tokens (cuda_backend_impl.h kSlotTokens).
constexpr int64_t kSlotTokens = 32;
// The first pass workspace the backend makes: table entries and logit rows.
constexpr int64_t kFirstTableEntries = 256 * 4;
constexpr int64_t kFirstLogitRows = 16;

int64_t Align256(int64_t n) { return (n + 255) / 256 * 256; }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string WName(DenseWeights w) { return std::string(DenseWeightsName(w)); }
std::string KName(KvDtype d) { return std::string(KvDtypeName(d)); }

std::string Gib(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / kGiB);
}

// Bytes of a weight of `shape` at the dense format `f` (matrices) or f32
// (vectors: biases, sinks).
int64_t DenseBytes(const Shape& shape, DenseFormat f) {
  if (shape.size() != 2) return NumElements(shape) * 4;
  return MatrixBytes(f.format, f.group, shape[0], shape[1]);
}

// The pass workspace of CudaBackend::EnsureWorkspace for T tokens,
// `table` block-table entries and R logit rows: its pieces, each at a
// 256-byte boundary.
int64_t PassWorkspaceBytes(const ModelConfig& c, int64_t max_inter, int64_t T, int64_t table,
                           int64_t R) {
  const int64_t H = c.hidden_size, E = c.moe.num_experts, K = c.moe.experts_per_token,
                V = c.vocab_size, nh = c.num_heads, rope_dim = AttentionGeometryFor(c).rope_dim;
  int64_t off = 0;
  auto piece = [&](int64_t bytes) {
    off = Align256(off);
    off += bytes;
  };
  for (int i = 0; i < 5; ++i) piece(T * H * 4);
  piece(T * H * 2);
  if (c.is_mla()) {
    const int64_t qr = c.mla.q_lora_rank.value_or(0), r = c.mla.kv_lora_rank,
                  rope = c.mla.qk_rope_head_dim, qk = c.mla.qk_head_dim(), vd = c.mla.v_head_dim;
    piece(T * qr * 4);
    piece(T * qr * 2);
    piece(T * nh * qk * 4);
    piece(T * (r + rope) * 4);
    piece(T * nh * (r + rope) * 4);
    piece(T * nh * r * 4);
    piece(T * nh * vd * 2);
  } else {
    const int64_t hd = c.head_dim, kvr = c.num_kv_heads * hd;
    piece(T * nh * hd * 4);
    piece(T * kvr * 4);
    piece(T * kvr * 4);
    piece(T * nh * hd * 4);
    piece(T * nh * hd * 2);
  }
  piece(T * 2 * max_inter * 4);
  piece(T * max_inter * 2);
  piece(T * E * 4);
  for (int i = 0; i < 6; ++i) piece(T * K * 4);
  piece(T * rope_dim * 4);
  piece(R * H * 4);
  piece(R * V * 4);
  piece((5 * T + table) * 4);
  return off;
}

// GpuHotExperts' buffers besides the experts (gpu_hot_experts.cc): ids,
// output and the kernel's scratch (hot_expert_kernels.cu CarveHot) for
// kSlotTokens tokens.
int64_t HotFixedBytes(const ModelConfig& c) {
  const int64_t T = kSlotTokens, H = c.hidden_size, I = c.moe.intermediate_size,
                K = c.moe.experts_per_token;
  const int64_t scratch = Align256(T * K * 4) + Align256(T * 4) + Align256(T * 4) +
                          Align256(T * K * 4) + Align256(T * H) + Align256(T * K * I) +
                          Align256(T * K * I * 4) + Align256(T * K * H * 4);
  return T * K * 8 + T * H * 4 + scratch;
}
// A layer's table of hot experts and its mask.
int64_t HotLayerBytes(const ModelConfig& c) {
  return c.moe.num_experts * static_cast<int64_t>(sizeof(cuda::DevExpert) + 1);
}

// StreamedExperts' device buffers (streamed_experts.cc) for passes of up to
// max_tokens tokens: one stage of a layer's experts plus the GEMM buffers;
// `stage` gets one stage's bytes (the prefetch stage is another).
int64_t StreamedBytes(const ModelConfig& c, WeightFormat f, int group, int64_t max_tokens,
                      int64_t* stage) {
  const int64_t H = c.hidden_size, I = c.moe.intermediate_size, E = c.moe.num_experts,
                K = c.moe.experts_per_token;
  const KernelMatrixBytes m[3] = {KernelLayoutBytes(f, group, I, H),
                                  KernelLayoutBytes(f, group, I, H),
                                  KernelLayoutBytes(f, group, H, I)};
  int64_t blob = 0;
  for (const KernelMatrixBytes& x : m) {
    blob = Align256(blob + x.w);
    blob = Align256(blob + x.scale);
  }
  const int64_t slots = max_tokens * K, idx_ints = 2 * slots + (slots + 3) / 4;
  *stage = E * blob;
  return E * blob + 2 * I * H * 2 + H * I * 2 + slots * H * 2 + slots * H * 4 +
         max_tokens * 2 * I * 4 + max_tokens * I * 2 + 2 * max_tokens * H * 4 + idx_ints * 4;
}

double BitsPerWeight(DenseWeights w) {
  return Traits(DenseFormatOf(w).format).bits;  // scales aside: they order the same
}

// What every candidate plan of one request shares: the weights on the GPU
// (the routed experts left out), each layer's attention kind, the KV bytes
// per token per dtype.
struct Shapes {
  std::vector<WeightSpec> weights;
  std::map<int, std::string> kind_of_layer;
  int64_t kv_per_token[3] = {};  // by KvDtype
};

absl::StatusOr<Shapes> ShapesOf(const ModelConfig& c) {
  Shapes s;
  for (WeightSpec& w : ExpectedWeights(c))
    if (w.role != WeightRole::kRoutedExpert) s.weights.push_back(std::move(w));
  for (int l = 0; l < c.num_layers; ++l) {
    ASSIGN_OR_RETURN(const AttentionSpec a, AttentionSpecFor(c, l));
    s.kind_of_layer[l] = std::string(AttentionKindName(a.kind));
  }
  for (KvDtype d : {KvDtype::kF32, KvDtype::kBf16, KvDtype::kFp8}) {
    ASSIGN_OR_RETURN(s.kv_per_token[static_cast<int>(d)], KvBytesPerToken(c, d));
  }
  return s;
}

struct Choice {
  DenseWeights weights = DenseWeights::kBf16;
  KvDtype kv = KvDtype::kF32;
  bool host_embedding = false;
  int64_t context = 0, batch = 1;
};

// One plan at fixed choices (no search, no message).
MemoryPlan Evaluate(const ModelConfig& c, const Shapes& shapes, const PlanRequest& req,
                    const Choice& ch) {
  MemoryPlan p;
  p.limit_bytes = std::llround(req.gpu_mem_gb * kGiB);
  p.weights = ch.weights;
  p.kv_dtype = ch.kv;
  p.host_embedding = ch.host_embedding;
  p.context = ch.context;
  p.batch = ch.batch;
  const DenseFormat fmt = DenseFormatOf(ch.weights);
  const std::string fmt_name(WName(ch.weights));
  // As the backends load (gpu_worker/cpu/dense_weights.h): auto at the
  // checkpoint's own precision keeps each tensor as stored (an fp8
  // checkpoint's LM head stays bf16); kv_b_proj (read by the MLA kernels) and
  // the DSA indexer stay bf16 in every format.
  const bool as_stored =
      req.weights == DenseWeights::kAuto && ch.weights == CheckpointDenseWeights(c);
  const DenseFormat bf16{WeightFormat::kBf16, 0};
  int64_t largest_quantized = 0;  // elements of the largest quantized matrix
  auto priced = [&](const WeightSpec& w, DenseFormat f) {
    if (w.matrix() && f.format != WeightFormat::kBf16)
      largest_quantized = std::max(largest_quantized, NumElements(w.shape));
    return DenseBytes(w.shape, f);
  };
  // Weights, by part.
  std::map<std::string, PlanPart> by_name;
  std::vector<std::string> order;
  auto add = [&](const std::string& name, const std::string& format, int64_t params, int64_t bytes,
                 bool on_gpu = true) {
    auto [it, fresh] = by_name.try_emplace(name);
    if (fresh) order.push_back(name);
    it->second.name = name;
    it->second.format = format;
    it->second.params += params;
    it->second.bytes += bytes;
    it->second.on_gpu = on_gpu;
  };
  int64_t max_inter = 0;
  for (const WeightSpec& w : shapes.weights) {
    const int64_t n = NumElements(w.shape);
    switch (w.role) {
      case WeightRole::kRoutedExpert:
        break;
      case WeightRole::kEmbedding:
        add("embedding", "bf16", n, n * 2, !ch.host_embedding);
        if (c.tie_word_embeddings && ch.host_embedding)  // the head needs its own copy
          add("LM head (tied, a copy)", fmt_name, 0, DenseBytes(w.shape, fmt));
        break;
      case WeightRole::kLmHead:
        add("LM head", as_stored ? "bf16" : fmt_name, n, priced(w, as_stored ? bf16 : fmt));
        break;
      case WeightRole::kNorm:
        add("norms", "f32", n, n * 4);
        break;
      case WeightRole::kAttention: {
        const bool keep = w.name.find("kv_b_proj") != std::string::npos ||
                          w.name.find(".indexer.") != std::string::npos;
        add(absl::StrCat("attention (", shapes.kind_of_layer.at(w.layer), ")"), fmt_name, n,
            priced(w, keep ? bf16 : fmt));
        break;
      }
      case WeightRole::kDenseMlp:
      case WeightRole::kSharedExpert:
        if (w.matrix())
          max_inter = std::max(max_inter, w.shape[1] == c.hidden_size ? w.shape[0] : w.shape[1]);
        add(w.role == WeightRole::kDenseMlp ? "dense MLPs" : "shared experts", fmt_name, n,
            priced(w, fmt));
        break;
      case WeightRole::kRouter:
        // An f32 copy (routing decisions in f32); the correction bias is a
        // buffer, not a parameter.
        add("router", "f32", w.matrix() ? n : 0, n * 4);
        break;
    }
  }
  for (const std::string& name : order) {
    const PlanPart& part = by_name[name];
    if (part.on_gpu) p.weight_bytes += part.bytes;
    p.parts.push_back(part);
  }
  // The KV pool.
  p.kv_bytes_per_token = shapes.kv_per_token[static_cast<int>(ch.kv)];
  p.kv_blocks = req.kv_blocks > 0 ? req.kv_blocks : ch.batch * CeilDiv(ch.context, kKvBlockTokens);
  p.kv_bytes = p.kv_blocks * kKvBlockTokens * p.kv_bytes_per_token;
  p.parts.push_back(
      {absl::StrCat("KV cache (", p.kv_blocks, " blocks of ", kKvBlockTokens, " tokens)"), 0,
       KName(ch.kv), p.kv_bytes, true});
  // Workspaces.
  const int64_t T = std::max<int64_t>(256, req.pass_tokens);
  p.pass_tokens = T;
  int64_t table = std::max(kFirstTableEntries, T * 4), rows = kFirstLogitRows;
  if (req.expert_slots) {
    table =
        std::max(table, std::min(kSlotTokens * CeilDiv(ch.context, kKvBlockTokens), p.kv_blocks));
    rows = std::max(rows, kSlotTokens);
  }
  auto workspace = [&](const std::string& name, int64_t bytes) {
    if (bytes == 0) return;
    p.parts.push_back({name, 0, "", bytes, true});
    p.workspace_bytes += bytes;
  };
  workspace("workspace: cuBLAS", kBlasWorkspaceBytes);
  // Quantized weights: prefill dequantizes slabs of rows into one bf16
  // workspace (cuda_backend.cc dense_ws_).
  workspace("workspace: dequantized slabs", std::min(largest_quantized * 2, kDenseSlabBytes));
  workspace("workspace: attention scratch", kAttentionScratchBytes);
  workspace(absl::StrCat("workspace: passes of ", T, " tokens"),
            PassWorkspaceBytes(c, max_inter, T, table, rows));
  const bool moe = c.num_moe_layers() > 0;
  if (moe) {
    p.hot_expert_bytes = HotExpertBytes(c, req.hot_format, req.hot_group);
    p.hot_experts_max = c.num_moe_layers() * c.moe.num_experts;
  }
  if (moe && req.hot_experts != nullptr && req.hot_experts->num_hot > 0) {
    p.hot_bytes = req.hot_experts->num_hot * p.hot_expert_bytes +
                  static_cast<int64_t>(req.hot_experts->hot.size()) * HotLayerBytes(c) +
                  HotFixedBytes(c);
    p.parts.push_back({absl::StrCat("hot experts (", req.hot_experts->num_hot, ")"),
                       req.hot_experts->num_hot * 3 * c.hidden_size * c.moe.intermediate_size,
                       WeightFormatName(req.hot_format, req.hot_group), p.hot_bytes, true});
  }
  int64_t stage = 0;
  if (moe && req.streamed_experts) {
    const int64_t max_tokens = ch.context > kSlotTokens
                                   ? std::min(req.prefill_stream_tokens, ch.context)
                                   : req.prefill_stream_tokens;
    workspace("streamed experts (one layer)",
              StreamedBytes(c, req.hot_format, req.hot_group, max_tokens, &stage));
  }
  p.total_bytes = p.weight_bytes + p.kv_bytes + p.workspace_bytes + p.hot_bytes;
  // The prefetch stage only where it still fits (the backend goes without).
  if (stage > 0 && req.prefill_prefetch && p.total_bytes + stage <= p.limit_bytes) {
    workspace("streamed experts (prefetch stage)", stage);
    p.total_bytes += stage;
    p.prefetch_stage = true;
  }
  p.left_bytes = p.limit_bytes - p.total_bytes;
  p.fits = p.left_bytes >= 0;
  if (moe && req.fill_hot_experts && p.hot_expert_bytes > 0) {
    const int64_t room = p.left_bytes - (p.hot_bytes > 0 ? 0 : HotFixedBytes(c)) -
                         c.num_moe_layers() * HotLayerBytes(c);
    p.hot_experts_fit =
        std::clamp<int64_t>(room / p.hot_expert_bytes, 0,
                            p.hot_experts_max - (req.hot_experts ? req.hot_experts->num_hot : 0));
  }
  return p;
}

// The largest context (whole blocks, at most `cap`) that fits at `ch`'s
// other choices; 0 when not even one block does.
int64_t MaxContext(const ModelConfig& c, const Shapes& shapes, const PlanRequest& req, Choice ch,
                   int64_t cap) {
  int64_t lo = 0, hi = CeilDiv(std::max<int64_t>(cap, kKvBlockTokens), kKvBlockTokens);
  while (lo < hi) {  // the most blocks per sequence that fit, in [0, hi]
    const int64_t mid = (lo + hi + 1) / 2;
    ch.context = mid * kKvBlockTokens;
    if (Evaluate(c, shapes, req, ch).fits)
      lo = mid;
    else
      hi = mid - 1;
  }
  return std::min(lo * kKvBlockTokens, std::max<int64_t>(cap, kKvBlockTokens));
}

// The dense formats below `w` (fewer bits per weight), highest first.
std::vector<DenseWeights> LowerThan(DenseWeights w) {
  std::vector<DenseWeights> out;
  for (DenseWeights x : {DenseWeights::kFp8, DenseWeights::kInt4})
    if (BitsPerWeight(x) < BitsPerWeight(w)) out.push_back(x);
  return out;
}

}  // namespace

DenseWeights CheckpointDenseWeights(const ModelConfig& c) {
  return c.quantization.method == "fp8" ? DenseWeights::kFp8 : DenseWeights::kBf16;
}

std::vector<DenseWeights> CudaBackendFormats() {
  return {DenseWeights::kBf16, DenseWeights::kFp8, DenseWeights::kInt8, DenseWeights::kInt4};
}

PlanRequest PlanRequestFor(const ModelConfig& c, const ModelOptions& o, int64_t limit_bytes,
                           std::vector<DenseWeights> loads) {
  PlanRequest r;
  r.gpu_mem_gb = static_cast<double>(limit_bytes) / kGiB;
  r.context = o.max_seq_len > 0 ? o.max_seq_len : c.max_position_embeddings;
  r.batch = std::max<int64_t>(1, o.cuda.kv_sequences);
  r.kv_blocks = o.cuda.kv_blocks;
  r.weights = o.weights;
  r.auto_order = std::move(loads);
  r.kv_dtype = o.kv_dtype;
  r.hot_experts = o.cuda.hot_experts.get();
  r.hot_format = o.cuda.hot_format;
  r.hot_group = o.cuda.hot_group;
  r.expert_slots = o.cuda.expert_slots;
  r.streamed_experts = o.cuda.prefill_experts != PrefillExperts::kCpu && o.deferred_experts == 0;
  r.prefill_stream_tokens = o.cuda.prefill_stream_tokens;
  r.prefill_prefetch = o.cuda.prefill_prefetch;
  r.pass_tokens = r.streamed_experts ? std::max<int64_t>(256, o.cuda.prefill_stream_tokens) : 256;
  return r;
}

absl::StatusOr<MemoryPlan> PlanCudaBackend(const ModelConfig& c, const ModelOptions& o,
                                           int64_t limit_bytes, std::vector<DenseWeights> loads) {
  PlanRequest r = PlanRequestFor(c, o, limit_bytes, std::move(loads));
  ASSIGN_OR_RETURN(MemoryPlan plan, PlanGpuMemory(c, r));
  if (plan.fits) return plan;
  if (r.kv_blocks == 0 && r.batch > 1) {
    int64_t lo = 0, hi = r.batch - 1;  // the most sequences that fit
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      r.batch = mid;
      ASSIGN_OR_RETURN(const MemoryPlan p, PlanGpuMemory(c, r));
      if (p.fits)
        lo = mid;
      else
        hi = mid - 1;
    }
    r.batch = std::max<int64_t>(1, lo);
    ASSIGN_OR_RETURN(plan, PlanGpuMemory(c, r));
    if (plan.fits) return plan;
  }
  return absl::ResourceExhaustedError(absl::StrCat("GPU memory plan: ", plan.message));
}

absl::StatusOr<int64_t> KvBytesPerToken(const ModelConfig& c, KvDtype dtype) {
  int64_t total = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    ASSIGN_OR_RETURN(const AttentionSpec s, AttentionSpecFor(c, l));
    const int64_t values = s.cache.k_row + s.cache.v_row;
    switch (dtype) {
      case KvDtype::kF32:
        total += values * 4;
        break;
      case KvDtype::kBf16:
        total += values * 2;
        break;
      case KvDtype::kFp8: {
        // One f32 scale per token per cache part: MLA's latent and rope part;
        // GQA's key and value of each kv head.
        const int64_t scales =
            s.kind == AttentionKind::kGqa ? (s.cache.v_row > 0 ? 2 : 1) * s.num_kv_heads : 2;
        total += values + scales * 4;
        break;
      }
    }
  }
  return total;
}

absl::StatusOr<MemoryPlan> PlanGpuMemory(const ModelConfig& c, const PlanRequest& req) {
  if (!(req.gpu_mem_gb > 0) || !std::isfinite(req.gpu_mem_gb) || req.gpu_mem_gb > 1e6)
    return absl::InvalidArgumentError(
        absl::StrCat("the GPU memory bound (--gpu-mem-gb) must be a positive number of GiB, got ",
                     req.gpu_mem_gb));
  if (req.context < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("the context (tokens per sequence) must be >= 1, got ", req.context));
  if (req.batch < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("the batch (sequences) must be >= 1, got ", req.batch));
  if (req.kv_blocks < 0)
    return absl::InvalidArgumentError(absl::StrCat("kv_blocks must be >= 0, got ", req.kv_blocks));
  if (req.pass_tokens < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("pass_tokens must be >= 1, got ", req.pass_tokens));
  if (req.fill_hot_experts || req.hot_experts != nullptr || req.streamed_experts) {
    if (!IsWeightFormat(req.hot_format) ||
        (IsGrouped(req.hot_format) && !TakesGroup(req.hot_format, req.hot_group)))
      return absl::InvalidArgumentError(absl::StrCat("hot expert format ",
                                                     static_cast<int>(req.hot_format), " group ",
                                                     req.hot_group, " is not a format"));
  }
  Choice ch;
  ch.kv = req.kv_dtype;
  ch.batch = req.batch;
  ch.context = req.context > 0 ? req.context : c.max_position_embeddings;
  if (ch.context < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("the context (tokens per sequence) must be >= 1: the config's "
                     "max_position_embeddings is ",
                     c.max_position_embeddings));
  // The candidates, best first: each format, the embedding on the GPU then
  // (when allowed) in host memory.
  std::vector<DenseWeights> formats;
  if (req.weights != DenseWeights::kAuto) {
    formats.push_back(req.weights);
  } else {
    const DenseWeights own = CheckpointDenseWeights(c);
    for (DenseWeights w : req.auto_order)
      if (w != DenseWeights::kAuto && BitsPerWeight(w) <= BitsPerWeight(own)) formats.push_back(w);
    if (formats.empty())
      for (DenseWeights w : req.auto_order)
        if (w != DenseWeights::kAuto) formats.push_back(w);
    if (formats.empty()) formats.push_back(DenseWeights::kBf16);
  }
  ASSIGN_OR_RETURN(const Shapes shapes, ShapesOf(c));
  MemoryPlan plan;
  bool found = false;
  for (DenseWeights w : formats) {
    for (bool host : {false, true}) {
      if (host && !req.host_embedding) continue;
      ch.weights = w;
      ch.host_embedding = host;
      plan = Evaluate(c, shapes, req, ch);
      if (plan.fits) {
        found = true;
        break;
      }
    }
    if (found) break;
  }
  // `plan` is the first that fits, else the last tried (the least memory).
  ch.weights = plan.weights;
  ch.host_embedding = plan.host_embedding;
  const int64_t cap = std::max(ch.context, c.max_position_embeddings);
  plan.max_context = MaxContext(c, shapes, req, ch, cap);
  const std::string summary = absl::StrCat(
      "weights ", WName(plan.weights), plan.host_embedding ? " (embedding in host memory)" : "",
      " ", Gib(plan.weight_bytes), " + KV cache ", KName(plan.kv_dtype), " ", Gib(plan.kv_bytes),
      " (", plan.context, " tokens x ", plan.batch, ") + workspaces ", Gib(plan.workspace_bytes),
      plan.hot_bytes > 0 ? absl::StrCat(" + hot experts ", Gib(plan.hot_bytes)) : "", " = ",
      Gib(plan.total_bytes), " of the ", Gib(plan.limit_bytes), " bound");
  if (plan.fits) {
    plan.message = absl::StrCat("fits: ", summary, "; ", Gib(plan.left_bytes), " left");
    return plan;
  }
  // Single changes that fit, smallest first.
  auto try_change = [&](const Choice& alt, const std::string& text) {
    if (Evaluate(c, shapes, req, alt).fits) plan.changes.push_back(text);
  };
  if (ch.kv == KvDtype::kF32) {
    Choice alt = ch;
    alt.kv = KvDtype::kBf16;
    try_change(alt, "a bf16 KV cache (--kv-dtype bf16)");
  }
  if (!ch.host_embedding) {
    Choice alt = ch;
    alt.host_embedding = true;
    try_change(alt, "the embedding in host memory");
  }
  for (DenseWeights w : LowerThan(ch.weights)) {
    Choice alt = ch;
    alt.weights = w;
    const std::string name = WName(w);
    try_change(alt, absl::StrCat(name, " weights (--gpu-weights ", name, ")"));
  }
  if (ch.kv != KvDtype::kFp8) {
    Choice alt = ch;
    alt.kv = KvDtype::kFp8;
    try_change(alt, "an fp8 KV cache (--kv-dtype fp8)");
  }
  if (ch.batch > 1 && req.kv_blocks == 0) {
    int64_t lo = 0, hi = ch.batch - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      Choice alt = ch;
      alt.batch = mid;
      if (Evaluate(c, shapes, req, alt).fits)
        lo = mid;
      else
        hi = mid - 1;
    }
    if (lo >= 1) plan.changes.push_back(absl::StrCat("a batch of at most ", lo, " sequences"));
  }
  if (plan.max_context > 0 && plan.max_context < ch.context)
    plan.changes.push_back(
        absl::StrCat("a context of at most ", plan.max_context, " tokens per sequence"));
  std::string change;
  if (!plan.changes.empty()) {
    change = absl::StrCat("; the smallest change: ", plan.changes[0]);
    if (plan.changes.size() > 1)
      absl::StrAppend(&change, " (or ",
                      absl::StrJoin(plan.changes.begin() + 1, plan.changes.end(), "; or "), ")");
  } else {
    // No single change: the least memory there is, and its context.
    Choice least = ch;
    least.weights = DenseWeights::kInt4;
    least.kv = KvDtype::kFp8;
    least.host_embedding = true;
    const int64_t ctx = MaxContext(c, shapes, req, least, ch.context);
    least.context = std::max<int64_t>(ctx, kKvBlockTokens);
    const MemoryPlan p = Evaluate(c, shapes, req, least);
    if (ctx > 0) {
      change = absl::StrCat(
          "; no single change fits: int4 weights, an fp8 KV cache, the embedding in host memory "
          "and a context of at most ",
          ctx, " tokens per sequence do");
      plan.changes.push_back(absl::StrCat(
          "int4 weights, an fp8 KV cache, the embedding in host memory and a context of at most ",
          ctx, " tokens"));
    } else {
      change = absl::StrCat(
          "; nothing fits: even int4 weights, an fp8 KV cache, the embedding "
          "in host memory and one block of context need ",
          Gib(p.total_bytes));
    }
  }
  plan.message =
      absl::StrCat("does not fit: ", summary, ", over by ", Gib(-plan.left_bytes), change);
  return plan;
}

std::string FormatPlan(const MemoryPlan& p) {
  std::string s;
  absl::StrAppendFormat(&s, "%-40s %10s %-8s %12s\n", "GPU memory plan", "params", "format",
                        "bytes");
  for (const PlanPart& part : p.parts) {
    const double n = static_cast<double>(part.params);
    const std::string params = n >= 1e9   ? absl::StrFormat("%.2f B", n / 1e9)
                               : n >= 1e6 ? absl::StrFormat("%.2f M", n / 1e6)
                               : n > 0    ? absl::StrFormat("%.1f K", n / 1e3)
                                          : "";
    absl::StrAppendFormat(&s, "  %-38s %10s %-8s %12s%s\n", part.name, params, part.format,
                          Gib(part.bytes), part.on_gpu ? "" : "  (host memory)");
  }
  absl::StrAppendFormat(&s, "  %-38s %10s %-8s %12s\n", "total on the GPU", "", "",
                        Gib(p.total_bytes));
  absl::StrAppendFormat(&s, "  %-38s %10s %-8s %12s\n", "bound", "", "", Gib(p.limit_bytes));
  absl::StrAppendFormat(&s, "  %-38s %10s %-8s %12s\n", "left (hot experts, larger passes)", "", "",
                        p.left_bytes >= 0 ? Gib(p.left_bytes) : "none");
  absl::StrAppend(
      &s, "KV cache       ", p.kv_bytes_per_token, " bytes per token (all layers); ", "context ",
      p.context, " x batch ", p.batch, "; the most that fits: ",
      p.max_context > 0 ? absl::StrCat(p.max_context, " tokens per sequence") : std::string("none"),
      "\n");
  if (p.hot_experts_max > 0 && p.hot_experts_fit > 0)
    absl::StrAppend(&s, "hot experts    ", p.hot_experts_fit, " of ", p.hot_experts_max,
                    " routed experts fit in what is left (", Gib(p.hot_expert_bytes), " each)\n");
  absl::StrAppend(&s, "verdict        ", p.message, "\n");
  return s;
}

}  // namespace hmoe
