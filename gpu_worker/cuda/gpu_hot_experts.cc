#include "gpu_worker/cuda/gpu_hot_experts.h"

#include "common/status.h"
#include "gpu_worker/cuda/hot_expert_kernels.h"

namespace hmoe::cuda {
namespace {

absl::Status Upload(const void* host, int64_t bytes, DeviceBuffer* out, Budget* budget) {
  RETURN_IF_ERROR(budget->Take(bytes, "hot experts"));
  RETURN_IF_ERROR(out->Allocate(bytes));
  HMOE_CUDA_TRY(
      cudaMemcpy(out->as<void>(), host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
      "upload");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuHotExperts>> GpuHotExperts::Create(
    const ModelConfig& config, const ExpertSourceFn& source, const Placement& placement,
    WeightFormat format, int group, int64_t max_tokens, Budget* budget) {
  ASSIGN_OR_RETURN(std::vector<HotExpertWeights> hot,
                   LoadHotExperts(source, config, placement, format, group));
  std::unique_ptr<GpuHotExperts> g(new GpuHotExperts(config));
  g->max_tokens_ = max_tokens;
  const int64_t E = config.moe.num_experts, K = config.moe.experts_per_token,
                H = config.hidden_size;
  std::map<int, std::vector<DevExpert>> tables;
  auto put = [&](const HostQuantMatrix& m, DevQuantMatrix* d) -> absl::Status {
    d->format = m.format;
    d->group = m.group;
    d->rows = m.rows;
    d->cols = m.cols;
    DeviceBuffer& w = g->weights_.emplace_back();
    RETURN_IF_ERROR(Upload(m.w.data(), static_cast<int64_t>(m.w.size()), &w, budget));
    d->w = w.as<void>();
    if (!m.scale.empty()) {
      DeviceBuffer& sc = g->weights_.emplace_back();
      RETURN_IF_ERROR(
          Upload(m.scale.data(), static_cast<int64_t>(m.scale.size()) * 4, &sc, budget));
      d->scale = sc.as<float>();
    }
    return absl::OkStatus();
  };
  g->weights_.reserve(hot.size() * 6);  // DeviceBuffers move, but keep them put anyway
  for (const HotExpertWeights& h : hot) {
    auto& t = tables[h.layer];
    if (t.empty()) t.resize(static_cast<size_t>(E));
    DevExpert& d = t[static_cast<size_t>(h.expert)];
    RETURN_IF_ERROR(put(h.gate, &d.gate));
    RETURN_IF_ERROR(put(h.up, &d.up));
    RETURN_IF_ERROR(put(h.down, &d.down));
    g->bytes_ += h.bytes();
  }
  for (auto& [layer, t] : tables) {
    Layer& hl = g->layers_[layer];
    std::vector<uint8_t> mask(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e)
      mask[static_cast<size_t>(e)] = t[static_cast<size_t>(e)].gate.w != nullptr;
    RETURN_IF_ERROR(
        Upload(t.data(), static_cast<int64_t>(t.size() * sizeof(DevExpert)), &hl.table, budget));
    RETURN_IF_ERROR(Upload(mask.data(), E, &hl.mask, budget));
  }
  const int64_t n = max_tokens * K;
  const int64_t scratch = HotExpertsScratchBytes(max_tokens, H, config.moe.intermediate_size, K);
  RETURN_IF_ERROR(budget->Take(n * 8 + max_tokens * H * 4 + scratch, "hot experts"));
  RETURN_IF_ERROR(g->hot_ids_.Allocate(n * 4));
  RETURN_IF_ERROR(g->cold_ids_.Allocate(n * 4));
  RETURN_IF_ERROR(g->out_.Allocate(max_tokens * H * 4));
  RETURN_IF_ERROR(g->scratch_.Allocate(scratch));
  RETURN_IF_ERROR(g->hot_ids_pinned_.Allocate(static_cast<int64_t>(config.num_layers) * n * 4));
  return g;
}

absl::StatusOr<const int32_t*> GpuHotExperts::Split(int layer, const int32_t* ids, int64_t slots,
                                                    const int32_t** hot_host, StreamOps& ops) {
  const Layer& h = layers_.at(layer);
  int32_t* hot_ids = hot_ids_.as<int32_t>();
  RETURN_IF_ERROR(ops.Launched(SplitHotIds(ids, slots, h.mask.as<uint8_t>(), c_.moe.num_experts,
                                           cold_ids_.as<int32_t>(), hot_ids, ops.stream()),
                               "SplitHotIds"));
  int32_t* pinned = hot_ids_pinned_.as<int32_t>() +
                    static_cast<int64_t>(layer) * max_tokens_ * c_.moe.experts_per_token;
  RETURN_IF_ERROR(ops.Copy(pinned, hot_ids, slots * 4, cudaMemcpyDeviceToHost, "hot ids copy"));
  *hot_host = pinned;
  return cold_ids_.as<int32_t>();
}

absl::Status GpuHotExperts::Run(int layer, const uint16_t* x, int64_t T, const float* w, int64_t k,
                                StreamOps& ops) {
  HotExpertsArgs ha;
  ha.x = x;
  ha.T = T;
  ha.H = c_.hidden_size;
  ha.I = c_.moe.intermediate_size;
  ha.ids = hot_ids_.as<int32_t>();
  ha.weights = w;
  ha.K = k;
  ha.experts = layers_.at(layer).table.as<DevExpert>();
  ha.E = c_.moe.num_experts;
  ha.out = out_.as<float>();
  ha.scratch = scratch_.as<void>();
  ha.scratch_bytes = scratch_.bytes();
  return ops.Launched(HotExperts(ha, ops.stream()), "HotExperts");
}

}  // namespace hmoe::cuda
