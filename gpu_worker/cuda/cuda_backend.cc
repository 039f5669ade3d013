#include "gpu_worker/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"
#include "gpu_worker/cuda/dense_linear_kernels.h"
#include "gpu_worker/cuda/device_status.h"
#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"
#include "gpu_worker/cuda/residual_join.h"
#include "gpu_worker/cuda/router_kernels.h"
#include "gpu_worker/driver/residual.h"
#include "gpu_worker/memory_plan.h"

namespace hmoe::cuda {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// PagedAttention's split-key scratch: its most (dv 512) is 8 MiB.
constexpr int64_t kAttentionScratchBytes = 8 << 20;
// cuBLAS's own workspace (set explicitly so that graph capture never needs
// it to allocate).
constexpr int64_t kBlasWorkspaceBytes = 32 << 20;
// Quantized dense weights in passes above kDenseGemvMaxTokens: the most a
// slab of dequantized rows takes (larger matrices go in several slabs).
constexpr int64_t kDenseSlabBytes = 64 << 20;

}  // namespace

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  streamed_.reset();  // uses stream_ (and the budget) as it goes
  graphs_.reset();
  calls_.reset();  // its slots' before_release unregisters their memory
  for (auto& e : pass_ev_)
    if (e) cudaEventDestroy(e);
  if (done_ev_) cudaEventDestroy(done_ev_);
  for (auto& e : events_) cudaEventDestroy(e);
  if (blas_) cublasDestroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaBackend::AddStats(ModelStats* s) const {
  s->kernel_launches += launches_;
  s->gpu_busy_ns += busy_ns_;
  if (graphs_) {
    s->graph_launches += graphs_->launches();
    s->graph_captures += graphs_->captures();
  }
  s->expert_wait_ns += slot_wait_ns_;
  if (calls_) s->expert_call_path = calls_->name();
  s->prefill_cpu_layers += prefill_layers_[0];
  s->prefill_stream_layers += prefill_layers_[1];
  s->prefill_split_layers += prefill_layers_[2];
  s->streamed_slots += streamed_slots_;
  if (streamed_) {
    s->prefetched_experts += streamed_->prefetched();
    s->prefetch_used_experts += streamed_->prefetch_used();
  }
  s->gemm_attention_tokens += gemm_attention_tokens_;
  s->gpu_bytes += budget_.used();
}

absl::Status CudaBackend::Upload(const void* host, int64_t bytes, DeviceBuffer* out,
                                 const std::string& what) {
  RETURN_IF_ERROR(budget_.Take(bytes, what));
  RETURN_IF_ERROR(out->Allocate(bytes));
  HMOE_CUDA_TRY(
      cudaMemcpy(out->as<void>(), host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
      "upload");
  return absl::OkStatus();
}

absl::Status CudaBackend::UploadMatrix(const QuantMatrix& m, DevLin* out) {
  out->rows = m.rows;
  out->cols = m.cols;
  out->format = m.format;
  out->group = m.group;
  const int64_t n = m.rows * m.cols;
  switch (m.format) {
    case WeightFormat::kBf16:
      return Upload(m.bf16.data(), n * 2, &out->w, "weights");
    case WeightFormat::kFp8:
    case WeightFormat::kInt8:
    case WeightFormat::kInt4: {
      const std::vector<uint8_t> codes = cpu::DenseCodes(m);
      RETURN_IF_ERROR(Upload(codes.data(), static_cast<int64_t>(codes.size()), &out->w, "weights"));
      break;
    }
    default:
      return absl::InternalError(absl::StrCat("cuda backend: dense weights of format ",
                                              Traits(m.format).name, " have no kernel"));
  }
  RETURN_IF_ERROR(
      Upload(m.scale.data(), static_cast<int64_t>(m.scale.size()) * 4, &out->s, "weights"));
  dense_ws_need_ = std::max(dense_ws_need_, n * 2);
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadLin(const Checkpoint& ckpt, const std::string& prefix,
                                  const cpu::WeightLoad& load, DevLin* out) {
  ASSIGN_OR_RETURN(QuantMatrix m, cpu::LoadDenseMatrix(ckpt, prefix + ".weight", load));
  RETURN_IF_ERROR(UploadMatrix(m, out));
  ASSIGN_OR_RETURN(std::vector<float> bias,
                   cpu::LoadOptionalVector(ckpt, prefix + ".bias", m.rows));
  if (!bias.empty())
    RETURN_IF_ERROR(Upload(bias.data(), static_cast<int64_t>(bias.size()) * 4, &out->b, "weights"));
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadMlp(const Checkpoint& ckpt, const MlpNames& n, DevMlp* out) {
  ASSIGN_OR_RETURN(QuantMatrix g, cpu::LoadDenseMatrix(ckpt, n.gate + ".weight", load_));
  ASSIGN_OR_RETURN(QuantMatrix u, cpu::LoadDenseMatrix(ckpt, n.up + ".weight", load_));
  if (g.rows != u.rows || g.cols != u.cols)
    return absl::InvalidArgumentError(
        absl::StrCat(ckpt.dir(), ": ", n.gate, " and ", n.up, " differ in shape"));
  const int64_t I = g.rows, H = g.cols;
  if (g.format == WeightFormat::kBf16 && u.format == WeightFormat::kBf16) {
    std::vector<uint16_t> gu(g.bf16);
    gu.insert(gu.end(), u.bf16.begin(), u.bf16.end());
    out->gate_up.rows = 2 * I;
    out->gate_up.cols = H;
    RETURN_IF_ERROR(Upload(gu.data(), 2 * I * H * 2, &out->gate_up.w, "weights"));
  } else {
    out->split = true;
    RETURN_IF_ERROR(UploadMatrix(g, &out->gate_up));
    RETURN_IF_ERROR(UploadMatrix(u, &out->up));
  }
  ASSIGN_OR_RETURN(std::vector<float> gb, cpu::LoadOptionalVector(ckpt, n.gate + ".bias", I));
  ASSIGN_OR_RETURN(std::vector<float> ub, cpu::LoadOptionalVector(ckpt, n.up + ".bias", I));
  if (!gb.empty() || !ub.empty()) {
    gb.resize(static_cast<size_t>(I), 0.0f);
    ub.resize(static_cast<size_t>(I), 0.0f);
    gb.insert(gb.end(), ub.begin(), ub.end());
    RETURN_IF_ERROR(Upload(gb.data(), 2 * I * 4, &out->gate_up.b, "weights"));
  }
  out->inter = I;
  RETURN_IF_ERROR(LoadLin(ckpt, n.down, load_, &out->down));
  max_inter_ = std::max(max_inter_, I);
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadVec(const Checkpoint& ckpt, const std::string& name, int64_t n,
                                  DeviceBuffer* out) {
  ASSIGN_OR_RETURN(std::vector<float> v, cpu::LoadVector(ckpt, name, n));
  return Upload(v.data(), n * 4, out, "weights");
}

absl::Status CudaBackend::Init(const Checkpoint& ckpt) {
  HMOE_CUDA_TRY(cudaSetDevice(cu_.device), "cudaSetDevice");
  // Every wait for the GPU blocks instead of spinning: the expert service's
  // pinned threads hold every core, and a spinning CUDA thread (the host
  // nodes' worker included) sharing one of them costs whole scheduler time
  // slices per expert call (measured: 2.7-3.6 ms per call, 10x the kernel).
  HMOE_CUDA_TRY(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync), "cudaSetDeviceFlags");
  size_t free_b = 0, total_b = 0;
  HMOE_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const int64_t free_bytes = static_cast<int64_t>(free_b);
  int64_t limit = free_bytes - static_cast<int64_t>(kGiB);
  if (cu_.gpu_mem_gb > 0) {
    const int64_t want = static_cast<int64_t>(cu_.gpu_mem_gb * kGiB);
    if (want > free_bytes)
      return absl::ResourceExhaustedError(absl::StrCat(
          "--gpu-mem-gb ", cu_.gpu_mem_gb, " exceeds GPU ", cu_.device, "'s free memory: ",
          Gib(static_cast<double>(free_bytes)), " free of ", Gib(static_cast<double>(total_b))));
    limit = want;
  }
  // The default bound leaves 1 GiB to CUDA and cuBLAS: a device with less
  // free than that fails here, before any of the backend is made.
  if (limit <= kBlasWorkspaceBytes)
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU ", cu_.device, " has ", Gib(static_cast<double>(free_bytes)), " of ",
        Gib(static_cast<double>(total_b)),
        " memory free; the cuda backend leaves 1 GiB to CUDA and cuBLAS and needs room for its "
        "weights, KV cache and workspace (free the device's memory, or bound it with "
        "--gpu-mem-gb)"));
  // The memory plan (gpu_worker/memory_plan.h, as `hmoe inspect --gpu-mem-gb`
  // prints it): what does not fit is refused here, before any allocation;
  // the first workspace and the KV pool follow it.
  ASSIGN_OR_RETURN(const MemoryPlan plan, PlanCudaBackend(c_, o_, limit, CudaBackendFormats()));
  prefetch_planned_ = plan.prefetch_stage;
  // --gpu-weights auto that the plan had to lower: every dense matrix at the
  // plan's format (as the plan priced it).
  if (o_.weights == DenseWeights::kAuto && plan.weights != CheckpointDenseWeights(c_))
    load_ = cpu::WeightLoadFor(c_, plan.weights);
  std::fprintf(stderr, "hmoe cuda backend: GPU memory plan %s\n", plan.message.c_str());
  budget_ = Budget(limit);
  HMOE_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  HMOE_CUBLAS_TRY(cublasCreate(&blas_), "cublasCreate");
  HMOE_CUBLAS_TRY(cublasSetStream(blas_, stream_), "cublasSetStream");
  RETURN_IF_ERROR(budget_.Take(kBlasWorkspaceBytes, "workspace"));
  RETURN_IF_ERROR(blas_ws_.Allocate(kBlasWorkspaceBytes));
  HMOE_CUBLAS_TRY(cublasSetWorkspace(blas_, blas_ws_.as<void>(), kBlasWorkspaceBytes),
                  "cublasSetWorkspace");
  for (auto& e : pass_ev_) HMOE_CUDA_TRY(cudaEventCreate(&e), "cudaEventCreate");
  HMOE_CUDA_TRY(cudaEventCreateWithFlags(&done_ev_, cudaEventBlockingSync | cudaEventDisableTiming),
                "cudaEventCreate");
  graphs_ = std::make_unique<PassGraphs>(cu_.graphs, stream_);
  // The kinds this backend runs: plain residual; attention per layer (MLA,
  // GQA), all layers with one cache layout.
  if (c_.arch == Architecture::kDeepseekV4)
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: ", c_.model_type,
        " (sliding / compressed sparse / heavily compressed attention, mHC residual streams, "
        "hash routing) is not implemented on this backend"));
  ASSIGN_OR_RETURN(const ResidualSpec residual, ResidualSpecFor(c_));
  if (residual.kind != ResidualKind::kPlain)
    return absl::UnimplementedError(
        absl::StrCat("cuda backend: residual kind ", ResidualKindName(residual.kind)));
  attn_specs_.clear();
  for (int l = 0; l < c_.num_layers; ++l) {
    ASSIGN_OR_RETURN(AttentionSpec spec, AttentionSpecFor(c_, l));
    if (spec.kind == AttentionKind::kMlaDsa)
      return absl::UnimplementedError(
          absl::StrCat("cuda backend: layer ", l, " runs DeepSeek sparse attention (",
                       c_.model_type, ", index_topk ", c_.dsa.topk,
                       "), which this backend does not run; the cpu backend does (--backend cpu)"));
    if (spec.kind != AttentionKind::kMla && spec.kind != AttentionKind::kGqa)
      return absl::UnimplementedError(absl::StrCat("cuda backend: layer ", l, " attention kind ",
                                                   AttentionKindName(spec.kind)));
    if (!attn_specs_.empty() && (spec.cache.k_row != attn_specs_[0].cache.k_row ||
                                 spec.cache.v_row != attn_specs_[0].cache.v_row))
      return absl::UnimplementedError(
          absl::StrCat("cuda backend: layer ", l, "'s KV cache layout differs from layer 0's"));
    attn_specs_.push_back(spec);
  }
  // Weights.
  const ModelNames names;
  const int64_t H = c_.hidden_size;
  {
    const int64_t block = c_.quantization.method == "fp8" ? c_.quantization.weight_block[0] : 0;
    ASSIGN_OR_RETURN(cpu::Matrix e, cpu::LoadMatrix(ckpt, names.embed, block));
    const int64_t n = e.rows * e.cols;
    if (e.bf16) {
      RETURN_IF_ERROR(Upload(e.bf16, n * 2, &embed_, "weights"));
    } else {
      std::vector<uint16_t> b(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) b[static_cast<size_t>(i)] = F32ToBf16(e.f32[i]);
      RETURN_IF_ERROR(Upload(b.data(), n * 2, &embed_, "weights"));
    }
  }
  if (c_.tie_word_embeddings) {
    tied_head_.rows = c_.vocab_size;
    tied_head_.cols = H;
    lm_head_ptr_ = &tied_head_;  // shares embed_'s storage (see Gemm's use of head_w_)
  } else {
    RETURN_IF_ERROR(LoadLin(ckpt, "lm_head", load_, &lm_head_));
    lm_head_ptr_ = &lm_head_;
  }
  RETURN_IF_ERROR(LoadVec(ckpt, names.final_norm, H, &final_norm_));
  layers_.resize(static_cast<size_t>(c_.num_layers));
  for (int i = 0; i < c_.num_layers; ++i) {
    DevLayer& L = layers_[static_cast<size_t>(i)];
    const LayerNames n = NamesForLayer(c_, i);
    L.window = c_.layers[static_cast<size_t>(i)].sliding_window;
    L.moe = c_.layers[static_cast<size_t>(i)].moe;
    RETURN_IF_ERROR(LoadVec(ckpt, n.input_norm, H, &L.in_norm));
    RETURN_IF_ERROR(LoadVec(ckpt, n.post_norm, H, &L.post_norm));
    if (c_.is_mla()) {
      if (c_.mla.q_lora_rank) {
        RETURN_IF_ERROR(LoadLin(ckpt, n.q_a, load_, &L.q_a));
        RETURN_IF_ERROR(LoadVec(ckpt, n.q_a_norm, *c_.mla.q_lora_rank, &L.q_a_norm));
        RETURN_IF_ERROR(LoadLin(ckpt, n.q_b, load_, &L.q_b));
      } else {
        RETURN_IF_ERROR(LoadLin(ckpt, n.q, load_, &L.q));
      }
      RETURN_IF_ERROR(LoadLin(ckpt, n.kv_a, load_, &L.kv_a));
      RETURN_IF_ERROR(LoadVec(ckpt, n.kv_a_norm, c_.mla.kv_lora_rank, &L.kv_a_norm));
      RETURN_IF_ERROR(LoadLin(ckpt, n.kv_b, cpu::PlainLoad(load_), &L.kv_b));
      if (L.kv_b.has_bias())
        return absl::UnimplementedError(absl::StrCat(ckpt.dir(), ": ", n.kv_b, ".bias"));
    } else {
      RETURN_IF_ERROR(LoadLin(ckpt, n.q, load_, &L.q));
      RETURN_IF_ERROR(LoadLin(ckpt, n.k, load_, &L.k));
      RETURN_IF_ERROR(LoadLin(ckpt, n.v, load_, &L.v));
      if (c_.qk_norm) {
        RETURN_IF_ERROR(LoadVec(ckpt, n.q_norm, c_.head_dim, &L.q_norm));
        RETURN_IF_ERROR(LoadVec(ckpt, n.k_norm, c_.head_dim, &L.k_norm));
      }
    }
    RETURN_IF_ERROR(LoadLin(ckpt, n.o, load_, &L.o));
    if (!L.moe) {
      RETURN_IF_ERROR(LoadMlp(ckpt, n.dense, &L.dense));
      continue;
    }
    // Routing decisions in f32 (the reference's), so the router keeps an f32 copy.
    const int64_t block = c_.quantization.method == "fp8" ? c_.quantization.weight_block[0] : 0;
    {
      ASSIGN_OR_RETURN(cpu::Matrix m, cpu::LoadMatrix(ckpt, n.router, block));
      L.router.rows = m.rows;
      L.router.cols = m.cols;
      std::vector<float> all(static_cast<size_t>(m.rows * m.cols));
      for (int64_t r = 0; r < m.rows; ++r) m.RowToF32(r, all.data() + r * m.cols);
      RETURN_IF_ERROR(
          Upload(all.data(), static_cast<int64_t>(all.size()) * 4, &L.router.w_f32, "weights"));
    }
    if (c_.moe.score_correction_bias)
      RETURN_IF_ERROR(LoadVec(ckpt, n.router_bias, c_.moe.num_experts, &L.router_bias));
    if (c_.moe.num_shared_experts > 0) {
      L.has_shared = true;
      RETURN_IF_ERROR(LoadMlp(ckpt, n.shared, &L.shared));
    }
  }
  if (dense_ws_need_ > 0) {
    const int64_t bytes = std::min(dense_ws_need_, kDenseSlabBytes);
    RETURN_IF_ERROR(budget_.Take(bytes, "workspace"));
    RETURN_IF_ERROR(dense_ws_.Allocate(bytes));
  }
  if (cu_.hot_experts) RETURN_IF_ERROR(LoadHotExperts(ckpt));
  RETURN_IF_ERROR(LoadStreamedExperts(ckpt));
  RETURN_IF_ERROR(budget_.Take(kAttentionScratchBytes, "workspace"));
  RETURN_IF_ERROR(attn_scratch_.Allocate(kAttentionScratchBytes));
  // The planned workspace, then the planned KV pool.
  RETURN_IF_ERROR(EnsureWorkspace(plan.pass_tokens, plan.pass_tokens * 4, 16));
  k_row_ = attn_specs_[0].cache.k_row;
  v_row_ = attn_specs_[0].cache.v_row;
  kv_ = KvElemOf(o_.kv_dtype);
  if (attn_specs_[0].kind == AttentionKind::kMla) {  // scale parts: the latent, the rope part
    kv_part_len_ = c_.mla.kv_lora_rank;
    kv_parts_ = 2;
  } else {  // each kv head's key (value)
    kv_part_len_ = attn_specs_[0].dk;
    kv_parts_ = attn_specs_[0].num_kv_heads;
  }
  const int64_t scale_bytes = kv_ == KvElem::kFp8 ? 4 * kv_parts_ : 0;  // per row
  const int64_t k_bytes = k_row_ * KvElemBytes(kv_) + scale_bytes;
  const int64_t v_bytes = v_row_ ? v_row_ * KvElemBytes(kv_) + scale_bytes : 0;
  const int64_t block_bytes = kBlockTokens * (k_bytes + v_bytes) * c_.num_layers;
  const int64_t blocks = plan.kv_blocks;
  RETURN_IF_ERROR(budget_.Take(blocks * block_bytes, "KV cache"));
  kcache_.resize(static_cast<size_t>(c_.num_layers));
  vcache_.resize(static_cast<size_t>(c_.num_layers));
  kscale_.resize(static_cast<size_t>(c_.num_layers));
  vscale_.resize(static_cast<size_t>(c_.num_layers));
  const int64_t rows = blocks * kBlockTokens, elem = KvElemBytes(kv_);
  for (size_t l = 0; l < static_cast<size_t>(c_.num_layers); ++l) {
    RETURN_IF_ERROR(kcache_[l].Allocate(rows * k_row_ * elem));
    if (scale_bytes) RETURN_IF_ERROR(kscale_[l].Allocate(rows * scale_bytes));
    if (v_row_) {
      RETURN_IF_ERROR(vcache_[l].Allocate(rows * v_row_ * elem));
      if (scale_bytes) RETURN_IF_ERROR(vscale_[l].Allocate(rows * scale_bytes));
    }
  }
  pool_ = std::make_shared<BlockPool>(blocks);
  std::fprintf(stderr,
               "hmoe cuda backend: device %d, %s in use of a %s bound (%s); KV pool %lld blocks "
               "of %lld tokens (%s)\n",
               cu_.device, Gib(static_cast<double>(budget_.used())).c_str(),
               Gib(static_cast<double>(budget_.limit())).c_str(), budget_.Describe().c_str(),
               static_cast<long long>(blocks), static_cast<long long>(kBlockTokens),
               std::string(KvDtypeName(o_.kv_dtype)).c_str());
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureWorkspace(int64_t T, int64_t table_entries, int64_t R) {
  if (T <= cap_tokens_ && table_entries <= cap_table_ && R <= cap_rows_) return absl::OkStatus();
  T = std::max(T, cap_tokens_);
  table_entries = std::max(table_entries, cap_table_);
  R = std::max(R, cap_rows_);
  const int64_t H = c_.hidden_size, E = c_.moe.num_experts, K = c_.moe.experts_per_token;
  const int64_t V = c_.vocab_size, nh = c_.num_heads;
  // Carves aligned pieces out of one allocation: first a dry run for the size.
  int64_t off = 0;
  char* base = nullptr;
  auto piece = [&](int64_t bytes) -> void* {
    off = (off + 255) / 256 * 256;
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  };
  auto carve = [&] {
    off = 0;
    buf_.residual = static_cast<float*>(piece(T * H * 4));
    buf_.layer_out = static_cast<float*>(piece(T * H * 4));
    buf_.normed = static_cast<float*>(piece(T * H * 4));
    buf_.shared_out = static_cast<float*>(piece(T * H * 4));
    buf_.routed = static_cast<float*>(piece(T * H * 4));
    buf_.normed_bf16 = static_cast<uint16_t*>(piece(T * H * 2));
    if (c_.is_mla()) {
      const int64_t qr = c_.mla.q_lora_rank.value_or(0), r = c_.mla.kv_lora_rank,
                    rope = c_.mla.qk_rope_head_dim, qk = c_.mla.qk_head_dim(),
                    vd = c_.mla.v_head_dim;
      buf_.q_a = static_cast<float*>(piece(T * qr * 4));
      buf_.q_a_bf16 = static_cast<uint16_t*>(piece(T * qr * 2));
      buf_.q = static_cast<float*>(piece(T * nh * qk * 4));
      buf_.kv_a = static_cast<float*>(piece(T * (r + rope) * 4));
      buf_.q_latent = static_cast<float*>(piece(T * nh * (r + rope) * 4));
      buf_.out_latent = static_cast<float*>(piece(T * nh * r * 4));
      buf_.attn_out_bf16 = static_cast<uint16_t*>(piece(T * nh * vd * 2));
    } else {
      const int64_t hd = c_.head_dim, kvr = c_.num_kv_heads * hd;
      buf_.q = static_cast<float*>(piece(T * nh * hd * 4));
      buf_.k = static_cast<float*>(piece(T * kvr * 4));
      buf_.v = static_cast<float*>(piece(T * kvr * 4));
      buf_.attn_out = static_cast<float*>(piece(T * nh * hd * 4));
      buf_.attn_out_bf16 = static_cast<uint16_t*>(piece(T * nh * hd * 2));
    }
    buf_.gate_up = static_cast<float*>(piece(T * 2 * max_inter_ * 4));
    buf_.act_bf16 = static_cast<uint16_t*>(piece(T * max_inter_ * 2));
    buf_.router_logits = static_cast<float*>(piece(T * E * 4));
    buf_.route_weights = static_cast<float*>(piece(T * K * 4));
    buf_.route_ids = static_cast<int32_t*>(piece(T * K * 4));
    buf_.now_weights = static_cast<float*>(piece(T * K * 4));
    buf_.now_ids = static_cast<int32_t*>(piece(T * K * 4));
    buf_.later_weights = static_cast<float*>(piece(T * K * 4));
    buf_.later_ids = static_cast<int32_t*>(piece(T * K * 4));
    buf_.rope_cs = static_cast<float*>(piece(T * geo_.rope_dim * 4));
    buf_.logit_inputs = static_cast<float*>(piece(R * H * 4));
    buf_.logits = static_cast<float*>(piece(R * V * 4));
    meta_ints_ = 5 * T + table_entries;  // slot, table_start, pos, logit rows, ids, table
    buf_.meta = static_cast<int32_t*>(piece(meta_ints_ * 4));
  };
  carve();  // a dry run (base null) for the size
  const int64_t bytes = off;
  const int64_t old_bytes = ws_.bytes();
  if (budget_.used() - old_bytes + bytes > budget_.limit()) {
    base = ws_.as<char>();
    const int64_t T_new = T;
    T = cap_tokens_;
    table_entries = cap_table_;
    R = cap_rows_;
    carve();  // the old pointers stay valid
    return absl::ResourceExhaustedError(absl::StrCat(
        "a pass of ", T_new, " tokens needs a GPU workspace of ", Gib(static_cast<double>(bytes)),
        "; ", Gib(static_cast<double>(budget_.used())), " is in use (", budget_.Describe(),
        ") and the bound is ", Gib(static_cast<double>(budget_.limit()))));
  }
  // Graphs hold the old pointers.
  DropGraphs();
  budget_.Give(old_bytes, "workspace");
  RETURN_IF_ERROR(ws_.Allocate(0));
  RETURN_IF_ERROR(budget_.Take(bytes, "workspace"));
  absl::Status st = ws_.Allocate(bytes);
  if (!st.ok()) return Fail(st);
  base = ws_.as<char>();
  carve();
  // Host side: h, routing ids and weights, the pass's metadata.
  RETURN_IF_ERROR(
      host_ws_.Allocate(T * H * 4 + T * K * 8 + meta_ints_ * 4 + T * geo_.rope_dim * 4 + 64 * 4));
  host_.normed = host_ws_.as<float>();
  host_.route_weights = host_.normed + T * H;
  host_.route_ids = reinterpret_cast<int32_t*>(host_.route_weights + T * K);
  host_.meta = host_.route_ids + T * K;
  host_.rope_cs = reinterpret_cast<float*>(host_.meta + meta_ints_);
  host_.tokens = reinterpret_cast<int32_t*>(host_.rope_cs + T * geo_.rope_dim);
  cap_tokens_ = T;
  cap_table_ = table_entries;
  cap_rows_ = R;
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemm(const DevLin& w, const uint16_t* x, int64_t T, float* y) {
  RETURN_IF_ERROR(GemmNoBias(w, x, T, y, w.rows));
  if (w.has_bias())
    RETURN_IF_ERROR(Launched(AddBias(y, T, w.rows, w.b.as<float>(), stream_), "AddBias"));
  return absl::OkStatus();
}

absl::Status CudaBackend::GemmNoBias(const DevLin& w, const uint16_t* x, int64_t T, float* y,
                                     int64_t ldy) {
  if (w.quantized() && T <= kDenseGemvMaxTokens)
    return Launched(DenseGemv(w.q(), x, T, y, ldy, stream_), "DenseGemv");
  const float one = 1.0f, zero = 0.0f;
  // bf16: the whole matrix; quantized: slabs of rows dequantized into dense_ws_.
  const int64_t slab =
      w.quantized() ? std::max<int64_t>(1, dense_ws_.bytes() / (2 * w.cols)) : w.rows;
  for (int64_t r0 = 0; r0 < w.rows; r0 += slab) {
    const int64_t n = std::min(slab, w.rows - r0);
    const void* wp = &w == &tied_head_ ? embed_.as<void>() : w.w.as<void>();
    if (w.quantized()) {
      RETURN_IF_ERROR(
          Launched(DenseToBf16(w.q(), r0, n, dense_ws_.as<uint16_t>(), stream_), "DenseToBf16"));
      wp = dense_ws_.as<void>();
    }
    ++launches_;
    cublasStatus_t s =
        cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(T),
                     static_cast<int>(w.cols), &one, wp, CUDA_R_16BF, static_cast<int>(w.cols), x,
                     CUDA_R_16BF, static_cast<int>(w.cols), &zero, y + r0, CUDA_R_32F,
                     static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
      return Failed(absl::InternalError(
          absl::StrCat("cuBLAS GemmEx ", n, "x", w.cols, "x", T, ": ", cublasGetStatusString(s))));
  }
  return absl::OkStatus();
}

void CudaBackend::BurstBegin() {
  if (in_burst_ || slot_pass_) return;  // a slot pass is timed as a whole
  if (events_used_ + 2 > events_.size()) {
    for (int i = 0; i < 2; ++i) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreate(&e) != cudaSuccess) return;
      events_.push_back(e);
    }
  }
  cudaEventRecord(events_[events_used_], stream_);
  in_burst_ = true;
}

void CudaBackend::BurstEnd() {
  if (!in_burst_ || slot_pass_) return;
  cudaEventRecord(events_[events_used_ + 1], stream_);
  events_used_ += 2;
  in_burst_ = false;
}

absl::Status CudaBackend::Sync(const char* what) {
  BurstEnd();
  // A blocking-sync event, not a spinning stream sync: the host would
  // otherwise hold a core for the whole step, which the expert service's
  // pinned threads need (measured: ~3 ms per expert call lost to the
  // scheduler's time slices when the two shared a core).
  cudaError_t e = cudaEventRecord(done_ev_, stream_);
  if (e == cudaSuccess) e = cudaEventSynchronize(done_ev_);
  if (e != cudaSuccess) return Fail(CudaError(e, what));
  return absl::OkStatus();
}

absl::Status CudaBackend::Begin(const PassTokens& p) {
  RETURN_IF_ERROR(health());
  graphs_->BeginPass();
  slot_pass_ = false;
  if (cu_.debug_fault_after > 0 && ++passes_begun_ == cu_.debug_fault_after + 1) {
    std::fprintf(stderr, "hmoe cuda backend: injecting a sticky device error (pass %lld)\n",
                 static_cast<long long>(passes_begun_));
    InjectStickyError(stream_);
  }
  const int64_t T = p.size();
  if (calls_ && calls_->uses_slots() && T <= kSlotTokens) return BeginSlotPass(p);
  rows_ = T;
  // Each distinct cache's block table once; tokens point at their cache's.
  std::unordered_map<const KvCache*, int32_t> start;
  int64_t entries = 0;
  for (int64_t t = 0; t < T; ++t) {
    auto [it, fresh] = start.emplace(p.kv[static_cast<size_t>(t)], 0);
    if (fresh) {
      it->second = static_cast<int32_t>(entries);
      entries += static_cast<int64_t>(static_cast<const CudaKvCache*>(it->first)->blocks().size());
    }
  }
  RETURN_IF_ERROR(EnsureWorkspace(T, entries, static_cast<int64_t>(p.logit_rows.size())));
  pass_ = &p;
  int32_t* m = host_.meta;
  int32_t* slot = m;
  int32_t* tstart = m + T;
  int32_t* pos = m + 2 * T;
  int32_t* lrows = m + 3 * T;
  int32_t* table = m + 4 * T;
  for (const auto& [kv, s] : start) {
    const auto& b = static_cast<const CudaKvCache*>(kv)->blocks();
    std::copy(b.begin(), b.end(), table + s);
  }
  for (int64_t t = 0; t < T; ++t) {
    const auto* kv = static_cast<const CudaKvCache*>(p.kv[static_cast<size_t>(t)]);
    const int64_t ps = p.pos[static_cast<size_t>(t)];
    slot[t] = kv->Row(ps);
    tstart[t] = start[kv];
    pos[t] = static_cast<int32_t>(ps);
  }
  for (size_t i = 0; i < p.logit_rows.size(); ++i) lrows[i] = p.logit_rows[i];
  RETURN_IF_ERROR(PlanGemmAttention(tstart, pos, T));
  slot_ = buf_.meta;
  tstart_ = buf_.meta + T;
  pos_ = buf_.meta + 2 * T;
  lrows_ = buf_.meta + 3 * T;
  table_ = buf_.meta + 4 * T;
  events_used_ = 0;
  BurstBegin();
  HMOE_CUDA_TRY(cudaMemcpyAsync(buf_.meta, host_.meta, static_cast<size_t>((4 * T + entries) * 4),
                                cudaMemcpyHostToDevice, stream_),
                "metadata upload");
  // The ids ride in the host workspace's routing area (free until Route).
  std::copy(p.ids.begin(), p.ids.end(), host_.route_ids);
  HMOE_CUDA_TRY(cudaMemcpyAsync(buf_.route_ids, host_.route_ids, static_cast<size_t>(T * 4),
                                cudaMemcpyHostToDevice, stream_),
                "token upload");
  HMOE_CUDA_TRY(cudaMemcpyAsync(buf_.rope_cs, p.rope_cs.data(), p.rope_cs.size() * 4,
                                cudaMemcpyHostToDevice, stream_),
                "rope upload");
  RETURN_IF_ERROR(Launched(
      EmbedRows(embed_.as<uint16_t>(), c_.hidden_size, buf_.route_ids, T, buf_.residual, stream_),
      "EmbedRows"));
  // The host buffers above are reused by Route: wait for the copies (cheap).
  return Sync("pass upload");
}

absl::Status CudaBackend::Attention(int l) {
  RETURN_IF_ERROR(health());
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, H = c_.hidden_size;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  BurstBegin();
  RETURN_IF_ERROR(Launched(AddRmsNorm(buf_.residual, nullptr, T, H, L.in_norm.as<float>(), eps,
                                      nullptr, buf_.normed_bf16, stream_),
                           "AddRmsNorm"));
  switch (attn_specs_[static_cast<size_t>(l)].kind) {  // the layer's attention kind's ops
    case AttentionKind::kMla:
      RETURN_IF_ERROR(MlaAttention(l));
      break;
    case AttentionKind::kGqa:
      RETURN_IF_ERROR(GqaAttention(l));
      break;
    case AttentionKind::kMlaDsa:  // refused at load
    case AttentionKind::kV4Sliding:
    case AttentionKind::kV4Csa:
    case AttentionKind::kV4Hca:
      return absl::InternalError(absl::StrCat(
          "cuda backend: ", AttentionKindName(attn_specs_[static_cast<size_t>(l)].kind),
          " layer in a pass"));
  }
  // x += attention; h = post_norm(x) (f32 for the experts, bf16 for the GEMMs).
  return Launched(AddRmsNorm(buf_.residual, buf_.layer_out, T, H, L.post_norm.as<float>(), eps,
                             buf_.normed, buf_.normed_bf16, stream_),
                  "AddRmsNorm");
}

absl::Status CudaBackend::Mlp(const DevMlp& m, float* out) {
  const int64_t T = rows_;
  if (m.split) {
    RETURN_IF_ERROR(GemmNoBias(m.gate_up, buf_.normed_bf16, T, buf_.gate_up, 2 * m.inter));
    RETURN_IF_ERROR(GemmNoBias(m.up, buf_.normed_bf16, T, buf_.gate_up + m.inter, 2 * m.inter));
    if (m.gate_up.has_bias())
      RETURN_IF_ERROR(Launched(
          AddBias(buf_.gate_up, T, 2 * m.inter, m.gate_up.b.as<float>(), stream_), "AddBias"));
  } else {
    RETURN_IF_ERROR(Gemm(m.gate_up, buf_.normed_bf16, T, buf_.gate_up));
  }
  RETURN_IF_ERROR(Launched(SiluMul(buf_.gate_up, T, m.inter, buf_.act_bf16, stream_), "SiluMul"));
  return Gemm(m.down, buf_.act_bf16, T, out);
}

absl::Status CudaBackend::DenseMlp(int l) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(Mlp(layers_[static_cast<size_t>(l)].dense, buf_.layer_out));
  return Join({ResidualPart::In(buf_.layer_out)}, {});
}

absl::Status CudaBackend::RunRouter(int l, const GateSpec& g) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, H = c_.hidden_size, E = g.num_experts, K = g.top_k;
  const float one = 1.0f, zero = 0.0f;
  ++launches_;
  cublasStatus_t s =
      cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(T),
                  static_cast<int>(H), &one, L.router.w_f32.as<float>(), static_cast<int>(H),
                  buf_.normed, static_cast<int>(H), &zero, buf_.router_logits, static_cast<int>(E));
  if (s != CUBLAS_STATUS_SUCCESS)
    return Failed(
        absl::InternalError(absl::StrCat("cuBLAS Sgemm (router): ", cublasGetStatusString(s))));
  RouteParams p;
  p.num_experts = static_cast<int>(E);
  p.top_k = static_cast<int>(K);
  // The router kinds this kernel runs (GateSpec as hmoe::Route takes it).
  switch (g.kind) {
    case RouterKind::kSoftmaxTopk:
      p.sigmoid = false;
      break;
    case RouterKind::kSigmoidGroupedTopk:
      p.sigmoid = true;
      break;
    default:
      return absl::UnimplementedError(
          absl::StrCat("cuda backend: router kind ", RouterKindName(g.kind)));
  }
  p.method = g.method == TopkMethod::kGreedy               ? 0
             : g.method == TopkMethod::kGroupLimitedGreedy ? 1
                                                           : 2;
  p.n_group = static_cast<int>(g.n_group);
  p.topk_group = static_cast<int>(g.topk_group);
  p.norm = g.norm_topk_prob;
  p.norm_eps = g.norm_eps;
  p.scale = g.routed_scaling_factor;
  RETURN_IF_ERROR(Launched(RouteTokens(buf_.router_logits, T, p,
                                       L.router_bias.bytes() ? L.router_bias.as<float>() : nullptr,
                                       buf_.route_ids, buf_.route_weights, stream_),
                           "RouteTokens"));
  return absl::OkStatus();
}

absl::Status CudaBackend::Route(int l, const GateSpec& g, RoutedInput* out) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(RunRouter(l, g));
  const int64_t T = rows_, H = c_.hidden_size, K = g.top_k;
  // The experts get bf16(h), as through the slots (and over the wire), so a
  // token's result does not depend on which path its pass took. buf_.routed is
  // free until AddExperts.
  RETURN_IF_ERROR(Launched(Bf16ToF32(buf_.normed_bf16, T * H, buf_.routed, stream_), "Bf16ToF32"));
  HMOE_CUDA_TRY(cudaMemcpyAsync(host_.normed, buf_.routed, static_cast<size_t>(T * H * 4),
                                cudaMemcpyDeviceToHost, stream_),
                "expert input download");
  HMOE_CUDA_TRY(cudaMemcpyAsync(host_.route_ids, buf_.route_ids, static_cast<size_t>(T * K * 4),
                                cudaMemcpyDeviceToHost, stream_),
                "expert ids download");
  HMOE_CUDA_TRY(cudaMemcpyAsync(host_.route_weights, buf_.route_weights,
                                static_cast<size_t>(T * K * 4), cudaMemcpyDeviceToHost, stream_),
                "expert weights download");
  RETURN_IF_ERROR(Sync("routing"));
  *out = RoutedInput{host_.normed, host_.route_ids, host_.route_weights};
  return absl::OkStatus();
}

absl::Status CudaBackend::StartSharedExperts(int l) {
  RETURN_IF_ERROR(health());
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  shared_pending_ = L.has_shared;
  if (!L.has_shared) return absl::OkStatus();
  BurstBegin();
  RETURN_IF_ERROR(Mlp(L.shared, buf_.shared_out));
  BurstEnd();  // the host now waits for the routed experts
  return absl::OkStatus();
}

absl::Status CudaBackend::Join(std::initializer_list<ResidualPart> parts, ResidualPart shared) {
  return JoinResidual(buf_.residual, parts, shared, rows_ * c_.hidden_size, *this);
}

ResidualPart CudaBackend::TakeShared() {
  const bool pending = shared_pending_;
  shared_pending_ = false;
  return pending ? ResidualPart::Scratch(buf_.shared_out) : ResidualPart{};
}

absl::Status CudaBackend::AddExperts(int l, const float* routed) {
  (void)l;
  RETURN_IF_ERROR(health());
  const int64_t n = rows_ * c_.hidden_size;
  BurstBegin();
  const ResidualPart streamed =
      streamed_pending_ ? ResidualPart::In(streamed_->out()) : ResidualPart{};
  streamed_pending_ = false;
  // Every slot streamed: no upload (it would queue behind the next layer's
  // experts on the copy engine).
  if (routed == nullptr) return Join({streamed}, TakeShared());
  HMOE_CUDA_TRY(cudaMemcpyAsync(buf_.routed, routed, static_cast<size_t>(n * 4),
                                cudaMemcpyHostToDevice, stream_),
                "expert output upload");
  // routed = the service's part + the streamed part.
  return Join({ResidualPart::Scratch(buf_.routed), streamed}, TakeShared());
}

absl::Status CudaBackend::AddToResidual(const float* v) {
  RETURN_IF_ERROR(health());
  const int64_t n = rows_ * c_.hidden_size;
  BurstBegin();
  // buf_.routed is free here: AddExperts has consumed it (same stream, in order).
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(buf_.routed, v, static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, stream_),
      "deferred output upload");
  return Join({ResidualPart::In(buf_.routed)}, {});
}

absl::Status CudaBackend::Logits(float* out) {
  RETURN_IF_ERROR(health());
  const int64_t R = static_cast<int64_t>(pass_->logit_rows.size()), H = c_.hidden_size;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  if (!graphs_->replayed()) {
    // A slot pass computes every padded row (a graph's shapes are fixed);
    // only the R real ones leave the GPU.
    const int64_t rows = slot_pass_ ? rows_ : R;
    BurstBegin();
    RETURN_IF_ERROR(Launched(GatherRows(buf_.residual, H, lrows_, rows, buf_.logit_inputs, stream_),
                             "GatherRows"));
    RETURN_IF_ERROR(
        Launched(AddRmsNorm(buf_.logit_inputs, nullptr, rows, H, final_norm_.as<float>(), eps,
                            nullptr, buf_.normed_bf16, stream_),
                 "AddRmsNorm"));
    RETURN_IF_ERROR(Gemm(*lm_head_ptr_, buf_.normed_bf16, rows, buf_.logits));
  }
  if (graphs_->capturing()) {
    cudaError_t e = graphs_->EndCapture();
    if (e != cudaSuccess) {
      record_ = nullptr;  // CaptureFailed drops the graphs, the record with them
      return graphs_->CaptureFailed(e);
    }
    calls_->Arm(graphs_->captured());
    e = graphs_->LaunchCaptured();
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaGraphLaunch"));
  }
  if (slot_pass_) {
    cudaError_t e = cudaEventRecord(pass_ev_[1], stream_);
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaEventRecord"));
  }
  RETURN_IF_ERROR(
      Copy(out, buf_.logits, R * c_.vocab_size * 4, cudaMemcpyDeviceToHost, "logits download"));
  RETURN_IF_ERROR(Sync("logits"));
  // An expert call that failed inside the pass fails the pass (not sticky).
  if (slot_pass_) {
    const absl::Status aborted = calls_->FinishPass(record_);
    RETURN_IF_ERROR(calls_->TakeStatus());
    RETURN_IF_ERROR(aborted);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Commit() {
  RETURN_IF_ERROR(Sync("pass"));
  if (!pass_plan_log_.empty()) {
    const std::string timeline = streamed_ ? streamed_->TakeTimeline() : std::string();
    std::fprintf(stderr, "hmoe cuda backend: prefill pass of %lld tokens:%s%s%s\n",
                 static_cast<long long>(rows_), pass_plan_log_.c_str(),
                 timeline.empty() ? "" : "\n  streamed experts' timeline:", timeline.c_str());
    pass_plan_log_.clear();
  }
  if (slot_pass_) {
    calls_->FinishPass(record_)
        .IgnoreError();  // reported by Logits; a pass without logits keeps none
    const int64_t wait = calls_->TakeWaitNs();
    slot_wait_ns_ += wait;
    float ms = 0;
    // GPU busy: the pass's span less the host nodes' waits for the experts.
    if (cudaEventElapsedTime(&ms, pass_ev_[0], pass_ev_[1]) == cudaSuccess)
      busy_ns_ += std::max<int64_t>(0, static_cast<int64_t>(ms * 1e6) - wait);
    eager_record_.host_calls.clear();
    slot_pass_ = false;
    graphs_->EndPass();
  }
  for (size_t i = 0; i + 1 < events_used_; i += 2) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, events_[i], events_[i + 1]) == cudaSuccess)
      busy_ns_ += static_cast<int64_t>(ms * 1e6);
  }
  events_used_ = 0;
  pass_ = nullptr;
  return health();
}

void CudaBackend::Abort() {
  graphs_->AbortCapture();
  // Drain what was queued so buffers can be reused; a sticky error stays in broken_.
  BurstEnd();
  cudaError_t e = cudaStreamSynchronize(stream_);
  if (e != cudaSuccess) Fail(CudaError(e, "pass abort")).IgnoreError();
  record_ = nullptr;
  // Calls the pass submitted and never waited on (it stopped half way).
  if (calls_) slot_wait_ns_ += calls_->AbortPass();
  eager_record_.host_calls.clear();
  events_used_ = 0;
  shared_pending_ = false;
  slot_pass_ = false;
  graphs_->EndPass();
  pass_ = nullptr;
}

void CudaBackend::DropGraphs() {
  record_ = nullptr;  // it may point into a graph's
  if (graphs_) graphs_->Drop();
}

bool CudaBackendUsable(int device, std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = absl::StrCat("no usable CUDA device (", cudaGetErrorString(e), ")");
    return false;
  }
  if (device < 0 || device >= n) {
    *why = absl::StrCat("CUDA device ", device, " does not exist (", n, " present)");
    return false;
  }
  e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
  if (e == cudaSuccess) e = cudaFree(nullptr);
  if (e != cudaSuccess) {
    *why = absl::StrCat("CUDA device ", device, " is not usable: ", cudaGetErrorString(e));
    return false;
  }
  return true;
}

bool DeviceMemoryInfo(int device, int64_t* used, int64_t* total, std::string* why) {
  size_t free_bytes = 0, total_bytes = 0;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (e != cudaSuccess) {
    *why = absl::StrCat("CUDA device ", device, ": cudaMemGetInfo: ", cudaGetErrorString(e));
    return false;
  }
  *used = static_cast<int64_t>(total_bytes - free_bytes);
  *total = static_cast<int64_t>(total_bytes);
  return true;
}

absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCudaBackend(const ModelConfig& config,
                                                                const Checkpoint& ckpt,
                                                                const ModelOptions& options) {
  std::string why;
  if (!CudaBackendUsable(options.cuda.device, &why)) return absl::FailedPreconditionError(why);
  auto b = std::make_unique<CudaBackend>(config, options);
  RETURN_IF_ERROR(b->Init(ckpt));
  return std::unique_ptr<LayerBackend>(std::move(b));
}

}  // namespace hmoe::cuda
