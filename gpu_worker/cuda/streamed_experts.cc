#include "gpu_worker/cuda/streamed_experts.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/transport/moe_call.h"
#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/streamed_expert_kernels.h"

namespace hmoe::cuda {
namespace {

constexpr int kChunks = 32;  // upload events per layer

int64_t Align256(int64_t n) { return (n + 255) / 256 * 256; }

}  // namespace

StreamedExperts::~StreamedExperts() {
  if (compute_ != nullptr) cudaStreamSynchronize(compute_);
  if (copy_ != nullptr) {
    cudaStreamSynchronize(copy_);
    cudaStreamDestroy(copy_);
  }
  for (cudaEvent_t e : chunk_ev_)
    if (e != nullptr) cudaEventDestroy(e);
  for (Stage& st : stages_)
    if (st.done != nullptr) cudaEventDestroy(st.done);
  for (const Span& sp : spans_) {
    cudaEventDestroy(sp.a);
    cudaEventDestroy(sp.b);
  }
  for (cudaEvent_t e : span_pool_) cudaEventDestroy(e);
  if (budget_ != nullptr) {
    budget_->Give(device_bytes_, "streamed experts");
    budget_->Give(prefetch_stage_bytes_, "streamed experts (prefetch stage)");
  }
}

int64_t StreamedExperts::host_bytes() const {
  return static_cast<int64_t>(arena_.size()) * c_.moe.num_experts * blob_;
}

DevExpert StreamedExperts::ExpertAt(const char* base) const {
  const int64_t H = c_.hidden_size, I = c_.moe.intermediate_size;
  auto view = [&](int i, int64_t rows, int64_t cols) {
    DevQuantMatrix m;
    m.format = format_;
    m.group = group_;
    m.rows = rows;
    m.cols = cols;
    m.w = base + off_[2 * i];
    m.scale = HasScales(format_) ? reinterpret_cast<const float*>(base + off_[2 * i + 1]) : nullptr;
    return m;
  };
  DevExpert e;
  e.gate = view(0, I, H);
  e.up = view(1, I, H);
  e.down = view(2, H, I);
  return e;
}

absl::StatusOr<std::unique_ptr<StreamedExperts>> StreamedExperts::Create(
    const ModelConfig& config, const ExpertSourceFn& source, WeightFormat format, int group,
    int64_t max_tokens, bool prefetch, cudaStream_t compute, cublasHandle_t blas, Budget* budget,
    const std::function<void(int64_t done, int64_t total)>& progress) {
  if (max_tokens <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("streamed experts: max_tokens ", max_tokens, " must be > 0"));
  std::unique_ptr<StreamedExperts> s(new StreamedExperts());
  s->c_ = config;
  s->format_ = format;
  s->group_ = IsGrouped(format) ? group : 0;
  s->max_tokens_ = max_tokens;
  s->compute_ = compute;
  s->blas_ = blas;
  const int64_t H = config.hidden_size, I = config.moe.intermediate_size,
                E = config.moe.num_experts, K = config.moe.experts_per_token;
  // The blob layout.
  int64_t at = 0;
  const KernelMatrixBytes m[3] = {KernelLayoutBytes(format, group, I, H),
                                  KernelLayoutBytes(format, group, I, H),
                                  KernelLayoutBytes(format, group, H, I)};
  for (int i = 0; i < 3; ++i) {
    s->off_[2 * i] = at;
    at = Align256(at + m[i].w);
    s->off_[2 * i + 1] = at;
    at = Align256(at + m[i].scale);
  }
  s->blob_ = at;
  // Device memory first (fails fast on a card too small), then the arena.
  const int64_t slots = max_tokens * K;
  s->idx_ints_ = 2 * slots + (slots + 3) / 4;
  const int64_t need = E * s->blob_ + 2 * I * H * 2 + H * I * 2 + slots * H * 2 + slots * H * 4 +
                       max_tokens * 2 * I * 4 + max_tokens * I * 2 + 2 * max_tokens * H * 4 +
                       s->idx_ints_ * 4;
  RETURN_IF_ERROR(budget->Take(need, "streamed experts"));
  s->budget_ = budget;
  s->device_bytes_ = need;
  s->stages_.emplace_back();
  RETURN_IF_ERROR(s->stages_[0].buf.Allocate(E * s->blob_));
  if (prefetch) {
    if (absl::Status st = budget->Take(E * s->blob_, "streamed experts (prefetch stage)");
        st.ok()) {
      s->prefetch_stage_bytes_ = E * s->blob_;
      s->stages_.emplace_back();
      RETURN_IF_ERROR(s->stages_[1].buf.Allocate(E * s->blob_));
    } else {
      std::fprintf(stderr,
                   "hmoe cuda backend: streamed experts: one stage, no prefetch of the next "
                   "layer (%s)\n",
                   std::string(st.message()).c_str());
    }
  }
  RETURN_IF_ERROR(s->w_gu_.Allocate(2 * I * H * 2));
  RETURN_IF_ERROR(s->w_d_.Allocate(H * I * 2));
  RETURN_IF_ERROR(s->xg_.Allocate(slots * H * 2));
  RETURN_IF_ERROR(s->ys_.Allocate(slots * H * 4));
  RETURN_IF_ERROR(s->y_gu_.Allocate(max_tokens * 2 * I * 4));
  RETURN_IF_ERROR(s->hb_.Allocate(max_tokens * I * 2));
  RETURN_IF_ERROR(s->z_.Allocate(max_tokens * H * 4));
  RETURN_IF_ERROR(s->out_.Allocate(max_tokens * H * 4));
  RETURN_IF_ERROR(s->idx_.Allocate(s->idx_ints_ * 4));
  RETURN_IF_ERROR(s->idx_host_.Allocate(s->idx_ints_ * 4));
  HMOE_CUDA_TRY(cudaStreamCreateWithFlags(&s->copy_, cudaStreamNonBlocking), "cudaStreamCreate");
  s->chunk_ev_.resize(2 * kChunks, nullptr);  // a Prefetch's chunks and its Run's
  for (cudaEvent_t& e : s->chunk_ev_)
    HMOE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  for (Stage& st : s->stages_) {
    st.arrival.assign(static_cast<size_t>(E), -1);
    st.ahead.assign(static_cast<size_t>(E), 0);
    HMOE_CUDA_TRY(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming), "cudaEventCreate");
    HMOE_CUDA_TRY(cudaEventRecord(st.done, compute), "cudaEventRecord");
  }

  // The arena: per MoE layer, E blobs quantized as the service's.
  s->layer_row_.assign(static_cast<size_t>(config.num_layers), -1);
  const int64_t pin_total = static_cast<int64_t>(config.moe_layer_indices().size()) * E * s->blob_;
  if (progress) progress(0, pin_total);
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layers[static_cast<size_t>(l)].moe) continue;
    Placement all;
    all.model_type = config.model_type;
    all.num_experts = E;
    all.experts_per_token = K;
    std::vector<int32_t>& ids = all.hot[l];
    for (int32_t e = 0; e < E; ++e) ids.push_back(e);
    all.num_hot = E;
    ASSIGN_OR_RETURN(std::vector<HotExpertWeights> w,
                     LoadHotExperts(source, config, all, format, group));
    PinnedBuffer& row = s->arena_.emplace_back();
    RETURN_IF_ERROR(row.Allocate(E * s->blob_));
    char* base = row.as<char>();
    for (const HotExpertWeights& h : w) {
      char* b = base + static_cast<int64_t>(h.expert) * s->blob_;
      const HostQuantMatrix* mats[3] = {&h.gate, &h.up, &h.down};
      for (int i = 0; i < 3; ++i) {
        if (static_cast<int64_t>(mats[i]->w.size()) != m[i].w ||
            static_cast<int64_t>(mats[i]->scale.size()) * 4 != m[i].scale)
          return absl::InternalError(absl::StrCat("streamed experts: layer ", l, " expert ",
                                                  h.expert, " matrix ", i,
                                                  " is not the expected size"));
        std::memcpy(b + s->off_[2 * i], mats[i]->w.data(), mats[i]->w.size());
        if (!mats[i]->scale.empty())
          std::memcpy(b + s->off_[2 * i + 1], mats[i]->scale.data(), mats[i]->scale.size() * 4);
      }
    }
    s->layer_row_[static_cast<size_t>(l)] = static_cast<int>(s->arena_.size()) - 1;
    if (progress) progress(static_cast<int64_t>(s->arena_.size()) * E * s->blob_, pin_total);
  }
  if (s->arena_.empty())
    return absl::FailedPreconditionError("streamed experts: the model has no MoE layer");
  RETURN_IF_ERROR(s->Measure());
  return s;
}

absl::Status StreamedExperts::ComputeExpert(const DevExpert& ex, const uint16_t* x, int64_t n) {
  const int64_t H = c_.hidden_size, I = c_.moe.intermediate_size;
  const float one = 1.0f, zero = 0.0f;
  uint16_t* w_gu = w_gu_.as<uint16_t>();
  uint16_t* w_d = w_d_.as<uint16_t>();
  HMOE_CUDA_TRY(DequantToBf16(ex.gate, w_gu, compute_), "DequantToBf16");
  HMOE_CUDA_TRY(DequantToBf16(ex.up, w_gu + I * H, compute_), "DequantToBf16");
  HMOE_CUBLAS_TRY(
      cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(2 * I), static_cast<int>(n),
                   static_cast<int>(H), &one, w_gu, CUDA_R_16BF, static_cast<int>(H), x,
                   CUDA_R_16BF, static_cast<int>(H), &zero, y_gu_.as<float>(), CUDA_R_32F,
                   static_cast<int>(2 * I), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "GemmEx (streamed gate/up)");
  HMOE_CUDA_TRY(SiluMul(y_gu_.as<float>(), n, I, hb_.as<uint16_t>(), compute_), "SiluMul");
  HMOE_CUDA_TRY(DequantToBf16(ex.down, w_d, compute_), "DequantToBf16");
  HMOE_CUBLAS_TRY(
      cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(H), static_cast<int>(n),
                   static_cast<int>(I), &one, w_d, CUDA_R_16BF, static_cast<int>(I),
                   hb_.as<uint16_t>(), CUDA_R_16BF, static_cast<int>(I), &zero, z_.as<float>(),
                   CUDA_R_32F, static_cast<int>(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "GemmEx (streamed down)");
  return absl::OkStatus();
}

absl::Status StreamedExperts::Measure() {
  cudaEvent_t ev[2] = {nullptr, nullptr};
  absl::Status st = absl::OkStatus();
  for (cudaEvent_t& e : ev) {
    const cudaError_t ce = st.ok() ? cudaEventCreate(&e) : cudaSuccess;
    if (ce != cudaSuccess) st = CudaError(ce, "cudaEventCreate");
  }
  auto timed = [&](cudaStream_t strm, auto&& work) -> absl::StatusOr<double> {
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      HMOE_CUDA_TRY(cudaEventRecord(ev[0], strm), "cudaEventRecord");
      RETURN_IF_ERROR(work());
      HMOE_CUDA_TRY(cudaEventRecord(ev[1], strm), "cudaEventRecord");
      HMOE_CUDA_TRY(cudaEventSynchronize(ev[1]), "cudaEventSynchronize");
      float ms = 0;
      HMOE_CUDA_TRY(cudaEventElapsedTime(&ms, ev[0], ev[1]), "cudaEventElapsedTime");
      best = std::min(best, ms);
    }
    return static_cast<double>(best) * 1e-3;
  };
  const int64_t H = c_.hidden_size, I = c_.moe.intermediate_size, E = c_.moe.num_experts,
                K = c_.moe.experts_per_token;
  const int64_t bytes = std::min<int64_t>(int64_t{1} << 30, E * blob_);
  absl::StatusOr<double> up = absl::InternalError("not measured");
  absl::StatusOr<double> expert = absl::InternalError("not measured");
  // One expert's whole compute (dequantize, two GEMMs, the activation) at
  // the rows an expert gets in a full pass, on the arena's first expert.
  const int64_t n = std::clamp<int64_t>(max_tokens_ * K / E, 16, max_tokens_);
  if (st.ok()) {
    up = timed(copy_, [&]() -> absl::Status {
      HMOE_CUDA_TRY(cudaMemcpyAsync(stages_[0].buf.as<char>(), arena_[0].as<char>(),
                                    static_cast<size_t>(bytes), cudaMemcpyHostToDevice, copy_),
                    "upload");
      return absl::OkStatus();
    });
    HMOE_CUDA_TRY(cudaStreamSynchronize(copy_), "cudaStreamSynchronize");
    HMOE_CUDA_TRY(cudaMemsetAsync(xg_.as<void>(), 0, static_cast<size_t>(n * H * 2), compute_),
                  "cudaMemset");
    expert = timed(compute_, [&]() -> absl::Status {
      return ComputeExpert(ExpertAt(stages_[0].buf.as<char>()), xg_.as<uint16_t>(), n);
    });
  }
  for (cudaEvent_t e : ev)
    if (e != nullptr) cudaEventDestroy(e);
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(up.status());
  RETURN_IF_ERROR(expert.status());
  pcie_gbps_ = static_cast<double>(bytes) / *up / 1e9;
  // The cost model's GPU rate: this whole compute (dequantization included)
  // as FLOP/s of its GEMMs.
  gemm_tflops_ = 6.0 * static_cast<double>(n * H * I) / *expert / 1e12;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StreamedExperts::Run(int layer, const uint16_t* x, int64_t T, int64_t K,
                                             const int32_t* ids, const float* w,
                                             const std::vector<int32_t>& gpu_experts,
                                             int32_t* cpu_ids) {
  const int64_t H = c_.hidden_size, E = c_.moe.num_experts;
  if (layer < 0 || layer >= c_.num_layers || layer_row_[static_cast<size_t>(layer)] < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("streamed experts: layer ", layer, " is not an MoE layer"));
  if (T > max_tokens_ || K != c_.moe.experts_per_token)
    return absl::InvalidArgumentError(absl::StrCat("streamed experts: a pass of ", T, " x ", K,
                                                   " slots; made for ", max_tokens_, " x ",
                                                   c_.moe.experts_per_token));
  const int64_t slots = T * K;
  std::vector<uint8_t> on(static_cast<size_t>(E), 0);
  for (int32_t e : gpu_experts) {
    if (e < 0 || e >= E)
      return absl::InvalidArgumentError(absl::StrCat("streamed experts: expert ", e, " of ", E));
    on[static_cast<size_t>(e)] = 1;
  }
  // The previous Run's copies out of idx_host_ are done once its compute is.
  // So are the uploads it waited for, and all queued before them.
  HMOE_CUDA_TRY(cudaEventSynchronize(stages_[static_cast<size_t>(last_)].done),
                "cudaEventSynchronize");
  arrived_upto_ = std::max(arrived_upto_, last_waited_);
  // Slots grouped by expert (ascending), each group in slot order.
  std::vector<int64_t> begin(static_cast<size_t>(E) + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[s];
    const bool g = e >= 0 && e < E && on[static_cast<size_t>(e)];
    cpu_ids[s] = g ? kNoExpert : e;
    if (g) ++begin[static_cast<size_t>(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e)
    begin[static_cast<size_t>(e) + 1] += begin[static_cast<size_t>(e)];
  const int64_t n = begin[static_cast<size_t>(E)];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t ne = begin[static_cast<size_t>(e) + 1] - begin[static_cast<size_t>(e)];
    if (ne > max_tokens_)  // a token routed to one expert twice
      return absl::InvalidArgumentError(absl::StrCat("streamed experts: layer ", layer, " expert ",
                                                     e, " has ", ne, " slots; at most ",
                                                     max_tokens_, " fit"));
  }
  int32_t* rows = idx_host_.as<int32_t>();
  int32_t* slot_of = rows + slots;
  uint8_t* marks = reinterpret_cast<uint8_t*>(slot_of + slots);
  std::vector<int64_t> fill(begin.begin(), begin.end() - 1);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[s];
    const bool g = e >= 0 && e < E && on[static_cast<size_t>(e)];
    marks[s] = g ? 1 : 0;
    if (!g) continue;
    const int64_t i = fill[static_cast<size_t>(e)]++;
    rows[i] = static_cast<int32_t>(s / K);
    slot_of[i] = static_cast<int32_t>(s);
  }
  if (n == 0) return int64_t{0};
  cudaEvent_t span_a = nullptr;  // the compute span starts with the index uploads
  if (timeline_on_) {
    ASSIGN_OR_RETURN(span_a, SpanEvent());
    HMOE_CUDA_TRY(cudaEventRecord(span_a, compute_), "cudaEventRecord");
  }
  int32_t* rows_dev = idx_.as<int32_t>();
  int32_t* slot_dev = rows_dev + slots;
  uint8_t* marks_dev = reinterpret_cast<uint8_t*>(slot_dev + slots);
  HMOE_CUDA_TRY(
      cudaMemcpyAsync(rows_dev, rows, static_cast<size_t>(n * 4), cudaMemcpyHostToDevice, compute_),
      "streamed experts: gather rows upload");
  HMOE_CUDA_TRY(cudaMemcpyAsync(slot_dev, slot_of, static_cast<size_t>(n * 4),
                                cudaMemcpyHostToDevice, compute_),
                "streamed experts: slots upload");
  HMOE_CUDA_TRY(cudaMemcpyAsync(marks_dev, marks, static_cast<size_t>(slots),
                                cudaMemcpyHostToDevice, compute_),
                "streamed experts: marks upload");

  // The stage holding this layer's experts (a Prefetch's or an earlier
  // Run's), else the one the last Run did not use; upload what it lacks.
  size_t b = stages_.size() > 1 ? static_cast<size_t>(1 - last_) : 0;
  for (size_t i = 0; i < stages_.size(); ++i)
    if (stages_[i].layer == layer) b = i;
  Stage& st = stages_[b];
  RETURN_IF_ERROR(Upload(st, layer, gpu_experts, /*ahead=*/false).status());
  std::vector<int32_t> order;  // by arrival, then id
  for (int32_t e = 0; e < E; ++e)
    if (on[static_cast<size_t>(e)]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
    return st.arrival[static_cast<size_t>(a)] < st.arrival[static_cast<size_t>(c)];
  });

  // Compute: gather x per slot, then each expert once its chunk is in.
  uint16_t* xg = xg_.as<uint16_t>();
  HMOE_CUDA_TRY(GatherBf16Rows(x, H, rows_dev, n, xg, compute_), "GatherBf16Rows");
  const char* stage = st.buf.as<char>();
  int64_t waited = arrived_upto_;
  for (const int32_t e : order) {
    const int64_t b0 = begin[static_cast<size_t>(e)], ni = begin[static_cast<size_t>(e) + 1] - b0;
    if (ni == 0) continue;
    const int64_t seq = st.arrival[static_cast<size_t>(e)];
    if (seq > waited) {
      HMOE_CUDA_TRY(
          cudaStreamWaitEvent(compute_, chunk_ev_[static_cast<size_t>(seq) % chunk_ev_.size()], 0),
          "cudaStreamWaitEvent");
      waited = seq;
    }
    if (st.ahead[static_cast<size_t>(e)]) {
      st.ahead[static_cast<size_t>(e)] = 0;
      ++prefetch_used_;
    }
    RETURN_IF_ERROR(
        ComputeExpert(ExpertAt(stage + static_cast<int64_t>(e) * blob_), xg + b0 * H, ni));
    HMOE_CUDA_TRY(
        ScatterWeightedRows(z_.as<float>(), H, slot_dev + b0, ni, w, ys_.as<float>(), compute_),
        "ScatterWeightedRows");
  }
  HMOE_CUDA_TRY(SumMarkedSlots(ys_.as<float>(), marks_dev, T, K, H, out_.as<float>(), compute_),
                "SumMarkedSlots");
  HMOE_CUDA_TRY(cudaEventRecord(st.done, compute_), "cudaEventRecord");
  if (span_a != nullptr) {
    ASSIGN_OR_RETURN(cudaEvent_t span_b, SpanEvent());
    HMOE_CUDA_TRY(cudaEventRecord(span_b, compute_), "cudaEventRecord");
    spans_.push_back({layer, "compute", span_a, span_b});
  }
  last_ = static_cast<int>(b);
  last_waited_ = waited;
  return n;
}

absl::StatusOr<int64_t> StreamedExperts::Upload(Stage& st, int layer,
                                                const std::vector<int32_t>& experts, bool ahead) {
  const int64_t E = c_.moe.num_experts;
  std::vector<uint8_t> want(static_cast<size_t>(E), 0);
  for (int32_t e : experts) {
    if (e < 0 || e >= E)
      return absl::InvalidArgumentError(absl::StrCat("streamed experts: expert ", e, " of ", E));
    want[static_cast<size_t>(e)] = 1;
  }
  if (st.layer != layer) {  // another layer's: overwritten once its last compute is done
    st.layer = layer;
    std::fill(st.arrival.begin(), st.arrival.end(), -1);
    std::fill(st.ahead.begin(), st.ahead.end(), 0);
    HMOE_CUDA_TRY(cudaStreamWaitEvent(copy_, st.done, 0), "cudaStreamWaitEvent");
  }
  std::vector<int32_t> need;  // ascending
  for (int32_t e = 0; e < E; ++e)
    if (want[static_cast<size_t>(e)] && st.arrival[static_cast<size_t>(e)] < 0) need.push_back(e);
  const char* host = arena_[static_cast<size_t>(layer_row_[static_cast<size_t>(layer)])].as<char>();
  char* stage = st.buf.as<char>();
  cudaEvent_t span_a = nullptr;
  if (timeline_on_ && !need.empty()) {
    ASSIGN_OR_RETURN(span_a, SpanEvent());
    HMOE_CUDA_TRY(cudaEventRecord(span_a, copy_), "cudaEventRecord");
  }
  const size_t per_chunk = (need.size() + kChunks - 1) / kChunks;
  for (size_t c0 = 0; c0 < need.size(); c0 += per_chunk) {
    const size_t c1 = std::min(need.size(), c0 + per_chunk);
    for (size_t i = c0; i < c1;) {  // runs of consecutive ids in one copy
      size_t j = i + 1;
      while (j < c1 && need[j] == need[j - 1] + 1) ++j;
      const int64_t off = static_cast<int64_t>(need[i]) * blob_;
      HMOE_CUDA_TRY(cudaMemcpyAsync(stage + off, host + off, static_cast<size_t>((j - i) * blob_),
                                    cudaMemcpyHostToDevice, copy_),
                    "streamed experts: upload");
      i = j;
    }
    const int64_t seq = seq_++;
    HMOE_CUDA_TRY(cudaEventRecord(chunk_ev_[static_cast<size_t>(seq) % chunk_ev_.size()], copy_),
                  "cudaEventRecord");
    for (size_t i = c0; i < c1; ++i) {
      st.arrival[static_cast<size_t>(need[i])] = seq;
      st.ahead[static_cast<size_t>(need[i])] = ahead ? 1 : 0;
    }
  }
  if (span_a != nullptr) {
    ASSIGN_OR_RETURN(cudaEvent_t span_b, SpanEvent());
    HMOE_CUDA_TRY(cudaEventRecord(span_b, copy_), "cudaEventRecord");
    spans_.push_back({layer, ahead ? "prefetch" : "upload", span_a, span_b});
  }
  return static_cast<int64_t>(need.size());
}

absl::StatusOr<cudaEvent_t> StreamedExperts::SpanEvent() {
  if (!span_pool_.empty()) {
    cudaEvent_t e = span_pool_.back();
    span_pool_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  HMOE_CUDA_TRY(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}

std::string StreamedExperts::TakeTimeline() {
  std::string out;
  if (spans_.empty()) return out;
  cudaStreamSynchronize(copy_);
  cudaStreamSynchronize(compute_);
  // The earliest start: spans on two streams, recorded in host order.
  cudaEvent_t first = spans_[0].a;
  for (const Span& sp : spans_) {
    float d = 0;
    if (cudaEventElapsedTime(&d, first, sp.a) == cudaSuccess && d < 0) first = sp.a;
  }
  for (const Span& sp : spans_) {
    float a = 0, b = 0;
    if (cudaEventElapsedTime(&a, first, sp.a) != cudaSuccess ||
        cudaEventElapsedTime(&b, first, sp.b) != cudaSuccess) {
      absl::StrAppend(&out, "\n  layer ", sp.layer, " ", sp.what, ": not timed");
    } else {
      absl::StrAppend(&out, "\n  layer ", sp.layer, " ", sp.what, " ",
                      absl::StrFormat("%.1f-%.1f ms", a, b));
    }
    span_pool_.push_back(sp.a);
    span_pool_.push_back(sp.b);
  }
  spans_.clear();
  return out;
}

absl::StatusOr<int64_t> StreamedExperts::Prefetch(int layer, const std::vector<int32_t>& experts) {
  if (layer < 0 || layer >= c_.num_layers || layer_row_[static_cast<size_t>(layer)] < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("streamed experts: prefetch of layer ", layer, ", not an MoE layer"));
  if (stages_.size() < 2) return int64_t{0};
  size_t b = static_cast<size_t>(1 - last_);
  for (size_t i = 0; i < stages_.size(); ++i)
    if (stages_[i].layer == layer) b = i;
  ASSIGN_OR_RETURN(const int64_t n, Upload(stages_[b], layer, experts, /*ahead=*/true));
  prefetched_ += n;
  return n;
}

}  // namespace hmoe::cuda
