#include "gpu_worker/cuda/streamed_experts.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/transport/moe_call.h"

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
  for (cudaEvent_t e : chunk_ev_) cudaEventDestroy(e);
  if (done_ev_ != nullptr) cudaEventDestroy(done_ev_);
  if (budget_ != nullptr) budget_->Give(device_bytes_, "streamed experts");
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
    m.scale = format_ == 0 ? nullptr : reinterpret_cast<const float*>(base + off_[2 * i + 1]);
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
    int64_t max_tokens, cudaStream_t compute, cublasHandle_t blas, Budget* budget) {
  if (max_tokens <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("streamed experts: max_tokens ", max_tokens, " must be > 0"));
  std::unique_ptr<StreamedExperts> s(new StreamedExperts());
  s->c_ = config;
  s->format_ = KernelFormatCode(format);
  s->group_ = format == WeightFormat::kInt4 ? group : 0;
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
  RETURN_IF_ERROR(s->stage_.Allocate(E * s->blob_));
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
  s->chunk_ev_.resize(kChunks, nullptr);
  for (cudaEvent_t& e : s->chunk_ev_)
    HMOE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  HMOE_CUDA_TRY(cudaEventCreateWithFlags(&s->done_ev_, cudaEventDisableTiming), "cudaEventCreate");
  HMOE_CUDA_TRY(cudaEventRecord(s->done_ev_, compute), "cudaEventRecord");

  // The arena: per MoE layer, E blobs quantized as the service's.
  s->layer_row_.assign(static_cast<size_t>(config.num_layers), -1);
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
      HMOE_CUDA_TRY(cudaMemcpyAsync(stage_.as<char>(), arena_[0].as<char>(),
                                    static_cast<size_t>(bytes), cudaMemcpyHostToDevice, copy_),
                    "upload");
      return absl::OkStatus();
    });
    HMOE_CUDA_TRY(cudaStreamSynchronize(copy_), "cudaStreamSynchronize");
    HMOE_CUDA_TRY(cudaMemsetAsync(xg_.as<void>(), 0, static_cast<size_t>(n * H * 2), compute_),
                  "cudaMemset");
    expert = timed(compute_, [&]() -> absl::Status {
      return ComputeExpert(ExpertAt(stage_.as<char>()), xg_.as<uint16_t>(), n);
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
  HMOE_CUDA_TRY(cudaEventSynchronize(done_ev_), "cudaEventSynchronize");
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

  // Uploads: once the stage is free, in chunks of consecutive experts; runs
  // of consecutive ids go in one copy.
  HMOE_CUDA_TRY(cudaStreamWaitEvent(copy_, done_ev_, 0), "cudaStreamWaitEvent");
  const char* host = arena_[static_cast<size_t>(layer_row_[static_cast<size_t>(layer)])].as<char>();
  char* stage = stage_.as<char>();
  const size_t ne = gpu_experts.size();
  const size_t per_chunk = (ne + kChunks - 1) / kChunks;
  std::vector<size_t> chunk_end;
  for (size_t c0 = 0; c0 < ne; c0 += per_chunk) {
    const size_t c1 = std::min(ne, c0 + per_chunk);
    for (size_t i = c0; i < c1;) {
      size_t j = i + 1;
      while (j < c1 && gpu_experts[j] == gpu_experts[j - 1] + 1) ++j;
      const int64_t off = static_cast<int64_t>(gpu_experts[i]) * blob_;
      HMOE_CUDA_TRY(cudaMemcpyAsync(stage + off, host + off, static_cast<size_t>((j - i) * blob_),
                                    cudaMemcpyHostToDevice, copy_),
                    "streamed experts: upload");
      i = j;
    }
    HMOE_CUDA_TRY(cudaEventRecord(chunk_ev_[chunk_end.size()], copy_), "cudaEventRecord");
    chunk_end.push_back(c1);
  }

  // Compute: gather x per slot, then each expert as its chunk arrives.
  uint16_t* xg = xg_.as<uint16_t>();
  HMOE_CUDA_TRY(GatherBf16Rows(x, H, rows_dev, n, xg, compute_), "GatherBf16Rows");
  size_t i = 0;
  for (size_t c = 0; c < chunk_end.size(); ++c) {
    HMOE_CUDA_TRY(cudaStreamWaitEvent(compute_, chunk_ev_[c], 0), "cudaStreamWaitEvent");
    for (; i < chunk_end[c]; ++i) {
      const int32_t e = gpu_experts[i];
      const int64_t b0 = begin[static_cast<size_t>(e)], ni = begin[static_cast<size_t>(e) + 1] - b0;
      if (ni == 0) continue;
      RETURN_IF_ERROR(
          ComputeExpert(ExpertAt(stage + static_cast<int64_t>(e) * blob_), xg + b0 * H, ni));
      HMOE_CUDA_TRY(
          ScatterWeightedRows(z_.as<float>(), H, slot_dev + b0, ni, w, ys_.as<float>(), compute_),
          "ScatterWeightedRows");
    }
  }
  HMOE_CUDA_TRY(SumMarkedSlots(ys_.as<float>(), marks_dev, T, K, H, out_.as<float>(), compute_),
                "SumMarkedSlots");
  HMOE_CUDA_TRY(cudaEventRecord(done_ev_, compute_), "cudaEventRecord");
  return n;
}

}  // namespace hmoe::cuda
