// The CUDA backend's class (cuda_backend.h): its definitions are spread over
//   cuda_backend.cc      weights, KV cache, workspace, the pass and its layer ops
//   cuda_attention.cc    MLA and GQA attention (PagedAttention, GEMM attention)
//   cuda_slot_pass.cc    slot passes: the expert calls (ExpertCallPath), hot
//                        experts and graphs (PassGraphs)
//   cuda_prefill.cc      hybrid prefill (StreamedExperts)
// Internal to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gpu_worker/cpu/dense_weights.h"
#include "gpu_worker/cuda/cuda_backend.h"
#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/cuda/expert_call_path.h"
#include "gpu_worker/cuda/gemm_attention.h"
#include "gpu_worker/cuda/gpu_hot_experts.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"
#include "gpu_worker/cuda/pass_buffers.h"
#include "gpu_worker/cuda/pass_graphs.h"
#include "gpu_worker/cuda/streamed_experts.h"
#include "gpu_worker/driver/model_driver.h"
#include "gpu_worker/driver/prefill_plan.h"
#include "gpu_worker/driver/weight_names.h"

namespace hmoe::cuda {

inline constexpr int64_t kBlockTokens = 16;
// Passes of up to kSlotTokens tokens call the experts from the device
// through fixed slots, padded to a bucket of 1, 2, 4, ... tokens (one graph each).
inline constexpr int64_t kSlotTokens = 32;

// A linear layer on the device: weight [rows, cols] in `format` (kBf16:
// bf16 in w; kFp8 / kInt8 / kInt4: the codes in w and the f32 scales in s,
// as DevQuantMatrix lays them out), optional f32 bias.
struct DevLin {
  int64_t rows = 0, cols = 0;
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;
  DeviceBuffer w;
  DeviceBuffer s;
  DeviceBuffer b;
  DeviceBuffer w_f32;  // the router keeps an f32 copy (routing decisions in f32)
  bool has_bias() const { return b.bytes() > 0; }
  bool quantized() const { return format != WeightFormat::kBf16; }
  DevQuantMatrix q() const {
    return DevQuantMatrix{format, group, rows, cols, w.as<void>(), s.as<float>()};
  }
};

// gate and up as one [2I, H] bf16 matrix, or (quantized weights, whose
// scale blocks need not align at I) as two [I, H] matrices writing the
// halves of one [T, 2I] output; the bias [2I] is gate_up's either way.
struct DevMlp {
  DevLin gate_up;  // [2I, H]: gate rows then up rows; split: the gate [I, H]
  DevLin up;       // split: [I, H]
  bool split = false;
  DevLin down;  // [H, I]
  int64_t inter = 0;
};

struct DevLayer {
  DeviceBuffer in_norm, post_norm;
  int64_t window = 0;
  DevLin q, q_a, q_b, kv_a, kv_b, o, k, v;
  DeviceBuffer q_a_norm, kv_a_norm, q_norm, k_norm;
  bool moe = false;
  DevMlp dense, shared;
  bool has_shared = false;
  DevLin router;
  DeviceBuffer router_bias;
};

// The paged KV pool: per layer [blocks * 16, row] elements of the KV dtype
// (ModelOptions::kv_dtype) for keys (MLA: the normed latent + roped key) and,
// for GQA, the same for values; fp8 adds [blocks * 16, parts] f32 scales per
// cache (MLA: latent, rope part; GQA: one per kv head).
class BlockPool {
 public:
  explicit BlockPool(int64_t blocks) {
    free_.reserve(static_cast<size_t>(blocks));
    for (int64_t b = blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
    total_ = blocks;
  }
  bool Take(int64_t n, std::vector<int32_t>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(free_.size()) < n) return false;
    for (int64_t i = 0; i < n; ++i) {
      out->push_back(free_.back());
      free_.pop_back();
    }
    return true;
  }
  void Give(const int32_t* ids, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.insert(free_.end(), ids, ids + n);
  }
  int64_t total() const { return total_; }
  int64_t free_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(free_.size());
  }

 private:
  mutable std::mutex mu_;
  std::vector<int32_t> free_;
  int64_t total_ = 0;
};

class CudaKvCache final : public KvCache {
 public:
  CudaKvCache(std::shared_ptr<BlockPool> pool, int64_t capacity)
      : pool_(std::move(pool)), capacity_(capacity) {}
  ~CudaKvCache() override { Shrink(0); }
  absl::Status Reserve(int64_t n) override {
    const int64_t need = (std::min(n, capacity_) + kBlockTokens - 1) / kBlockTokens;
    const int64_t have = static_cast<int64_t>(blocks_.size());
    if (need <= have) return absl::OkStatus();
    if (!pool_->Take(need - have, &blocks_))
      return absl::ResourceExhaustedError(absl::StrCat(
          "the GPU KV cache has ", pool_->free_blocks(), " free blocks of ", kBlockTokens,
          " tokens; ", need - have, " more are needed (", pool_->total(), " in all)"));
    return absl::OkStatus();
  }
  void Shrink(int64_t n) override {
    const int64_t keep = (n + kBlockTokens - 1) / kBlockTokens;
    const int64_t have = static_cast<int64_t>(blocks_.size());
    if (keep >= have) return;
    pool_->Give(blocks_.data() + keep, have - keep);
    blocks_.resize(static_cast<size_t>(keep));
  }
  const std::vector<int32_t>& blocks() const { return blocks_; }
  // The pool row that holds position `pos` (reserved).
  int32_t Row(int64_t pos) const {
    return static_cast<int32_t>(blocks_[static_cast<size_t>(pos / kBlockTokens)] * kBlockTokens +
                                pos % kBlockTokens);
  }

 private:
  std::shared_ptr<BlockPool> pool_;
  int64_t capacity_;
  std::vector<int32_t> blocks_;
};

class CudaBackend final : public LayerBackend, private StreamOps {
 public:
  CudaBackend(const ModelConfig& c, const ModelOptions& o)
      : c_(c),
        o_(o),
        cu_(o_.cuda),
        load_(cpu::WeightLoadFor(c, o.weights)),
        geo_(AttentionGeometryFor(c)),
        budget_(0) {}
  ~CudaBackend() override;
  absl::Status Init(const Checkpoint& ckpt);

  const char* name() const override { return "cuda"; }
  std::unique_ptr<KvCache> NewKvCache(int64_t capacity) override {
    return std::make_unique<CudaKvCache>(pool_, capacity);
  }
  int64_t kv_blocks_total() const override { return pool_->total(); }
  int64_t kv_block_tokens() const override { return kBlockTokens; }
  void AddStats(ModelStats* s) const override;
  // The sticky failure (OK while there is none); any thread.
  absl::Status health() const override {
    std::lock_guard<std::mutex> lock(broken_mu_);
    return broken_;
  }

  absl::Status Begin(const PassTokens& tokens) override;
  absl::Status Attention(int l) override;
  absl::Status DenseMlp(int l) override;
  absl::Status Route(int l, const GateSpec& gate, RoutedInput* out) override;
  absl::Status StartSharedExperts(int l) override;
  absl::Status AddExperts(int l, const float* routed) override;
  absl::StatusOr<int64_t> TakeRoutedSlots(int l, const RoutedInput& in, int64_t T, int k,
                                          int32_t* ids_out) override;
  absl::Status AddToResidual(const float* v) override;
  absl::Status Logits(float* out) override;
  absl::Status Commit() override;
  void Abort() override;

  bool AttachExperts(RoutedExperts* experts) override;
  bool pass_uses_slots() const override { return slot_pass_; }
  bool replayed() const override { return graphs_ && graphs_->replayed(); }
  bool capture_fell_back() override { return graphs_ && graphs_->fell_back(); }
  absl::Status RouteToSlots(int l, const GateSpec& gate, int deferred) override;
  absl::Status JoinSlot(int l, int part) override;
  void SlotPassRoutes(
      const std::function<void(int32_t, const int32_t*, int64_t)>& add) const override;

 private:
  // StreamOps, for the expert-call path, hot experts and the residual join.
  cudaStream_t stream() const override { return stream_; }
  absl::Status Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                    const char* what) override {
    cudaError_t e = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream_);
    if (e != cudaSuccess) return Failed(CudaError(e, what));
    return absl::OkStatus();
  }
  absl::Status Launched(cudaError_t e, const char* what) override {
    ++launches_;
    if (e != cudaSuccess) return Failed(CudaError(e, what));
    return absl::OkStatus();
  }
  // A failed launch: sticky, unless it happened while capturing (then the
  // capture falls back to running the pass without a graph).
  absl::Status Failed(absl::Status st) override {
    if (graphs_ && graphs_->capturing()) {
      graphs_->set_fell_back();
      return st;
    }
    return Fail(std::move(st));
  }
  absl::Status Fail(absl::Status st) {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.ok()) broken_ = st;
    return st;
  }

  // Begin for a pass of at most kSlotTokens tokens with slots attached.
  absl::Status BeginSlotPass(const PassTokens& p);
  // Graphs hold the workspace's and the slots' addresses.
  void DropGraphs();
  // PREFIX.weight as `load` stores it (cpu::LoadDenseMatrix), PREFIX.bias.
  absl::Status LoadLin(const Checkpoint& ckpt, const std::string& prefix,
                       const cpu::WeightLoad& load, DevLin* out);
  // The weight's codes and scales (or bf16) to the device.
  absl::Status UploadMatrix(const QuantMatrix& m, DevLin* out);
  absl::Status LoadMlp(const Checkpoint& ckpt, const MlpNames& n, DevMlp* out);
  absl::Status LoadVec(const Checkpoint& ckpt, const std::string& name, int64_t n,
                       DeviceBuffer* out);
  absl::Status Upload(const void* host, int64_t bytes, DeviceBuffer* out, const std::string& what);
  // Room for a pass of T tokens, `table_entries` block-table entries and R logit rows.
  absl::Status EnsureWorkspace(int64_t T, int64_t table_entries, int64_t R);
  // y[T, w.rows] = x_bf16[T, w.cols] . w^T (+ bias), fp32 accumulate.
  absl::Status Gemm(const DevLin& w, const uint16_t* x, int64_t T, float* y);
  // The same without the bias, y's rows `ldy` floats apart: bf16 by cuBLAS;
  // quantized by DenseGemv up to kDenseGemvMaxTokens tokens, else slabs of
  // rows dequantized (DenseToBf16) into dense_ws_ for cuBLAS.
  absl::Status GemmNoBias(const DevLin& w, const uint16_t* x, int64_t T, float* y, int64_t ldy);
  absl::Status Mlp(const DevMlp& m, float* out);
  // residual += parts (+ shared), residual_join.h.
  absl::Status Join(std::initializer_list<ResidualPart> parts, ResidualPart shared);
  // The shared experts' output when StartSharedExperts left it for the next
  // join (then no longer), else absent.
  ResidualPart TakeShared();
  // PagedAttention over the pass's paged cache (block table, positions,
  // softmax scale; `window` tokens, 0 = all) of a layer's geometry `a`, with
  // the split-key scratch when it fits; the pass's long runs (runs_) by GEMM
  // attention.
  absl::Status Attend(PagedAttentionArgs& a, int64_t window);
  // The attention geometry of every layer (no window, no pointers but the
  // caches'): what sizes GEMM attention's scratch.
  PagedAttentionArgs AttentionShape() const;
  // runs_ of at least cu_.gemm_attention_tokens tokens in the pass's
  // metadata, and the scratch for them (as much as the budget allows; runs
  // whose chunk does not fit go to PagedAttention).
  absl::Status PlanGemmAttention(const int32_t* tstart, const int32_t* pos, int64_t T);
  absl::Status MlaAttention(int l);
  // The router of layer l on buf_.normed -> route_ids, route_weights [rows_, top_k].
  absl::Status RunRouter(int l, const GateSpec& g);
  absl::Status GqaAttention(int l);
  absl::Status Sync(const char* what);
  // GPU time: a burst runs from the first launch after the host last waited
  // to the next host wait; Commit adds the bursts' event times up.
  void BurstBegin();
  void BurstEnd();
  // Hot experts and hybrid prefill (cuda_prefill.cc).
  absl::Status LoadHotExperts(const Checkpoint& ckpt);
  absl::Status LoadStreamedExperts(const Checkpoint& ckpt);
  // The GPU's copies of routed experts (hot, streamed) come from
  // expert_source, else `ckpt` (which must outlive the loading).
  ExpertSourceFn CopySource(const Checkpoint& ckpt) const;
  // Queues the upload of a guess of the MoE layer after `l`'s experts
  // (CudaOptions::prefill_prefetch), given `l`'s plan.
  absl::Status PrefetchAfter(int l, const PrefillPlan& plan, const std::vector<int64_t>& counts);

  ModelConfig c_;
  ModelOptions o_;
  const CudaOptions& cu_;
  cpu::WeightLoad load_;  // the dense weights' stored form (ModelOptions::weights)
  AttentionGeometry geo_;
  Budget budget_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  // A sticky failure: every later pass fails with it. Read through health()
  // (the pass thread and the worker's health monitor), guarded by broken_mu_.
  mutable std::mutex broken_mu_;
  absl::Status broken_;

  DeviceBuffer embed_, final_norm_;
  DevLin lm_head_;
  const DevLin* lm_head_ptr_ = nullptr;  // tied: a view of the embedding
  DevLin tied_head_;
  std::vector<DevLayer> layers_;
  std::shared_ptr<BlockPool> pool_;
  std::vector<DeviceBuffer> kcache_, vcache_;  // [layer]
  std::vector<DeviceBuffer> kscale_, vscale_;  // [layer] kFp8's scales
  int64_t k_row_ = 0, v_row_ = 0;
  KvElem kv_ = KvElem::kF32;                // the pool's element type
  int64_t kv_part_len_ = 0, kv_parts_ = 1;  // scale parts of a row (KvRows)
  // Layer l's key (values: false) cache as the kernels take it.
  KvRows CacheRows(int l, bool keys) const;
  // Fills `a`'s cache fields from layer l's caches (values from the key rows
  // when the layer keeps none).
  void SetCaches(int l, PagedAttentionArgs* a) const;
  std::vector<AttentionSpec> attn_specs_;  // [layer] attention kind, cache rows, geometry

  // Workspace for passes of up to cap_tokens_ tokens.
  int64_t cap_tokens_ = 0, cap_table_ = 0, cap_rows_ = 0;  // tokens, table entries, logit rows
  DeviceBuffer ws_;
  DeviceBuffer attn_scratch_;       // PagedAttention's split-key partials
  DeviceBuffer gemm_scratch_;       // GEMM attention's
  std::vector<AttentionRun> runs_;  // this pass's runs for GEMM attention
  PinnedBuffer host_ws_;
  PassBuffers buf_;
  HostPassBuffers host_;
  int64_t max_inter_ = 0, meta_ints_ = 0;

  // The pass in progress.
  const PassTokens* pass_ = nullptr;
  int32_t *slot_ = nullptr, *tstart_ = nullptr, *pos_ = nullptr, *table_ = nullptr,
          *lrows_ = nullptr;
  bool shared_pending_ = false;
  int64_t rows_ = 0;  // rows every op of the pass computes: T, or the slot pass's bucket

  // Routed experts: how they are called (chosen at AttachExperts; null:
  // host copies), and for slot passes the graphs and this pass's record.
  RoutedExperts* experts_ = nullptr;
  std::unique_ptr<ExpertCallPath> calls_;
  std::unique_ptr<PassGraphs> graphs_;
  CallRecord eager_record_;       // an eager slot pass's
  CallRecord* record_ = nullptr;  // this slot pass's (a graph's or eager_record_)
  bool slot_pass_ = false;
  int64_t table_cap_ = 0;               // block-table entries a slot pass of kSlotTokens uploads
  int64_t table_per_seq_ = 0;           // most blocks one Sequence holds
  std::unique_ptr<GpuHotExperts> hot_;  // CudaOptions::hot_experts
  // Hybrid prefill (CudaOptions::prefill_experts kStream / kAuto).
  std::unique_ptr<StreamedExperts> streamed_;
  PrefillRates prefill_rates_;
  bool cpu_rates_measured_ = false;
  bool prefetch_planned_ = false;   // the memory plan has room for the prefetch stage
  bool streamed_pending_ = false;   // AddExperts adds streamed_->out()
  int64_t prefill_layers_[3] = {};  // cpu, stream, split
  int64_t streamed_slots_ = 0;
  // Per decoder layer: the experts its plan streamed in the last large pass
  // (the prefetch's guess for it).
  std::vector<std::vector<int32_t>> last_streamed_;
  std::string pass_plan_log_;  // log_prefill_plans: this pass's choices

  cudaEvent_t pass_ev_[2] = {nullptr, nullptr};
  cudaEvent_t done_ev_ = nullptr;  // blocking sync at the end of a pass
  int64_t slot_wait_ns_ = 0;
  DeviceBuffer blas_ws_;
  // Quantized dense weights, passes above kDenseGemvMaxTokens: a slab of a
  // matrix's rows as bf16 (the largest matrix, at most kDenseSlabBytes).
  DeviceBuffer dense_ws_;
  int64_t dense_ws_need_ = 0;  // bytes the largest quantized matrix would take as bf16
  int64_t passes_begun_ = 0;   // for CudaOptions::debug_fault_after

  std::vector<cudaEvent_t> events_;  // pairs, reused
  size_t events_used_ = 0;
  bool in_burst_ = false;
  int64_t launches_ = 0;
  int64_t gemm_attention_tokens_ = 0;
  int64_t busy_ns_ = 0;
};

}  // namespace hmoe::cuda
