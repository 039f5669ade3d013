#include "gpu_worker/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/weight_format.h"
#include "common/status.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cuda/dev_quant_matrix.h"
#include "gpu_worker/cuda/device_memory.h"
#include "gpu_worker/cuda/device_status.h"
#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/expert_call_kernels.h"
#include "gpu_worker/cuda/gemm_attention.h"
#include "gpu_worker/cuda/hot_expert_kernels.h"
#include "gpu_worker/cuda/mla_kernels.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"
#include "gpu_worker/cuda/router_kernels.h"
#include "gpu_worker/cuda/streamed_experts.h"
#include "gpu_worker/driver/model_driver.h"
#include "gpu_worker/driver/prefill_plan.h"
#include "gpu_worker/driver/residual.h"
#include "gpu_worker/driver/weight_names.h"
#include "gpu_worker/hot_weights.h"

namespace hmoe::cuda {
namespace {

constexpr int64_t kBlockTokens = 16;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// PagedAttention's split-key scratch: its most (dv 512) is 8 MiB.
constexpr int64_t kAttentionScratchBytes = 8 << 20;
// GEMM attention's scratch (gathered keys, one query chunk's scores): at most
// this much, taken at the first pass with a long run.
constexpr int64_t kGemmAttentionScratchBytes = int64_t{1} << 30;
// cuBLAS's own workspace (set explicitly so that graph capture never needs
// it to allocate).
constexpr int64_t kBlasWorkspaceBytes = 32 << 20;
// Passes of up to kSlotTokens tokens call the experts from the device
// through fixed slots, padded to one of these buckets (one graph each).
constexpr int64_t kSlotTokens = 32;
int64_t BucketFor(int64_t T) {
  int64_t b = 1;
  while (b < T) b *= 2;
  return b;
}

// A host node's arguments: submit slot a (and b when >= 0) or wait for slot a.
// They live as long as the graph (or the eager pass) that calls them.
struct HostCall {
  ExpertSlots* slots = nullptr;
  int a = -1, b = -1;
  int32_t layer = 0, ka = 0, kb = 0;
  const int32_t* tokens = nullptr;  // pinned: the pass's real token count
  RoutingCounters* counts = nullptr;
  const int32_t *ids_a = nullptr, *ids_b = nullptr;  // the slots' ids, counted at submit
  uint32_t* abort = nullptr;  // device waits: set when a call failed (later waits end at once)
  const int32_t* hot_ids = nullptr;  // pinned: slot a's hot slots (hot experts), counted too
};
// One routed-expert call of a slot pass the device sends (armed and counted
// by the host).
struct SlotCall {
  int slot = 0;
  int32_t layer = 0, k = 0;
  const int32_t* hot_ids = nullptr;  // pinned: the call's hot slots (counted too), or null
};

void CUDART_CB SubmitHost(void* p) {
  const auto* c = static_cast<const HostCall*>(p);
  const int32_t T = *c->tokens;
  if (c->counts) c->counts->Add(c->layer, c->ids_a, int64_t{T} * c->ka);
  if (c->counts && c->hot_ids) c->counts->Add(c->layer, c->hot_ids, int64_t{T} * c->ka);
  c->slots->Submit(c->a, c->layer, T, c->ka);
  if (c->b >= 0) {
    if (c->counts) c->counts->Add(c->layer, c->ids_b, int64_t{T} * c->kb);
    c->slots->Submit(c->b, c->layer, T, c->kb);
  }
  if (c->abort != nullptr && c->slots->has_failure())
    __atomic_store_n(c->abort, 1u, __ATOMIC_RELEASE);
}
void CUDART_CB WaitHost(void* p) {
  const auto* c = static_cast<const HostCall*>(p);
  c->slots->Wait(c->a);
}

// A linear layer on the device: bf16 weight [rows, cols], optional f32 bias.
struct DevLin {
  int64_t rows = 0, cols = 0;
  DeviceBuffer w;
  DeviceBuffer b;
  DeviceBuffer w_f32;  // the router keeps an f32 copy (routing decisions in f32)
  bool has_bias() const { return b.bytes() > 0; }
};

struct DevMlp {
  DevLin gate_up;  // [2I, H]: gate rows then up rows
  DevLin down;     // [H, I]
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

// The paged KV pool: per layer [blocks * 16, row] f32 for keys (MLA: the
// normed latent + roped key) and, for GQA, the same for values.
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

class CudaBackend final : public LayerBackend {
 public:
  CudaBackend(const ModelConfig& c, const ModelOptions& o)
      : c_(c), o_(o), geo_(AttentionGeometryFor(c)), budget_(0) {}
  ~CudaBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
    streamed_.reset();  // uses stream_ (and the budget) as it goes
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(wd_mu_);
        wd_stop_ = true;
      }
      wd_cv_.notify_all();
      watchdog_.join();
    }
    DropGraphs();
    slots_.reset();  // its before_release unregisters its memory
    for (auto& e : pass_ev_)
      if (e) cudaEventDestroy(e);
    if (done_ev_) cudaEventDestroy(done_ev_);
    for (auto& e : events_) cudaEventDestroy(e);
    if (blas_) cublasDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  absl::Status Init(const Checkpoint& ckpt);

  const char* name() const override { return "cuda"; }
  std::unique_ptr<KvCache> NewKvCache(int64_t capacity) override {
    return std::make_unique<CudaKvCache>(pool_, capacity);
  }
  int64_t kv_blocks_total() const override { return pool_->total(); }
  int64_t kv_block_tokens() const override { return kBlockTokens; }
  void AddStats(ModelStats* s) const override {
    s->kernel_launches += launches_;
    s->gpu_busy_ns += busy_ns_;
    s->graph_launches += graph_launches_;
    s->graph_captures += graph_captures_;
    s->expert_wait_ns += slot_wait_ns_;
    s->prefill_cpu_layers += prefill_layers_[0];
    s->prefill_stream_layers += prefill_layers_[1];
    s->prefill_split_layers += prefill_layers_[2];
    s->streamed_slots += streamed_slots_;
    if (streamed_) {
      s->prefetched_experts += streamed_->prefetched();
      s->prefetch_used_experts += streamed_->prefetch_used();
    }
    s->gemm_attention_tokens += gemm_attention_tokens_;
  }
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

  bool AttachExperts(RoutedExperts* experts, RoutingCounters* counts) override;
  bool pass_uses_slots() const override { return slot_pass_; }
  bool replayed() const override { return replayed_; }
  bool capture_fell_back() override { return fell_back_; }
  absl::Status RouteToSlots(int l, const GateSpec& gate, int deferred) override;
  absl::Status JoinSlot(int l, int part) override;

 private:
  // Begin for a pass of at most kSlotTokens tokens with slots attached.
  absl::Status BeginSlotPass(const PassTokens& p);
  // Registers the slots' memory for the GPU's copies (after Prepare moved them).
  absl::Status RegisterSlots(uint64_t gen);
  void DropGraphs();
  // After a slot pass's last GPU work: the host side of the device's waits
  // (each slot's Wait, which then returns at once and records failures).
  // UNAVAILABLE when the device stopped waiting for an answer (abort word).
  absl::Status FinishDeviceWaits();
  // Arms `calls` for the device to send (dev_sends_), with the pass's real T.
  void ArmCalls(const std::vector<SlotCall>& calls);
  // Sets the device waits' abort word while a pass runs and the service is
  // gone (the device cannot see a dead process).
  void Watchdog();
  // A failed capture: graphs off from now on, said once.
  absl::Status CaptureFailed(cudaError_t e);
  absl::Status Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                    const char* what) {
    cudaError_t e = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream_);
    if (e != cudaSuccess) return Failed(CudaError(e, what));
    return absl::OkStatus();
  }
  // A failed launch: sticky, unless it happened while capturing (then the
  // capture falls back to running the pass without a graph).
  absl::Status Failed(absl::Status st) {
    if (capturing_) {
      fell_back_ = true;
      return st;
    }
    return Fail(std::move(st));
  }
  absl::Status LoadLin(const Checkpoint& ckpt, const std::string& prefix, DevLin* out);
  absl::Status LoadMlp(const Checkpoint& ckpt, const MlpNames& n, DevMlp* out);
  absl::Status LoadVec(const Checkpoint& ckpt, const std::string& name, int64_t n,
                       DeviceBuffer* out);
  absl::Status Upload(const void* host, int64_t bytes, DeviceBuffer* out, const std::string& what);
  // Room for a pass of T tokens, `table_entries` block-table entries and R logit rows.
  absl::Status EnsureWorkspace(int64_t T, int64_t table_entries, int64_t R);
  // y[T, w.rows] = x_bf16[T, w.cols] . w^T (+ bias), fp32 accumulate.
  absl::Status Gemm(const DevLin& w, const uint16_t* x, int64_t T, float* y);
  absl::Status Launched(cudaError_t e, const char* what) {
    ++launches_;
    if (e != cudaSuccess) return Failed(CudaError(e, what));
    return absl::OkStatus();
  }
  absl::Status Fail(absl::Status st) {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.ok()) broken_ = st;
    return st;
  }
  absl::Status Mlp(const DevMlp& m, float* out);
  // PagedAttention over the pass's paged cache (block table, positions,
  // softmax scale; `window` tokens, 0 = all) of a layer's geometry `a`, with
  // the split-key scratch when it fits; the pass's long runs (runs_) by GEMM
  // attention.
  absl::Status Attend(PagedAttentionArgs& a, int64_t window) {
    a.block_table = table_;
    a.table_start = tstart_;
    a.pos = pos_;
    a.block_tokens = kBlockTokens;
    a.window = window;
    a.scale = geo_.softmax_scale;
    const int64_t need = PagedAttentionScratchFloats(a);
    if (need > 0 && need * 4 <= attn_scratch_.bytes()) {
      a.scratch = attn_scratch_.as<float>();
      a.scratch_floats = attn_scratch_.bytes() / 4;
    }
    if (runs_.empty()) return Launched(PagedAttention(a, stream_), "PagedAttention");
    GemmAttentionOptions g;
    g.scratch = gemm_scratch_.as<float>();
    g.scratch_floats = gemm_scratch_.bytes() / 4;
    g.tf32 = o_.cuda_gemm_attention_tf32;
    absl::Status st = AttendPass(a, runs_, g, blas_, stream_, &launches_, &gemm_attention_tokens_);
    return st.ok() ? st : Failed(st);
  }
  // The attention geometry of every layer (no window, no pointers but the
  // caches'): what sizes GEMM attention's scratch.
  PagedAttentionArgs AttentionShape() const;
  // runs_ of at least o_.cuda_gemm_attention_tokens tokens in the pass's
  // metadata, and the scratch for them (as much as the budget allows; runs
  // whose chunk does not fit go to PagedAttention).
  absl::Status PlanGemmAttention(const int32_t* tstart, const int32_t* pos, int64_t T);
  absl::Status MlaAttention(int l);
  // The router of layer l on h_ -> rid_, rw_ [rows_, top_k].
  absl::Status RunRouter(int l, const GateSpec& g);
  absl::Status GqaAttention(int l);
  absl::Status Sync(const char* what);
  // GPU time: a burst runs from the first launch after the host last waited
  // to the next host wait; Commit adds the bursts' event times up.
  void BurstBegin();
  void BurstEnd();

  ModelConfig c_;
  ModelOptions o_;
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
  int64_t k_row_ = 0, v_row_ = 0;
  std::vector<AttentionSpec> attn_specs_;  // [layer] attention kind, cache rows, geometry

  // Workspace for passes of up to cap_tokens_ tokens.
  int64_t cap_tokens_ = 0, cap_table_ = 0, cap_rows_ = 0;  // tokens, table entries, logit rows
  DeviceBuffer ws_;
  DeviceBuffer attn_scratch_;       // PagedAttention's split-key partials
  DeviceBuffer gemm_scratch_;       // GEMM attention's
  std::vector<AttentionRun> runs_;  // this pass's runs for GEMM attention
  PinnedBuffer host_ws_;
  float *x_ = nullptr, *y_ = nullptr, *h_ = nullptr, *ysh_ = nullptr, *routed_ = nullptr;
  uint16_t* hb_ = nullptr;
  float *qa_ = nullptr, *q_ = nullptr, *kva_ = nullptr, *qfull_ = nullptr, *olat_ = nullptr,
        *kk_ = nullptr, *vv_ = nullptr, *attn_ = nullptr;
  uint16_t *qab_ = nullptr, *attnb_ = nullptr, *actb_ = nullptr;
  float *gu_ = nullptr, *logits_ = nullptr, *rw_ = nullptr, *cs_ = nullptr, *xr_ = nullptr,
        *lo_ = nullptr;
  int32_t *rid_ = nullptr, *meta_ = nullptr;
  float *h_host_ = nullptr, *rw_host_ = nullptr;
  int32_t *rid_host_ = nullptr, *meta_host_ = nullptr;
  int64_t max_inter_ = 0, meta_ints_ = 0;

  // The pass in progress.
  const PassTokens* pass_ = nullptr;
  int32_t *slot_ = nullptr, *tstart_ = nullptr, *pos_ = nullptr, *table_ = nullptr,
          *lrows_ = nullptr;
  bool shared_pending_ = false;
  int64_t rows_ = 0;  // rows every op of the pass computes: T, or the slot pass's bucket

  // Device-side expert calls (passes of up to kSlotTokens tokens).
  RoutedExperts* experts_ = nullptr;
  RoutingCounters* counts_ = nullptr;
  std::unique_ptr<ExpertSlots> slots_;
  uint64_t slots_gen_ = 0;  // the generation whose memory is registered
  std::vector<SlotView> views_;
  // Device-side waits (ModelOptions::cuda_device_calls and a transport with
  // ExpertSlots::device_wait words): per slot, the word as the device sees it.
  // Empty: the waits are host nodes.
  struct DevWait {
    uint32_t* word = nullptr;
    uint32_t lo = 0, hi = 0, request = 0;
    // The slot's regions as the device sees them (dev_sends_ only).
    uint16_t* hidden = nullptr;
    int32_t* ids = nullptr;
    float* weights = nullptr;
    const float* out = nullptr;
  };
  DeviceBuffer send_counter_;  // SendExpertCall's block counter
  // Hot experts (ModelOptions::hot_experts): per decoder layer with any, the
  // device table [E] of DevExpert (null weights: not hot) and the mask [E].
  struct HotLayer {
    DeviceBuffer table, mask;
  };
  std::map<int, HotLayer> hot_;
  std::vector<DeviceBuffer> hot_weights_;
  DeviceBuffer hot_ids_, cold_ids_, hot_out_, hot_scratch_;  // slot passes' (<= kSlotTokens)
  int32_t* hot_ids_host_ = nullptr;  // pinned [layer][kSlotTokens * K]: counted after the pass
  PinnedBuffer hot_ids_pinned_;
  absl::Status LoadHotExperts(const Checkpoint& ckpt);
  // Hybrid prefill (ModelOptions::prefill_experts "stream" / "auto").
  absl::Status LoadStreamedExperts(const Checkpoint& ckpt);
  // The GPU's copies of routed experts (hot, streamed): their format
  // (hot_format; INVALID_ARGUMENT naming `what`) and where their weights
  // come from (expert_source, else `ckpt`, which must outlive the loading).
  absl::StatusOr<WeightFormat> CopyFormat(const char* what) const;
  ExpertSourceFn CopySource(const Checkpoint& ckpt) const;
  std::unique_ptr<StreamedExperts> streamed_;
  PrefillRates prefill_rates_;
  bool cpu_rates_measured_ = false;
  bool streamed_pending_ = false;   // AddExperts adds streamed_->out()
  int64_t prefill_layers_[3] = {};  // cpu, stream, split
  int64_t streamed_slots_ = 0;
  // Per decoder layer: the experts its plan streamed in the last large pass
  // (the prefetch's guess for it).
  std::vector<std::vector<int32_t>> last_streamed_;
  // Queues the upload of a guess of the MoE layer after `l`'s experts
  // (ModelOptions::prefill_prefetch), given `l`'s plan.
  absl::Status PrefetchAfter(int l, const PrefillPlan& plan, const std::vector<int64_t>& counts);
  std::string pass_plan_log_;  // log_prefill_plans: this pass's choices
  std::vector<DevWait> dev_waits_;
  // With dev_waits_, and every slot's DeviceWait::request set: the device
  // also sends the calls (SendExpertCall), the host only arms them.
  bool dev_sends_ = false;
  std::vector<SlotCall> eager_slot_calls_;
  std::vector<SlotCall>* pass_calls_ = nullptr;  // the pass's calls (a graph's or eager_)
  // mapped: the abort word, the waited nanoseconds, then per slot its armed word
  PinnedBuffer wait_ctl_;
  uint32_t *abort_host_ = nullptr, *abort_dev_ = nullptr;
  uint32_t *armed_host_ = nullptr, *armed_dev_ = nullptr;
  unsigned long long *waited_host_ = nullptr, *waited_dev_ = nullptr;
  std::atomic<bool> in_pass_{false};  // a slot pass with device waits is queued
  std::thread watchdog_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;                       // guarded by wd_mu_
  int32_t *rid2_ = nullptr, *rid3_ = nullptr;  // Deferral's split: now / later ids
  float *rw2_ = nullptr, *rw3_ = nullptr;
  float* cs_host_ = nullptr;        // pinned rope rows of a slot pass
  int32_t* tokens_host_ = nullptr;  // pinned: the slot pass's real T (read by host nodes)
  int64_t table_cap_ = 0;           // block-table entries a slot pass of kSlotTokens uploads
  int64_t table_per_seq_ = 0;       // most blocks one Sequence holds
  bool slot_pass_ = false;
  std::deque<HostCall> eager_calls_;  // an eager slot pass's host-node arguments
  std::deque<HostCall>* calls_ = nullptr;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    std::deque<HostCall> calls;
    std::vector<SlotCall> slot_calls;  // the calls its kernels send (dev_sends_)
  };
  std::map<int64_t, Graph> graphs_;  // by bucket, for the current workspace and slots
  bool graphs_on_ = true;
  bool capturing_ = false, replayed_ = false, fell_back_ = false;
  Graph* capture_ = nullptr;
  cudaEvent_t pass_ev_[2] = {nullptr, nullptr};
  cudaEvent_t done_ev_ = nullptr;  // blocking sync at the end of a pass
  int64_t graph_launches_ = 0, graph_captures_ = 0, slot_wait_ns_ = 0;
  DeviceBuffer blas_ws_;
  int64_t passes_begun_ = 0;  // for ModelOptions::debug_cuda_fault_after

  std::vector<cudaEvent_t> events_;  // pairs, reused
  size_t events_used_ = 0;
  bool in_burst_ = false;
  int64_t launches_ = 0;
  int64_t gemm_attention_tokens_ = 0;
  int64_t busy_ns_ = 0;
};

absl::Status CudaBackend::Upload(const void* host, int64_t bytes, DeviceBuffer* out,
                                 const std::string& what) {
  RETURN_IF_ERROR(budget_.Take(bytes, what));
  RETURN_IF_ERROR(out->Allocate(bytes));
  HMOE_CUDA_TRY(
      cudaMemcpy(out->as<void>(), host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
      "upload");
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadHotExperts(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(const WeightFormat fmt, CopyFormat("hot experts"));
  ASSIGN_OR_RETURN(std::vector<HotExpertWeights> hot,
                   hmoe::LoadHotExperts(CopySource(ckpt), c_, *o_.hot_experts, fmt, o_.hot_group));
  const int64_t E = c_.moe.num_experts, K = c_.moe.experts_per_token, H = c_.hidden_size;
  std::map<int, std::vector<DevExpert>> tables;
  int64_t bytes = 0;
  auto put = [&](const HostQuantMatrix& m, DevQuantMatrix* d) -> absl::Status {
    d->format = m.format;
    d->group = m.group;
    d->rows = m.rows;
    d->cols = m.cols;
    DeviceBuffer& w = hot_weights_.emplace_back();
    RETURN_IF_ERROR(Upload(m.w.data(), static_cast<int64_t>(m.w.size()), &w, "hot experts"));
    d->w = w.as<void>();
    if (!m.scale.empty()) {
      DeviceBuffer& sc = hot_weights_.emplace_back();
      RETURN_IF_ERROR(
          Upload(m.scale.data(), static_cast<int64_t>(m.scale.size()) * 4, &sc, "hot experts"));
      d->scale = sc.as<float>();
    }
    return absl::OkStatus();
  };
  hot_weights_.reserve(hot.size() * 6);  // DeviceBuffers move, but keep them put anyway
  for (const HotExpertWeights& h : hot) {
    auto& t = tables[h.layer];
    if (t.empty()) t.resize(static_cast<size_t>(E));
    DevExpert& d = t[static_cast<size_t>(h.expert)];
    RETURN_IF_ERROR(put(h.gate, &d.gate));
    RETURN_IF_ERROR(put(h.up, &d.up));
    RETURN_IF_ERROR(put(h.down, &d.down));
    bytes += h.bytes();
  }
  for (auto& [layer, t] : tables) {
    HotLayer& hl = hot_[layer];
    std::vector<uint8_t> mask(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e)
      mask[static_cast<size_t>(e)] = t[static_cast<size_t>(e)].gate.w != nullptr;
    RETURN_IF_ERROR(Upload(t.data(), static_cast<int64_t>(t.size() * sizeof(DevExpert)), &hl.table,
                           "hot experts"));
    RETURN_IF_ERROR(Upload(mask.data(), E, &hl.mask, "hot experts"));
  }
  const int64_t n = kSlotTokens * K;
  const int64_t scratch = HotExpertsScratchBytes(kSlotTokens, H, c_.moe.intermediate_size, K);
  RETURN_IF_ERROR(budget_.Take(n * 8 + kSlotTokens * H * 4 + scratch, "hot experts"));
  RETURN_IF_ERROR(hot_ids_.Allocate(n * 4));
  RETURN_IF_ERROR(cold_ids_.Allocate(n * 4));
  RETURN_IF_ERROR(hot_out_.Allocate(kSlotTokens * H * 4));
  RETURN_IF_ERROR(hot_scratch_.Allocate(scratch));
  RETURN_IF_ERROR(hot_ids_pinned_.Allocate(static_cast<int64_t>(c_.num_layers) * n * 4));
  hot_ids_host_ = hot_ids_pinned_.as<int32_t>();
  std::fprintf(stderr, "hmoe cuda backend: %s on the GPU as %s (%s)\n",
               o_.hot_experts->Describe().c_str(), o_.hot_format.c_str(),
               Gib(static_cast<double>(bytes)).c_str());
  return absl::OkStatus();
}

absl::StatusOr<WeightFormat> CudaBackend::CopyFormat(const char* what) const {
  absl::StatusOr<WeightFormat> fmt = ParseWeightFormat(o_.hot_format);
  if (!fmt.ok()) return Annotate(fmt.status(), what);
  return *fmt;
}

ExpertSourceFn CudaBackend::CopySource(const Checkpoint& ckpt) const {
  if (o_.expert_source) return o_.expert_source;
  return [&ckpt, this](int l) { return CheckpointSource(ckpt, c_, l); };
}

absl::Status CudaBackend::LoadStreamedExperts(const Checkpoint& ckpt) {
  const std::string& p = o_.prefill_experts;
  if (p != "cpu" && p != "stream" && p != "auto")
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_experts \"", p, "\" is not cpu, stream or auto"));
  if (p == "cpu") return absl::OkStatus();
  if (o_.deferred_experts > 0) {
    std::fprintf(stderr,
                 "hmoe cuda backend: hybrid prefill (%s) is off with Expert Deferral: large "
                 "passes' routed experts run on the expert service\n",
                 p.c_str());
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const WeightFormat fmt, CopyFormat("streamed experts"));
  if (o_.prefill_stream_tokens <= kSlotTokens)
    return absl::InvalidArgumentError(absl::StrCat("prefill_stream_tokens ",
                                                   o_.prefill_stream_tokens, " must be > ",
                                                   kSlotTokens, " (smaller passes use the slots)"));
  const int64_t max_tokens = o_.max_seq_len > kSlotTokens
                                 ? std::min(o_.prefill_stream_tokens, o_.max_seq_len)
                                 : o_.prefill_stream_tokens;
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(streamed_,
                   StreamedExperts::Create(c_, CopySource(ckpt), fmt, o_.hot_group, max_tokens,
                                           o_.prefill_prefetch, stream_, blas_, &budget_));
  last_streamed_.assign(static_cast<size_t>(c_.num_layers), {});
  std::fprintf(
      stderr,
      "hmoe cuda backend: hybrid prefill (%s) for passes of 33..%lld tokens: %s of "
      "routed experts (%s) pinned on the host, %s on the GPU; PCIe %.1f GB/s, "
      "expert GEMMs %.0f TFLOP/s; loaded in %.1f s\n",
      p.c_str(), static_cast<long long>(max_tokens),
      Gib(static_cast<double>(streamed_->host_bytes())).c_str(), o_.hot_format.c_str(),
      streamed_->stages() > 1 ? "two layers' (the next one's uploaded ahead)" : "one layer's",
      streamed_->pcie_gbps(), streamed_->gemm_tflops(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  streamed_->set_timeline(o_.log_prefill_plans);
  prefill_rates_.pcie_gbps = streamed_->pcie_gbps();
  prefill_rates_.gpu_tflops = streamed_->gemm_tflops();
  if (o_.prefill_rates) {
    RETURN_IF_ERROR(ValidatePrefillRates(*o_.prefill_rates));
    prefill_rates_ = *o_.prefill_rates;
    cpu_rates_measured_ = true;
    std::fprintf(stderr, "hmoe cuda backend: hybrid prefill plans with the given rates %s\n",
                 PrefillRatesJson(prefill_rates_).c_str());
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadLin(const Checkpoint& ckpt, const std::string& prefix, DevLin* out) {
  const int64_t block = c_.quantization.method == "fp8" ? c_.quantization.weight_block[0] : 0;
  ASSIGN_OR_RETURN(cpu::Matrix m, cpu::LoadMatrix(ckpt, prefix + ".weight", block));
  out->rows = m.rows;
  out->cols = m.cols;
  const int64_t n = m.rows * m.cols;
  if (m.bf16 != nullptr) {
    RETURN_IF_ERROR(Upload(m.bf16, n * 2, &out->w, "weights"));
  } else {
    std::vector<uint16_t> b(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) b[static_cast<size_t>(i)] = F32ToBf16(m.f32[i]);
    RETURN_IF_ERROR(Upload(b.data(), n * 2, &out->w, "weights"));
  }
  ASSIGN_OR_RETURN(std::vector<float> bias,
                   cpu::LoadOptionalVector(ckpt, prefix + ".bias", m.rows));
  if (!bias.empty())
    RETURN_IF_ERROR(Upload(bias.data(), static_cast<int64_t>(bias.size()) * 4, &out->b, "weights"));
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadMlp(const Checkpoint& ckpt, const MlpNames& n, DevMlp* out) {
  const int64_t block = c_.quantization.method == "fp8" ? c_.quantization.weight_block[0] : 0;
  ASSIGN_OR_RETURN(cpu::Matrix g, cpu::LoadMatrix(ckpt, n.gate + ".weight", block));
  ASSIGN_OR_RETURN(cpu::Matrix u, cpu::LoadMatrix(ckpt, n.up + ".weight", block));
  if (g.rows != u.rows || g.cols != u.cols)
    return absl::InvalidArgumentError(
        absl::StrCat(ckpt.dir(), ": ", n.gate, " and ", n.up, " differ in shape"));
  const int64_t I = g.rows, H = g.cols;
  std::vector<uint16_t> gu(static_cast<size_t>(2 * I * H));
  std::vector<float> row(static_cast<size_t>(H));
  for (int64_t r = 0; r < 2 * I; ++r) {
    const cpu::Matrix& m = r < I ? g : u;
    const int64_t rr = r < I ? r : r - I;
    if (m.bf16) {
      std::memcpy(gu.data() + r * H, m.bf16 + rr * H, static_cast<size_t>(H) * 2);
    } else {
      m.RowToF32(rr, row.data());
      for (int64_t i = 0; i < H; ++i) gu[static_cast<size_t>(r * H + i)] = F32ToBf16(row[i]);
    }
  }
  out->inter = I;
  out->gate_up.rows = 2 * I;
  out->gate_up.cols = H;
  RETURN_IF_ERROR(Upload(gu.data(), 2 * I * H * 2, &out->gate_up.w, "weights"));
  ASSIGN_OR_RETURN(std::vector<float> gb, cpu::LoadOptionalVector(ckpt, n.gate + ".bias", I));
  ASSIGN_OR_RETURN(std::vector<float> ub, cpu::LoadOptionalVector(ckpt, n.up + ".bias", I));
  if (!gb.empty() || !ub.empty()) {
    gb.resize(static_cast<size_t>(I), 0.0f);
    ub.resize(static_cast<size_t>(I), 0.0f);
    gb.insert(gb.end(), ub.begin(), ub.end());
    RETURN_IF_ERROR(Upload(gb.data(), 2 * I * 4, &out->gate_up.b, "weights"));
  }
  RETURN_IF_ERROR(LoadLin(ckpt, n.down, &out->down));
  max_inter_ = std::max(max_inter_, I);
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadVec(const Checkpoint& ckpt, const std::string& name, int64_t n,
                                  DeviceBuffer* out) {
  ASSIGN_OR_RETURN(std::vector<float> v, cpu::LoadVector(ckpt, name, n));
  return Upload(v.data(), n * 4, out, "weights");
}

absl::Status CudaBackend::Init(const Checkpoint& ckpt) {
  HMOE_CUDA_TRY(cudaSetDevice(o_.cuda_device), "cudaSetDevice");
  // Every wait for the GPU blocks instead of spinning: the expert service's
  // pinned threads hold every core, and a spinning CUDA thread (the host
  // nodes' worker included) sharing one of them costs whole scheduler time
  // slices per expert call (measured: 2.7-3.6 ms per call, 10x the kernel).
  HMOE_CUDA_TRY(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync), "cudaSetDeviceFlags");
  size_t free_b = 0, total_b = 0;
  HMOE_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const int64_t free_bytes = static_cast<int64_t>(free_b);
  int64_t limit = free_bytes - static_cast<int64_t>(kGiB);
  if (o_.gpu_mem_gb > 0) {
    const int64_t want = static_cast<int64_t>(o_.gpu_mem_gb * kGiB);
    if (want > free_bytes)
      return absl::ResourceExhaustedError(absl::StrCat("--gpu-mem-gb ", o_.gpu_mem_gb,
                                                       " exceeds the device's free memory of ",
                                                       Gib(static_cast<double>(free_bytes))));
    limit = want;
  }
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
  graphs_on_ = o_.cuda_graphs;
  // The kinds this backend runs: plain residual; attention per layer (MLA,
  // GQA), all layers with one cache layout.
  ASSIGN_OR_RETURN(const ResidualSpec residual, ResidualSpecFor(c_));
  if (residual.kind != ResidualKind::kPlain)
    return absl::UnimplementedError(
        absl::StrCat("cuda backend: residual kind ", ResidualKindName(residual.kind)));
  attn_specs_.clear();
  for (int l = 0; l < c_.num_layers; ++l) {
    ASSIGN_OR_RETURN(AttentionSpec spec, AttentionSpecFor(c_, l));
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
    RETURN_IF_ERROR(LoadLin(ckpt, "lm_head", &lm_head_));
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
        RETURN_IF_ERROR(LoadLin(ckpt, n.q_a, &L.q_a));
        RETURN_IF_ERROR(LoadVec(ckpt, n.q_a_norm, *c_.mla.q_lora_rank, &L.q_a_norm));
        RETURN_IF_ERROR(LoadLin(ckpt, n.q_b, &L.q_b));
      } else {
        RETURN_IF_ERROR(LoadLin(ckpt, n.q, &L.q));
      }
      RETURN_IF_ERROR(LoadLin(ckpt, n.kv_a, &L.kv_a));
      RETURN_IF_ERROR(LoadVec(ckpt, n.kv_a_norm, c_.mla.kv_lora_rank, &L.kv_a_norm));
      RETURN_IF_ERROR(LoadLin(ckpt, n.kv_b, &L.kv_b));
      if (L.kv_b.has_bias())
        return absl::UnimplementedError(absl::StrCat(ckpt.dir(), ": ", n.kv_b, ".bias"));
    } else {
      RETURN_IF_ERROR(LoadLin(ckpt, n.q, &L.q));
      RETURN_IF_ERROR(LoadLin(ckpt, n.k, &L.k));
      RETURN_IF_ERROR(LoadLin(ckpt, n.v, &L.v));
      if (c_.arch == Architecture::kQwen3Moe) {
        RETURN_IF_ERROR(LoadVec(ckpt, n.q_norm, c_.head_dim, &L.q_norm));
        RETURN_IF_ERROR(LoadVec(ckpt, n.k_norm, c_.head_dim, &L.k_norm));
      }
    }
    RETURN_IF_ERROR(LoadLin(ckpt, n.o, &L.o));
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
  if (o_.hot_experts) RETURN_IF_ERROR(LoadHotExperts(ckpt));
  RETURN_IF_ERROR(LoadStreamedExperts(ckpt));
  RETURN_IF_ERROR(budget_.Take(kAttentionScratchBytes, "workspace"));
  RETURN_IF_ERROR(attn_scratch_.Allocate(kAttentionScratchBytes));
  // A workspace for a first pass of up to 256 tokens, then the KV pool from what is left.
  RETURN_IF_ERROR(EnsureWorkspace(256, 256 * 4, 16));
  k_row_ = attn_specs_[0].cache.k_row;
  v_row_ = attn_specs_[0].cache.v_row;
  const int64_t block_bytes = kBlockTokens * (k_row_ + v_row_) * 4 * c_.num_layers;
  int64_t blocks = o_.kv_blocks;
  const int64_t max_useful = 16 * ((o_.max_seq_len + kBlockTokens - 1) / kBlockTokens);
  if (blocks == 0) {
    // What fits, keeping a quarter of the rest (at least 1 GiB) for larger passes' workspaces.
    const int64_t left = budget_.limit() - budget_.used();
    const int64_t spare = std::max<int64_t>(static_cast<int64_t>(kGiB), left / 4);
    blocks = std::min(max_useful, std::max<int64_t>(0, left - spare) / block_bytes);
    if (blocks < 1)
      return absl::ResourceExhaustedError(absl::StrCat(
          "no room for a KV cache: weights and workspaces take ",
          Gib(static_cast<double>(budget_.used())), " (", budget_.Describe(), ") of the ",
          Gib(static_cast<double>(budget_.limit())), " bound; one block of ", kBlockTokens,
          " tokens needs ", Gib(static_cast<double>(block_bytes))));
  }
  RETURN_IF_ERROR(budget_.Take(blocks * block_bytes, "KV cache"));
  kcache_.resize(static_cast<size_t>(c_.num_layers));
  vcache_.resize(static_cast<size_t>(c_.num_layers));
  for (int l = 0; l < c_.num_layers; ++l) {
    RETURN_IF_ERROR(kcache_[static_cast<size_t>(l)].Allocate(blocks * kBlockTokens * k_row_ * 4));
    if (v_row_)
      RETURN_IF_ERROR(vcache_[static_cast<size_t>(l)].Allocate(blocks * kBlockTokens * v_row_ * 4));
  }
  pool_ = std::make_shared<BlockPool>(blocks);
  std::fprintf(stderr,
               "hmoe cuda backend: device %d, %s in use of a %s bound (%s); KV pool %lld blocks "
               "of %lld tokens\n",
               o_.cuda_device, Gib(static_cast<double>(budget_.used())).c_str(),
               Gib(static_cast<double>(budget_.limit())).c_str(), budget_.Describe().c_str(),
               static_cast<long long>(blocks), static_cast<long long>(kBlockTokens));
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
    x_ = static_cast<float*>(piece(T * H * 4));
    y_ = static_cast<float*>(piece(T * H * 4));
    h_ = static_cast<float*>(piece(T * H * 4));
    ysh_ = static_cast<float*>(piece(T * H * 4));
    routed_ = static_cast<float*>(piece(T * H * 4));
    hb_ = static_cast<uint16_t*>(piece(T * H * 2));
    if (c_.is_mla()) {
      const int64_t qr = c_.mla.q_lora_rank.value_or(0), r = c_.mla.kv_lora_rank,
                    rope = c_.mla.qk_rope_head_dim, qk = c_.mla.qk_head_dim(),
                    vd = c_.mla.v_head_dim;
      qa_ = static_cast<float*>(piece(T * qr * 4));
      qab_ = static_cast<uint16_t*>(piece(T * qr * 2));
      q_ = static_cast<float*>(piece(T * nh * qk * 4));
      kva_ = static_cast<float*>(piece(T * (r + rope) * 4));
      qfull_ = static_cast<float*>(piece(T * nh * (r + rope) * 4));
      olat_ = static_cast<float*>(piece(T * nh * r * 4));
      attnb_ = static_cast<uint16_t*>(piece(T * nh * vd * 2));
    } else {
      const int64_t hd = c_.head_dim, kvr = c_.num_kv_heads * hd;
      q_ = static_cast<float*>(piece(T * nh * hd * 4));
      kk_ = static_cast<float*>(piece(T * kvr * 4));
      vv_ = static_cast<float*>(piece(T * kvr * 4));
      attn_ = static_cast<float*>(piece(T * nh * hd * 4));
      attnb_ = static_cast<uint16_t*>(piece(T * nh * hd * 2));
    }
    gu_ = static_cast<float*>(piece(T * 2 * max_inter_ * 4));
    actb_ = static_cast<uint16_t*>(piece(T * max_inter_ * 2));
    logits_ = static_cast<float*>(piece(T * E * 4));
    rw_ = static_cast<float*>(piece(T * K * 4));
    rid_ = static_cast<int32_t*>(piece(T * K * 4));
    rw2_ = static_cast<float*>(piece(T * K * 4));
    rid2_ = static_cast<int32_t*>(piece(T * K * 4));
    rw3_ = static_cast<float*>(piece(T * K * 4));
    rid3_ = static_cast<int32_t*>(piece(T * K * 4));
    cs_ = static_cast<float*>(piece(T * geo_.rope_dim * 4));
    xr_ = static_cast<float*>(piece(R * H * 4));
    lo_ = static_cast<float*>(piece(R * V * 4));
    meta_ints_ = 5 * T + table_entries;  // slot, table_start, pos, logit rows, ids, table
    meta_ = static_cast<int32_t*>(piece(meta_ints_ * 4));
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
  h_host_ = host_ws_.as<float>();
  rw_host_ = h_host_ + T * H;
  rid_host_ = reinterpret_cast<int32_t*>(rw_host_ + T * K);
  meta_host_ = rid_host_ + T * K;
  cs_host_ = reinterpret_cast<float*>(meta_host_ + meta_ints_);
  tokens_host_ = reinterpret_cast<int32_t*>(cs_host_ + T * geo_.rope_dim);
  cap_tokens_ = T;
  cap_table_ = table_entries;
  cap_rows_ = R;
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemm(const DevLin& w, const uint16_t* x, int64_t T, float* y) {
  const float one = 1.0f, zero = 0.0f;
  const void* wp = &w == &tied_head_ ? embed_.as<void>() : w.w.as<void>();
  ++launches_;
  cublasStatus_t s =
      cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(T),
                   static_cast<int>(w.cols), &one, wp, CUDA_R_16BF, static_cast<int>(w.cols), x,
                   CUDA_R_16BF, static_cast<int>(w.cols), &zero, y, CUDA_R_32F,
                   static_cast<int>(w.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS)
    return Failed(absl::InternalError(absl::StrCat("cuBLAS GemmEx ", w.rows, "x", w.cols, "x", T,
                                                   ": ", cublasGetStatusString(s))));
  if (w.has_bias())
    RETURN_IF_ERROR(Launched(AddBias(y, T, w.rows, w.b.as<float>(), stream_), "AddBias"));
  return absl::OkStatus();
}

PagedAttentionArgs CudaBackend::AttentionShape() const {
  PagedAttentionArgs a;
  const AttentionSpec& s = attn_specs_[0];
  const bool values = s.cache.v_row > 0;  // else read from the key rows
  a.k_cache = kcache_.empty() ? nullptr : kcache_[0].as<float>();
  a.num_heads = s.num_heads;
  a.dk = s.dk;
  a.dv = s.dv;
  a.k_row = s.cache.k_row;
  a.v_row = values ? s.cache.v_row : s.cache.k_row;
  a.v_cache = !values ? a.k_cache : vcache_.empty() ? nullptr : vcache_[0].as<float>();
  a.num_kv_heads = s.num_kv_heads;
  return a;
}

absl::Status CudaBackend::PlanGemmAttention(const int32_t* tstart, const int32_t* pos, int64_t T) {
  runs_.clear();
  const int64_t min_tokens = o_.cuda_gemm_attention_tokens;
  if (min_tokens <= 0 || T < min_tokens) return absl::OkStatus();
  runs_ = FindAttentionRuns(tstart, pos, T, min_tokens);
  const PagedAttentionArgs shape = AttentionShape();
  int64_t want = 0, least = 0;  // bytes: every run at its full chunk; one query
  for (const AttentionRun& r : runs_) {
    want = std::max(
        want, 4 * GemmAttentionScratchFloats(shape, r, std::min(r.n, kMaxGemmAttentionChunk)));
    least = std::max(least, 4 * GemmAttentionScratchFloats(shape, r, 1));
  }
  want = std::max(least, std::min(want, kGemmAttentionScratchBytes));
  if (want <= gemm_scratch_.bytes()) return absl::OkStatus();
  // Grow to `want`, or to what the budget has room for (runs that do not
  // fit then take PagedAttention).
  const int64_t old = gemm_scratch_.bytes();
  const int64_t room = budget_.limit() - budget_.used() + old;
  const int64_t bytes = std::min(want, room);
  if (bytes <= old) return absl::OkStatus();
  budget_.Give(old, "attention scratch");
  RETURN_IF_ERROR(gemm_scratch_.Allocate(0));
  RETURN_IF_ERROR(budget_.Take(bytes, "attention scratch"));
  if (!gemm_scratch_.Allocate(bytes).ok()) {  // out of device memory: PagedAttention
    budget_.Give(bytes, "attention scratch");
    cudaGetLastError();
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
  replayed_ = fell_back_ = slot_pass_ = false;
  if (o_.debug_cuda_fault_after > 0 && ++passes_begun_ == o_.debug_cuda_fault_after + 1) {
    std::fprintf(stderr, "hmoe cuda backend: injecting a sticky device error (pass %lld)\n",
                 static_cast<long long>(passes_begun_));
    InjectStickyError(stream_);
  }
  const int64_t T = p.size();
  if (slots_ && T <= kSlotTokens) return BeginSlotPass(p);
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
  int32_t* m = meta_host_;
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
  slot_ = meta_;
  tstart_ = meta_ + T;
  pos_ = meta_ + 2 * T;
  lrows_ = meta_ + 3 * T;
  table_ = meta_ + 4 * T;
  events_used_ = 0;
  BurstBegin();
  HMOE_CUDA_TRY(cudaMemcpyAsync(meta_, meta_host_, static_cast<size_t>((4 * T + entries) * 4),
                                cudaMemcpyHostToDevice, stream_),
                "metadata upload");
  // The ids ride in the host workspace's routing area (free until Route).
  std::copy(p.ids.begin(), p.ids.end(), rid_host_);
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(rid_, rid_host_, static_cast<size_t>(T * 4), cudaMemcpyHostToDevice, stream_),
      "token upload");
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(cs_, p.rope_cs.data(), p.rope_cs.size() * 4, cudaMemcpyHostToDevice, stream_),
      "rope upload");
  RETURN_IF_ERROR(Launched(EmbedRows(embed_.as<uint16_t>(), c_.hidden_size, rid_, T, x_, stream_),
                           "EmbedRows"));
  // The host buffers above are reused by Route: wait for the copies (cheap).
  return Sync("pass upload");
}

absl::Status CudaBackend::MlaAttention(int l) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, nh = c_.num_heads, r = c_.mla.kv_lora_rank,
                rope = c_.mla.qk_rope_head_dim, nope = c_.mla.qk_nope_head_dim,
                vd = c_.mla.v_head_dim;
  const bool inter = geo_.rope_layout == RopeLayout::kInterleaved;
  if (c_.mla.q_lora_rank) {
    const int64_t qr = *c_.mla.q_lora_rank;
    RETURN_IF_ERROR(Gemm(L.q_a, hb_, T, qa_));
    RETURN_IF_ERROR(Launched(AddRmsNorm(qa_, nullptr, T, qr, L.q_a_norm.as<float>(), kMlaNormEps,
                                        nullptr, qab_, stream_),
                             "AddRmsNorm"));
    RETURN_IF_ERROR(Gemm(L.q_b, qab_, T, q_));
  } else {
    RETURN_IF_ERROR(Gemm(L.q, hb_, T, q_));
  }
  RETURN_IF_ERROR(Gemm(L.kv_a, hb_, T, kva_));
  RETURN_IF_ERROR(
      Launched(WriteMlaCache(kva_, T, r, rope, L.kv_a_norm.as<float>(), kMlaNormEps, cs_, inter,
                             slot_, kcache_[static_cast<size_t>(l)].as<float>(), stream_),
               "WriteMlaCache"));
  RETURN_IF_ERROR(Launched(
      MlaAbsorbQuery(q_, L.kv_b.w.as<uint16_t>(), T, nh, nope, rope, vd, r, qfull_, stream_),
      "MlaAbsorbQuery"));
  RETURN_IF_ERROR(
      Launched(ApplyRope(qfull_, T, nh, nh * (r + rope), r + rope, r, rope, cs_, inter, stream_),
               "ApplyRope"));
  PagedAttentionArgs a;
  a.q = qfull_;
  a.q_tok_stride = nh * (r + rope);
  a.q_head_stride = r + rope;
  a.dk = r + rope;
  a.k_cache = kcache_[static_cast<size_t>(l)].as<float>();
  a.k_row = r + rope;
  a.v_cache = a.k_cache;
  a.v_row = r + rope;
  a.dv = r;
  a.T = T;
  a.num_heads = nh;
  a.num_kv_heads = 1;
  a.out = olat_;
  a.out_tok_stride = nh * r;
  a.out_head_stride = r;
  RETURN_IF_ERROR(Attend(a, L.window));
  RETURN_IF_ERROR(Launched(
      MlaExpandOutput(olat_, L.kv_b.w.as<uint16_t>(), T, nh, nope, vd, r, nullptr, attnb_, stream_),
      "MlaExpandOutput"));
  return Gemm(L.o, attnb_, T, y_);
}

absl::Status CudaBackend::GqaAttention(int l) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, nh = c_.num_heads, nkv = c_.num_kv_heads, hd = c_.head_dim;
  const int64_t row = nkv * hd;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  RETURN_IF_ERROR(Gemm(L.q, hb_, T, q_));
  RETURN_IF_ERROR(Gemm(L.k, hb_, T, kk_));
  RETURN_IF_ERROR(Gemm(L.v, hb_, T, vv_));
  if (L.q_norm.bytes() > 0) {
    RETURN_IF_ERROR(Launched(
        AddRmsNorm(q_, nullptr, T * nh, hd, L.q_norm.as<float>(), eps, q_, nullptr, stream_),
        "AddRmsNorm"));
    RETURN_IF_ERROR(Launched(
        AddRmsNorm(kk_, nullptr, T * nkv, hd, L.k_norm.as<float>(), eps, kk_, nullptr, stream_),
        "AddRmsNorm"));
  }
  RETURN_IF_ERROR(
      Launched(ApplyRope(q_, T, nh, nh * hd, hd, 0, hd, cs_, false, stream_), "ApplyRope"));
  RETURN_IF_ERROR(
      Launched(ApplyRope(kk_, T, nkv, row, hd, 0, hd, cs_, false, stream_), "ApplyRope"));
  RETURN_IF_ERROR(
      Launched(WriteKvCache(kk_, vv_, T, row, slot_, kcache_[static_cast<size_t>(l)].as<float>(),
                            vcache_[static_cast<size_t>(l)].as<float>(), stream_),
               "WriteKvCache"));
  PagedAttentionArgs a;
  a.q = q_;
  a.q_tok_stride = nh * hd;
  a.q_head_stride = hd;
  a.dk = hd;
  a.k_cache = kcache_[static_cast<size_t>(l)].as<float>();
  a.k_row = row;
  a.k_head_offset = hd;
  a.v_cache = vcache_[static_cast<size_t>(l)].as<float>();
  a.v_row = row;
  a.v_head_offset = hd;
  a.dv = hd;
  a.T = T;
  a.num_heads = nh;
  a.num_kv_heads = nkv;
  a.out = attn_;
  a.out_tok_stride = nh * hd;
  a.out_head_stride = hd;
  RETURN_IF_ERROR(Attend(a, L.window));
  RETURN_IF_ERROR(Launched(ToBf16(attn_, T * nh * hd, attnb_, stream_), "ToBf16"));
  return Gemm(L.o, attnb_, T, y_);
}

absl::Status CudaBackend::Attention(int l) {
  RETURN_IF_ERROR(health());
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, H = c_.hidden_size;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  BurstBegin();
  RETURN_IF_ERROR(
      Launched(AddRmsNorm(x_, nullptr, T, H, L.in_norm.as<float>(), eps, nullptr, hb_, stream_),
               "AddRmsNorm"));
  switch (attn_specs_[static_cast<size_t>(l)].kind) {  // the layer's attention kind's ops
    case AttentionKind::kMla:
      RETURN_IF_ERROR(MlaAttention(l));
      break;
    case AttentionKind::kGqa:
      RETURN_IF_ERROR(GqaAttention(l));
      break;
  }
  // x += attention; h = post_norm(x) (f32 for the experts, bf16 for the GEMMs).
  return Launched(AddRmsNorm(x_, y_, T, H, L.post_norm.as<float>(), eps, h_, hb_, stream_),
                  "AddRmsNorm");
}

absl::Status CudaBackend::Mlp(const DevMlp& m, float* out) {
  const int64_t T = rows_;
  RETURN_IF_ERROR(Gemm(m.gate_up, hb_, T, gu_));
  RETURN_IF_ERROR(Launched(SiluMul(gu_, T, m.inter, actb_, stream_), "SiluMul"));
  return Gemm(m.down, actb_, T, out);
}

absl::Status CudaBackend::DenseMlp(int l) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(Mlp(layers_[static_cast<size_t>(l)].dense, y_));
  return Launched(Accumulate(x_, y_, nullptr, rows_ * c_.hidden_size, stream_), "Accumulate");
}

absl::Status CudaBackend::RunRouter(int l, const GateSpec& g) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, H = c_.hidden_size, E = g.num_experts, K = g.top_k;
  const float one = 1.0f, zero = 0.0f;
  ++launches_;
  cublasStatus_t s =
      cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(T),
                  static_cast<int>(H), &one, L.router.w_f32.as<float>(), static_cast<int>(H), h_,
                  static_cast<int>(H), &zero, logits_, static_cast<int>(E));
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
  RETURN_IF_ERROR(Launched(
      RouteTokens(logits_, T, p, L.router_bias.bytes() ? L.router_bias.as<float>() : nullptr, rid_,
                  rw_, stream_),
      "RouteTokens"));
  return absl::OkStatus();
}

absl::Status CudaBackend::Route(int l, const GateSpec& g, RoutedInput* out) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(RunRouter(l, g));
  const int64_t T = rows_, H = c_.hidden_size, K = g.top_k;
  // The experts get bf16(h), as through the slots (and over the wire), so a
  // token's result does not depend on which path its pass took. routed_ is
  // free until AddExperts.
  RETURN_IF_ERROR(Launched(Bf16ToF32(hb_, T * H, routed_, stream_), "Bf16ToF32"));
  HMOE_CUDA_TRY(cudaMemcpyAsync(h_host_, routed_, static_cast<size_t>(T * H * 4),
                                cudaMemcpyDeviceToHost, stream_),
                "expert input download");
  HMOE_CUDA_TRY(cudaMemcpyAsync(rid_host_, rid_, static_cast<size_t>(T * K * 4),
                                cudaMemcpyDeviceToHost, stream_),
                "expert ids download");
  HMOE_CUDA_TRY(cudaMemcpyAsync(rw_host_, rw_, static_cast<size_t>(T * K * 4),
                                cudaMemcpyDeviceToHost, stream_),
                "expert weights download");
  RETURN_IF_ERROR(Sync("routing"));
  *out = RoutedInput{h_host_, rid_host_, rw_host_};
  return absl::OkStatus();
}

absl::Status CudaBackend::StartSharedExperts(int l) {
  RETURN_IF_ERROR(health());
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  shared_pending_ = L.has_shared;
  if (!L.has_shared) return absl::OkStatus();
  BurstBegin();
  RETURN_IF_ERROR(Mlp(L.shared, ysh_));
  BurstEnd();  // the host now waits for the routed experts
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CudaBackend::TakeRoutedSlots(int l, const RoutedInput& in, int64_t T, int k,
                                                     int32_t* ids_out) {
  streamed_pending_ = false;
  const int64_t E = c_.moe.num_experts, K = c_.moe.experts_per_token;
  if (!streamed_ || slot_pass_ || T <= kSlotTokens || T > streamed_->max_tokens() || k != K)
    return int64_t{0};
  RETURN_IF_ERROR(health());
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < T * K; ++s)
    if (in.ids[s] >= 0 && in.ids[s] < E) ++counts[static_cast<size_t>(in.ids[s])];
  PrefillPlan plan;
  if (o_.prefill_experts == "stream") {
    plan.choice = PrefillChoice::kStream;
    for (int32_t e = 0; e < E; ++e)
      if (counts[static_cast<size_t>(e)] > 0) plan.gpu_experts.push_back(e);
  } else {
    if (!cpu_rates_measured_) {
      if (experts_ == nullptr)
        return absl::FailedPreconditionError("hybrid prefill: no routed experts to measure");
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(Annotate(MeasureExpertRates(*experts_, c_, l, {16, 64, 256}, &prefill_rates_),
                               "hybrid prefill: measuring the expert service"));
      cpu_rates_measured_ = true;
      std::string pts;
      for (size_t i = 0; i < prefill_rates_.cpu_tokens.size(); ++i)
        absl::StrAppend(&pts, i ? ", " : "", prefill_rates_.cpu_tokens[i], " tokens ",
                        absl::StrFormat("%.0f", prefill_rates_.cpu_us[i]), " us");
      std::fprintf(stderr,
                   "hmoe cuda backend: hybrid prefill: the expert service takes per expert: %s, "
                   "and %.2f us per token of a call (measured in %.1f s); rates %s\n",
                   pts.c_str(), prefill_rates_.cpu_call_us_per_token,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                   PrefillRatesJson(prefill_rates_).c_str());
    }
    ASSIGN_OR_RETURN(plan, PlanPrefillLayer(counts, T, streamed_->expert_bytes(),
                                            6.0 * static_cast<double>(c_.hidden_size) *
                                                static_cast<double>(c_.moe.intermediate_size),
                                            prefill_rates_));
  }
  ++prefill_layers_[static_cast<int>(plan.choice)];
  if (o_.log_prefill_plans) absl::StrAppend(&pass_plan_log_, "\n  layer ", l, " ", plan.Describe());
  int64_t n = 0;
  if (!plan.gpu_experts.empty()) {
    BurstBegin();
    absl::StatusOr<int64_t> run =
        streamed_->Run(l, hb_, T, K, in.ids, rw_, plan.gpu_experts, ids_out);
    BurstEnd();
    if (!run.ok()) return Failed(run.status());
    n = *run;
  }
  if (absl::Status st = PrefetchAfter(l, plan, counts); !st.ok()) return Failed(st);
  streamed_pending_ = n > 0;
  streamed_slots_ += n;
  return n;
}

absl::Status CudaBackend::PrefetchAfter(int l, const PrefillPlan& plan,
                                        const std::vector<int64_t>& counts) {
  last_streamed_[static_cast<size_t>(l)] = plan.gpu_experts;
  if (streamed_->stages() < 2) return absl::OkStatus();
  int next = l + 1;
  while (next < c_.num_layers && !c_.layers[static_cast<size_t>(next)].moe) ++next;
  if (next >= c_.num_layers) return absl::OkStatus();
  // Every expert had tokens here and streamed: the next layer's most likely
  // do too (large passes); else what the next layer streamed last time.
  const bool all = plan.choice == PrefillChoice::kStream &&
                   std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
  std::vector<int32_t> guess;
  if (all) {
    guess.resize(counts.size());
    for (size_t e = 0; e < guess.size(); ++e) guess[e] = static_cast<int32_t>(e);
  } else {
    guess = last_streamed_[static_cast<size_t>(next)];
  }
  if (guess.empty()) return absl::OkStatus();
  return streamed_->Prefetch(next, guess).status();  // the copy stream only
}

absl::Status CudaBackend::AddExperts(int l, const float* routed) {
  (void)l;
  RETURN_IF_ERROR(health());
  const int64_t n = rows_ * c_.hidden_size;
  BurstBegin();
  if (routed == nullptr) {
    // Every slot streamed: no upload (it would queue behind the next
    // layer's experts on the copy engine). x += streamed + shared, the
    // reference's order (float addition commutes).
    const float* s = streamed_pending_ ? streamed_->out() : nullptr;
    streamed_pending_ = false;
    const float* add = shared_pending_ ? ysh_ : s;
    if (shared_pending_ && s != nullptr)
      RETURN_IF_ERROR(Launched(Accumulate(ysh_, s, nullptr, n, stream_), "Accumulate"));
    shared_pending_ = false;
    if (add == nullptr) return absl::OkStatus();
    return Launched(Accumulate(x_, add, nullptr, n, stream_), "Accumulate");
  }
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(routed_, routed, static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, stream_),
      "expert output upload");
  if (streamed_pending_)  // routed = the service's part + the streamed part
    RETURN_IF_ERROR(
        Launched(Accumulate(routed_, streamed_->out(), nullptr, n, stream_), "Accumulate"));
  streamed_pending_ = false;
  // x += routed + shared, the reference's order.
  if (shared_pending_)
    RETURN_IF_ERROR(Launched(Accumulate(routed_, ysh_, nullptr, n, stream_), "Accumulate"));
  shared_pending_ = false;
  return Launched(Accumulate(x_, routed_, nullptr, n, stream_), "Accumulate");
}

absl::Status CudaBackend::AddToResidual(const float* v) {
  RETURN_IF_ERROR(health());
  const int64_t n = rows_ * c_.hidden_size;
  BurstBegin();
  // routed_ is free here: AddExperts has consumed it (same stream, in order).
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(routed_, v, static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, stream_),
      "deferred output upload");
  return Launched(Accumulate(x_, routed_, nullptr, n, stream_), "Accumulate");
}

absl::Status CudaBackend::Logits(float* out) {
  RETURN_IF_ERROR(health());
  const int64_t R = static_cast<int64_t>(pass_->logit_rows.size()), H = c_.hidden_size;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  if (!replayed_) {
    // A slot pass computes every padded row (a graph's shapes are fixed);
    // only the R real ones leave the GPU.
    const int64_t rows = slot_pass_ ? rows_ : R;
    BurstBegin();
    RETURN_IF_ERROR(Launched(GatherRows(x_, H, lrows_, rows, xr_, stream_), "GatherRows"));
    RETURN_IF_ERROR(Launched(
        AddRmsNorm(xr_, nullptr, rows, H, final_norm_.as<float>(), eps, nullptr, hb_, stream_),
        "AddRmsNorm"));
    RETURN_IF_ERROR(Gemm(*lm_head_ptr_, hb_, rows, lo_));
  }
  if (capturing_) {
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture(stream_, &g);
    cudaGraphExec_t exec = nullptr;
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, g, 0);
    if (g != nullptr) cudaGraphDestroy(g);
    if (e != cudaSuccess) return CaptureFailed(e);
    capture_->exec = exec;
    if (dev_sends_) ArmCalls(capture_->slot_calls);
    capture_ = nullptr;
    ++graph_captures_;
    e = cudaGraphLaunch(exec, stream_);
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaGraphLaunch"));
    ++graph_launches_;
  }
  if (slot_pass_) {
    cudaError_t e = cudaEventRecord(pass_ev_[1], stream_);
    if (e != cudaSuccess) return Fail(CudaError(e, "cudaEventRecord"));
  }
  RETURN_IF_ERROR(Copy(out, lo_, R * c_.vocab_size * 4, cudaMemcpyDeviceToHost, "logits download"));
  RETURN_IF_ERROR(Sync("logits"));
  // An expert call that failed inside the pass fails the pass (not sticky).
  if (slot_pass_) {
    const absl::Status aborted = FinishDeviceWaits();
    RETURN_IF_ERROR(slots_->TakeStatus());
    RETURN_IF_ERROR(aborted);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CaptureFailed(cudaError_t e) {
  cudaGetLastError();  // a capture error is not sticky; do not leave it for a launcher
  graphs_on_ = false;
  fell_back_ = true;
  DropGraphs();
  const std::string why = absl::StrCat("CUDA Graph capture failed: ", cudaGetErrorString(e));
  std::fprintf(stderr, "hmoe cuda backend: %s; passes run without graphs from now on\n",
               why.c_str());
  return absl::InternalError(why);
}

absl::Status CudaBackend::FinishDeviceWaits() {
  if (dev_waits_.empty() || !in_pass_.load()) return absl::OkStatus();
  in_pass_.store(false);
  slots_->Drain();
  if (dev_sends_) {
    slots_->SetDeviceSends(false);
    // What the submit host node counts otherwise: the ids the armed calls sent.
    if (counts_ != nullptr && pass_calls_ != nullptr) {
      const int64_t T = *tokens_host_;
      for (const SlotCall& c : *pass_calls_) {
        if (armed_host_[c.slot] == 0) continue;
        counts_->Add(c.layer, views_[static_cast<size_t>(c.slot)].ids, T * c.k);
        if (c.hot_ids != nullptr) counts_->Add(c.layer, c.hot_ids, T * c.k);
      }
    }
  }
  // A wait the device gave up (its timeout, the watchdog, a failed arm or
  // submit) may have let the adds read a stale answer, even when every call
  // was answered by the time of the host's Wait: the pass is dropped.
  if (__atomic_load_n(abort_host_, __ATOMIC_ACQUIRE) != 0)
    return absl::UnavailableError(
        "routed experts: the device stopped waiting for an expert answer (the call's deadline "
        "passed or the expert service went away); the pass is dropped");
  return absl::OkStatus();
}

void CudaBackend::ArmCalls(const std::vector<SlotCall>& calls) {
  const int32_t T = *tokens_host_;
  for (const SlotCall& c : calls)
    armed_host_[c.slot] = slots_->Arm(c.slot, c.layer, T, c.k) ? 1u : 0u;
  // A call not armed for a failure (e.g. its slot still holds an abandoned
  // call): the pass's waits end at once rather than spin on that slot.
  if (slots_->has_failure()) __atomic_store_n(abort_host_, 1u, __ATOMIC_RELEASE);
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
    FinishDeviceWaits().IgnoreError();  // reported by Logits; a pass without logits keeps none
    int64_t wait = slots_->TakeWaitNs();
    if (waited_host_ != nullptr) {
      wait += static_cast<int64_t>(__atomic_load_n(waited_host_, __ATOMIC_ACQUIRE));
      __atomic_store_n(waited_host_, 0ull, __ATOMIC_RELEASE);
    }
    slot_wait_ns_ += wait;
    float ms = 0;
    // GPU busy: the pass's span less the host nodes' waits for the experts.
    if (cudaEventElapsedTime(&ms, pass_ev_[0], pass_ev_[1]) == cudaSuccess)
      busy_ns_ += std::max<int64_t>(0, static_cast<int64_t>(ms * 1e6) - wait);
    eager_calls_.clear();
    slot_pass_ = replayed_ = false;
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
  if (capturing_) {
    // Nothing ran: drop the half-captured graph.
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    capturing_ = false;
  }
  if (capture_ != nullptr) {
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
      if (&it->second == capture_) {
        graphs_.erase(it);
        break;
      }
    capture_ = nullptr;
  }
  // Drain what was queued so buffers can be reused; a sticky error stays in broken_.
  BurstEnd();
  cudaError_t e = cudaStreamSynchronize(stream_);
  if (e != cudaSuccess) Fail(CudaError(e, "pass abort")).IgnoreError();
  in_pass_.store(false);
  pass_calls_ = nullptr;
  if (waited_host_ != nullptr) __atomic_store_n(waited_host_, 0ull, __ATOMIC_RELEASE);
  if (slots_) {
    if (dev_sends_) slots_->SetDeviceSends(false);
    // Calls the pass submitted and never waited on (it stopped half way);
    // armed ones the device never sent are released at once.
    slots_->Drain();
    slots_->TakeStatus().IgnoreError();
    slot_wait_ns_ += slots_->TakeWaitNs();
  }
  eager_calls_.clear();
  events_used_ = 0;
  shared_pending_ = false;
  slot_pass_ = replayed_ = false;
  pass_ = nullptr;
}

void CudaBackend::DropGraphs() {
  pass_calls_ = nullptr;  // it may point into a graph's list
  for (auto& [bucket, g] : graphs_)
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
  capture_ = nullptr;
}

bool CudaBackend::AttachExperts(RoutedExperts* experts, RoutingCounters* counts) {
  experts_ = experts;
  counts_ = counts;
  if (!o_.cuda_expert_slots) {
    std::fprintf(stderr,
                 "hmoe cuda backend: routed experts through host copies (--cuda-expert-slots "
                 "off)\n");
    return false;
  }
  ExpertSlotsOptions so;
  so.hidden = c_.hidden_size;
  so.num_slots = 2 * c_.num_layers;  // per layer: the call, and its deferred part
  so.max_tokens = static_cast<int32_t>(kSlotTokens);
  so.top_k = static_cast<int32_t>(c_.moe.experts_per_token);
  // Called outside passes (Prepare, destruction): unpins what is released.
  so.before_release = [](void* base, uint64_t) {
    cudaHostUnregister(base);
    cudaGetLastError();  // not registered (e.g. registration had failed): nothing to undo
  };
  auto fallback = [&](const absl::Status& st) {
    std::fprintf(stderr,
                 "hmoe cuda backend: routed experts through host copies, without slots or "
                 "graphs: %s\n",
                 st.ToString().c_str());
    slots_.reset();
    return false;
  };
  auto made = experts->MakeSlots(so);
  if (!made.ok()) return fallback(made.status());
  slots_ = std::move(*made);
  if (o_.cuda_device_calls && abort_dev_ == nullptr) {
    const int64_t ctl_bytes = 64 + 4 * static_cast<int64_t>(so.num_slots);
    absl::Status st = wait_ctl_.Allocate(ctl_bytes);
    void* d = nullptr;
    if (st.ok() && cudaHostGetDevicePointer(&d, wait_ctl_.as<void>(), 0) != cudaSuccess) {
      cudaGetLastError();
      st = absl::InternalError("cudaHostGetDevicePointer of the wait words");
    }
    if (st.ok()) st = send_counter_.Allocate(4);
    if (st.ok() && cudaMemset(send_counter_.as<void>(), 0, 4) != cudaSuccess) {
      cudaGetLastError();
      st = absl::InternalError("cudaMemset of the send counter");
    }
    if (st.ok()) {
      std::memset(wait_ctl_.as<void>(), 0, static_cast<size_t>(ctl_bytes));
      abort_host_ = wait_ctl_.as<uint32_t>();
      abort_dev_ = static_cast<uint32_t*>(d);
      armed_host_ = reinterpret_cast<uint32_t*>(wait_ctl_.as<uint8_t>() + 64);
      armed_dev_ = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(d) + 64);
      waited_host_ = reinterpret_cast<unsigned long long*>(wait_ctl_.as<uint8_t>() + 8);
      waited_dev_ = reinterpret_cast<unsigned long long*>(static_cast<uint8_t*>(d) + 8);
    } else {
      std::fprintf(stderr, "hmoe cuda backend: expert calls through host nodes: %s\n",
                   st.ToString().c_str());
    }
  }
  auto gen = slots_->Prepare(absl::Now() + absl::Seconds(10));
  if (!gen.ok()) return fallback(gen.status());
  absl::Status st = RegisterSlots(*gen);
  if (!st.ok()) return fallback(st);
  const int64_t max_len = o_.max_seq_len > 0 ? o_.max_seq_len : c_.max_position_embeddings;
  table_per_seq_ = (max_len + kBlockTokens - 1) / kBlockTokens;
  table_cap_ = std::min(kSlotTokens * table_per_seq_, pool_->total());
  st = EnsureWorkspace(kSlotTokens, table_cap_, kSlotTokens);
  if (!st.ok()) return fallback(st);
  std::fprintf(stderr,
               "hmoe cuda backend: routed experts through %d %s slots, %s; passes of up to %lld "
               "tokens %s\n",
               slots_->num_slots(), slots_->kind(),
               dev_sends_           ? "sent and waited for by the device"
               : dev_waits_.empty() ? "sent and waited for by host nodes"
                                    : "sent by host nodes, waited for by the device",
               static_cast<long long>(kSlotTokens),
               graphs_on_ ? "replay one CUDA Graph per bucket (1, 2, 4, 8, 16, 32 tokens)"
                          : "run kernel by kernel (--cuda-graphs off)");
  if (abort_dev_ != nullptr && !watchdog_.joinable())
    watchdog_ = std::thread([this] { Watchdog(); });
  return true;
}

void CudaBackend::Watchdog() {
  std::unique_lock<std::mutex> lock(wd_mu_);
  while (!wd_stop_) {
    wd_cv_.wait_for(lock, std::chrono::milliseconds(10));
    // Under wd_mu_, as BeginSlotPass's reset: a late store cannot land in
    // the next pass.
    if (!wd_stop_ && in_pass_.load() && !slots_->service_alive())
      __atomic_store_n(abort_host_, 1u, __ATOMIC_RELEASE);
  }
}

absl::Status CudaBackend::RegisterSlots(uint64_t gen) {
  for (const HostRegion& r : slots_->regions()) {
    cudaError_t e = cudaHostRegister(r.base, static_cast<size_t>(r.bytes),
                                     cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("cudaHostRegister of the ", slots_->kind(),
                                              " expert slots (", r.bytes,
                                              " bytes): ", cudaGetErrorString(e)));
    }
    cudaGetLastError();
  }
  views_.resize(static_cast<size_t>(slots_->num_slots()));
  for (int i = 0; i < slots_->num_slots(); ++i) views_[static_cast<size_t>(i)] = slots_->view(i);
  dev_waits_.clear();
  if (o_.cuda_device_calls && abort_dev_ != nullptr) {
    std::vector<DevWait> w(static_cast<size_t>(slots_->num_slots()));
    bool all = true;
    for (int i = 0; i < slots_->num_slots() && all; ++i) {
      const ExpertSlots::DeviceWait dw = slots_->device_wait(i);
      void* d = nullptr;
      all = dw.word != nullptr && cudaHostGetDevicePointer(&d, dw.word, 0) == cudaSuccess;
      w[static_cast<size_t>(i)] =
          DevWait{static_cast<uint32_t*>(d), dw.busy_lo, dw.busy_hi, dw.request};
    }
    cudaGetLastError();
    if (all) dev_waits_ = std::move(w);
  }
  dev_sends_ = !dev_waits_.empty() && send_counter_.bytes() > 0 &&
               std::all_of(dev_waits_.begin(), dev_waits_.end(),
                           [](const DevWait& w) { return w.request != 0; });
  // The device writes the requests and reads the answers in place.
  for (int i = 0; i < slots_->num_slots() && dev_sends_; ++i) {
    const SlotView& v = views_[static_cast<size_t>(i)];
    DevWait& w = dev_waits_[static_cast<size_t>(i)];
    void *h = nullptr, *d = nullptr, *wt = nullptr, *o = nullptr;
    dev_sends_ = cudaHostGetDevicePointer(&h, v.hidden, 0) == cudaSuccess &&
                 cudaHostGetDevicePointer(&d, v.ids, 0) == cudaSuccess &&
                 cudaHostGetDevicePointer(&wt, v.weights, 0) == cudaSuccess &&
                 cudaHostGetDevicePointer(&o, const_cast<float*>(v.out), 0) == cudaSuccess;
    w.hidden = static_cast<uint16_t*>(h);
    w.ids = static_cast<int32_t*>(d);
    w.weights = static_cast<float*>(wt);
    w.out = static_cast<const float*>(o);
  }
  cudaGetLastError();
  DropGraphs();  // their copies point at the old slots
  slots_gen_ = gen;
  return absl::OkStatus();
}

absl::Status CudaBackend::BeginSlotPass(const PassTokens& p) {
  runs_.clear();
  const int64_t T = p.size(), B = BucketFor(T), rd = geo_.rope_dim;
  // Reconnects to a restarted service (new slots, graphs recaptured).
  ASSIGN_OR_RETURN(uint64_t gen, slots_->Prepare(absl::Now() + absl::Seconds(10)));
  if (gen != slots_gen_) RETURN_IF_ERROR(RegisterSlots(gen));
  const int64_t cap = std::min(B * table_per_seq_, table_cap_);
  RETURN_IF_ERROR(EnsureWorkspace(kSlotTokens, table_cap_, kSlotTokens));
  // The padded layout: slot, table start, pos, logit rows, ids [B each], table.
  int32_t* m = meta_host_;
  int32_t *slot = m, *tstart = m + B, *pos = m + 2 * B, *lrows = m + 3 * B, *ids = m + 4 * B,
          *table = m + 5 * B;
  std::unordered_map<const KvCache*, int32_t> start;
  int64_t entries = 0;
  for (int64_t t = 0; t < T; ++t) {
    auto [it, fresh] = start.emplace(p.kv[static_cast<size_t>(t)], 0);
    if (!fresh) continue;
    const auto& b = static_cast<const CudaKvCache*>(it->first)->blocks();
    if (entries + static_cast<int64_t>(b.size()) > cap)
      return absl::InternalError(absl::StrCat("slot pass: block table over ", cap, " entries"));
    it->second = static_cast<int32_t>(entries);
    std::copy(b.begin(), b.end(), table + entries);
    entries += static_cast<int64_t>(b.size());
  }
  for (int64_t t = 0; t < B; ++t) {
    if (t < T) {
      const auto* kv = static_cast<const CudaKvCache*>(p.kv[static_cast<size_t>(t)]);
      const int64_t ps = p.pos[static_cast<size_t>(t)];
      slot[t] = kv->Row(ps);
      tstart[t] = start[kv];
      pos[t] = static_cast<int32_t>(ps);
      ids[t] = p.ids[static_cast<size_t>(t)];
    } else {  // padding: position 0 of the first table, no cache write, token 0
      slot[t] = -1;
      tstart[t] = 0;
      pos[t] = 0;
      ids[t] = 0;
    }
    lrows[t] =
        t < static_cast<int64_t>(p.logit_rows.size()) ? p.logit_rows[static_cast<size_t>(t)] : 0;
  }
  std::memcpy(cs_host_, p.rope_cs.data(), static_cast<size_t>(T * rd) * 4);
  std::fill(cs_host_ + T * rd, cs_host_ + B * rd, 0.0f);
  *tokens_host_ = static_cast<int32_t>(T);
  pass_ = &p;
  rows_ = B;
  slot_pass_ = true;
  slot_ = meta_;
  tstart_ = meta_ + B;
  pos_ = meta_ + 2 * B;
  lrows_ = meta_ + 3 * B;
  int32_t* ids_dev = meta_ + 4 * B;
  table_ = meta_ + 5 * B;
  events_used_ = 0;
  if (!dev_waits_.empty()) {
    {
      std::lock_guard<std::mutex> lock(wd_mu_);
      __atomic_store_n(abort_host_, 0u, __ATOMIC_RELEASE);
      in_pass_.store(true);
    }
    if (dev_sends_) slots_->SetDeviceSends(true);
  }
  eager_slot_calls_.clear();
  pass_calls_ = &eager_slot_calls_;
  cudaError_t e = cudaEventRecord(pass_ev_[0], stream_);
  if (e != cudaSuccess) return Fail(CudaError(e, "cudaEventRecord"));
  calls_ = &eager_calls_;
  if (graphs_on_) {
    auto it = graphs_.find(B);
    if (it != graphs_.end() && it->second.exec != nullptr) {
      pass_calls_ = &it->second.slot_calls;
      if (dev_sends_) ArmCalls(it->second.slot_calls);
      e = cudaGraphLaunch(it->second.exec, stream_);
      if (e != cudaSuccess) return Fail(CudaError(e, "cudaGraphLaunch"));
      ++graph_launches_;
      replayed_ = true;
      return absl::OkStatus();
    }
    Graph& g = graphs_[B];
    g.calls.clear();
    g.slot_calls.clear();
    pass_calls_ = &g.slot_calls;
    e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      capture_ = &g;
      calls_ = &g.calls;
      capturing_ = true;
    } else {
      // Nothing captured yet: say why once, then run this pass eagerly
      // (CaptureFailed dropped the graphs, g with them).
      CaptureFailed(e).IgnoreError();
      fell_back_ = false;
      pass_calls_ = &eager_slot_calls_;
    }
  }
  RETURN_IF_ERROR(
      Copy(meta_, meta_host_, (5 * B + cap) * 4, cudaMemcpyHostToDevice, "metadata upload"));
  RETURN_IF_ERROR(Copy(cs_, cs_host_, B * rd * 4, cudaMemcpyHostToDevice, "rope upload"));
  return Launched(EmbedRows(embed_.as<uint16_t>(), c_.hidden_size, ids_dev, B, x_, stream_),
                  "EmbedRows");
}

absl::Status CudaBackend::RouteToSlots(int l, const GateSpec& g, int n) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(RunRouter(l, g));
  const int64_t T = rows_, H = c_.hidden_size, K = g.top_k, k0 = K - n;
  const int32_t* ids0 = rid_;
  const float* w0 = rw_;
  if (n > 0) {
    RETURN_IF_ERROR(Launched(SplitDeferred(rid_, rw_, T, K, n, rid2_, rw2_, rid3_, rw3_, stream_),
                             "SplitDeferred"));
    ids0 = rid2_;
    w0 = rw2_;
  }
  // Straight into the slots: bf16 rows (the post-attention norm's), ids, weights.
  auto to_slot = [&](int slot, const int32_t* ids, const float* w, int64_t k) -> absl::Status {
    const SlotView& v = views_[static_cast<size_t>(slot)];
    RETURN_IF_ERROR(Copy(v.hidden, hb_, T * H * 2, cudaMemcpyDeviceToHost, "expert input copy"));
    RETURN_IF_ERROR(Copy(v.ids, ids, T * k * 4, cudaMemcpyDeviceToHost, "expert ids copy"));
    return Copy(v.weights, w, T * k * 4, cudaMemcpyDeviceToHost, "expert weights copy");
  };
  // Hot experts: this layer's hot slots split off (their ids copied out for
  // the routing counts), the others sent (the deferred part always is),
  // then the hot ones computed into hot_out_ while the service works.
  const int32_t* hot_host = nullptr;
  const auto h = hot_.find(l);
  if (h != hot_.end()) {
    const int64_t slots = T * k0;
    int32_t* hot_ids = hot_ids_.as<int32_t>();
    RETURN_IF_ERROR(
        Launched(SplitHotIds(ids0, slots, h->second.mask.as<uint8_t>(), c_.moe.num_experts,
                             cold_ids_.as<int32_t>(), hot_ids, stream_),
                 "SplitHotIds"));
    int32_t* pinned = hot_ids_host_ + static_cast<int64_t>(l) * kSlotTokens * K;
    RETURN_IF_ERROR(Copy(pinned, hot_ids, slots * 4, cudaMemcpyDeviceToHost, "hot ids copy"));
    hot_host = pinned;
  }
  auto compute_hot = [&]() -> absl::Status {
    if (h == hot_.end()) return absl::OkStatus();
    HotExpertsArgs ha;
    ha.x = hb_;
    ha.T = T;
    ha.H = H;
    ha.I = c_.moe.intermediate_size;
    ha.ids = hot_ids_.as<int32_t>();
    ha.weights = w0;
    ha.K = k0;
    ha.experts = h->second.table.as<DevExpert>();
    ha.E = c_.moe.num_experts;
    ha.out = hot_out_.as<float>();
    ha.scratch = hot_scratch_.as<void>();
    ha.scratch_bytes = hot_scratch_.bytes();
    return Launched(HotExperts(ha, stream_), "HotExperts");
  };
  if (h != hot_.end()) ids0 = cold_ids_.as<int32_t>();
  if (dev_sends_) {
    // The host arms the calls (now, or at the graph's launch); one kernel
    // per call writes its request into the slot and sends it.
    const SlotCall sc[2] = {{2 * l, l, static_cast<int32_t>(k0), hot_host}, {2 * l + 1, l, n}};
    const int32_t* ids[2] = {ids0, rid3_};
    const float* ws[2] = {w0, rw3_};
    for (int i = 0; i < (n > 0 ? 2 : 1); ++i) {
      pass_calls_->push_back(sc[i]);
      if (!capturing_) ArmCalls({sc[i]});
      const DevWait& w = dev_waits_[static_cast<size_t>(sc[i].slot)];
      RETURN_IF_ERROR(
          Launched(SendExpertCall(hb_, T, H, ids[i], ws[i], sc[i].k, w.hidden, w.ids, w.weights,
                                  w.word, w.request, armed_dev_ + sc[i].slot, abort_dev_,
                                  send_counter_.as<unsigned int>(), stream_),
                   "SendExpertCall"));
    }
    return compute_hot();
  }
  RETURN_IF_ERROR(to_slot(2 * l, ids0, w0, k0));
  if (n > 0) RETURN_IF_ERROR(to_slot(2 * l + 1, rid3_, rw3_, n));
  HostCall& c = calls_->emplace_back();
  c.slots = slots_.get();
  c.a = 2 * l;
  c.b = n > 0 ? 2 * l + 1 : -1;
  c.layer = l;
  c.ka = static_cast<int32_t>(k0);
  c.kb = n;
  c.tokens = tokens_host_;
  c.counts = counts_;
  c.ids_a = views_[static_cast<size_t>(2 * l)].ids;
  c.ids_b = n > 0 ? views_[static_cast<size_t>(2 * l + 1)].ids : nullptr;
  c.abort = dev_waits_.empty() ? nullptr : abort_host_;
  c.hot_ids = hot_host;
  cudaError_t e = cudaLaunchHostFunc(stream_, SubmitHost, &c);
  if (e != cudaSuccess) return Failed(CudaError(e, "expert submit node"));
  return compute_hot();
}

absl::Status CudaBackend::JoinSlot(int l, int part) {
  RETURN_IF_ERROR(health());
  const int slot = 2 * l + part;
  const int64_t n = rows_ * c_.hidden_size;
  if (!dev_waits_.empty()) {
    // Polls the slot's state word; the host's Wait follows after the pass.
    const DevWait& w = dev_waits_[static_cast<size_t>(slot)];
    const uint64_t timeout_ns = static_cast<uint64_t>(
        std::max<int64_t>(1, absl::ToInt64Nanoseconds(slots_->call_timeout())));
    RETURN_IF_ERROR(
        Launched(WaitHostWord(w.word, w.lo, w.hi, abort_dev_, timeout_ns, waited_dev_, stream_),
                 "WaitHostWord"));
  } else {
    HostCall& c = calls_->emplace_back();
    c.slots = slots_.get();
    c.a = slot;
    c.layer = l;
    c.tokens = tokens_host_;
    cudaError_t e = cudaLaunchHostFunc(stream_, WaitHost, &c);
    if (e != cudaSuccess) return Failed(CudaError(e, "expert wait node"));
  }
  const bool hot = part == 0 && hot_.count(l) > 0;
  if (dev_sends_ && hot) {
    // routed = cold + hot (in hot_out_), then x += routed + shared.
    float* routed = hot_out_.as<float>();
    RETURN_IF_ERROR(
        Launched(Accumulate(routed, dev_waits_[static_cast<size_t>(slot)].out, nullptr, n, stream_),
                 "Accumulate"));
    if (shared_pending_)
      RETURN_IF_ERROR(Launched(Accumulate(routed, ysh_, nullptr, n, stream_), "Accumulate"));
    shared_pending_ = false;
    return Launched(Accumulate(x_, routed, nullptr, n, stream_), "Accumulate");
  }
  if (dev_sends_) {
    // The sums read in place from the slot: x += routed + shared, the
    // reference's order (routed + shared == shared + routed, bit for bit).
    const float* out = dev_waits_[static_cast<size_t>(slot)].out;
    if (part == 0 && shared_pending_) {
      shared_pending_ = false;
      RETURN_IF_ERROR(Launched(Accumulate(ysh_, out, nullptr, n, stream_), "Accumulate"));
      return Launched(Accumulate(x_, ysh_, nullptr, n, stream_), "Accumulate");
    }
    if (part == 0) shared_pending_ = false;
    return Launched(Accumulate(x_, out, nullptr, n, stream_), "Accumulate");
  }
  RETURN_IF_ERROR(Copy(routed_, views_[static_cast<size_t>(slot)].out, n * 4,
                       cudaMemcpyHostToDevice, "expert output copy"));
  if (hot)  // routed = cold + hot
    RETURN_IF_ERROR(
        Launched(Accumulate(routed_, hot_out_.as<float>(), nullptr, n, stream_), "Accumulate"));
  // x += routed + shared, the reference's order.
  if (part == 0 && shared_pending_)
    RETURN_IF_ERROR(Launched(Accumulate(routed_, ysh_, nullptr, n, stream_), "Accumulate"));
  if (part == 0) shared_pending_ = false;
  return Launched(Accumulate(x_, routed_, nullptr, n, stream_), "Accumulate");
}

}  // namespace

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

absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCudaBackend(const ModelConfig& config,
                                                                const Checkpoint& ckpt,
                                                                const ModelOptions& options) {
  std::string why;
  if (!CudaBackendUsable(options.cuda_device, &why)) return absl::FailedPreconditionError(why);
  auto b = std::make_unique<CudaBackend>(config, options);
  RETURN_IF_ERROR(b->Init(ckpt));
  return std::unique_ptr<LayerBackend>(std::move(b));
}

}  // namespace hmoe::cuda
