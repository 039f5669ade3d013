#include "gpu_worker/hot_weights.h"

#include <cstring>

#include "common/status.h"
#include "expert_service/kernels/checkpoint_source.h"

namespace hmoe {

HostQuantMatrix ToKernelLayout(const QuantMatrix& m) {
  HostQuantMatrix h;
  h.group = m.group;
  h.rows = m.rows;
  h.cols = m.cols;
  h.scale = m.scale;
  switch (m.format) {
    case WeightFormat::kBf16:
      h.format = 0;
      h.w.resize(m.bf16.size() * 2);
      std::memcpy(h.w.data(), m.bf16.data(), h.w.size());
      break;
    case WeightFormat::kInt8:
      h.format = 1;
      h.w.resize(m.q.size());
      std::memcpy(h.w.data(), m.q.data(), h.w.size());
      break;
    case WeightFormat::kInt4: {
      h.format = 2;
      const int64_t half = (m.cols + 1) / 2;
      h.w.assign(static_cast<size_t>(m.rows * half), 0);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c) {
          const uint8_t v = static_cast<uint8_t>(m.q[static_cast<size_t>(r * m.cols + c)]) & 0xF;
          h.w[static_cast<size_t>(r * half + c / 2)] |= static_cast<uint8_t>(v << (4 * (c % 2)));
        }
      break;
    }
  }
  return h;
}

int64_t HotExpertWeights::bytes() const {
  int64_t b = 0;
  for (const HostQuantMatrix* m : {&gate, &up, &down})
    b += static_cast<int64_t>(m->w.size() + m->scale.size() * 4);
  return b;
}

int64_t HotExpertBytes(const ModelConfig& config, WeightFormat format, int group) {
  const int64_t H = config.hidden_size, I = config.moe.intermediate_size;
  // gate and up [I][H], down [H][I].
  auto matrix = [&](int64_t rows, int64_t cols) -> int64_t {
    switch (format) {
      case WeightFormat::kBf16:
        return rows * cols * 2;
      case WeightFormat::kInt8:
        return rows * cols + rows * 4;
      case WeightFormat::kInt4:
        return rows * ((cols + 1) / 2) + rows * ((cols + group - 1) / group) * 4;
    }
    return 0;
  };
  return 2 * matrix(I, H) + matrix(H, I);
}

absl::StatusOr<std::vector<HotExpertWeights>> LoadHotExperts(const Checkpoint& ckpt,
                                                             const ModelConfig& config,
                                                             const Placement& placement,
                                                             WeightFormat format, int group) {
  RETURN_IF_ERROR(CheckPlacementFits(placement, config));
  PackOptions po;
  po.format = format;
  po.group = group;
  std::vector<HotExpertWeights> out;
  for (const auto& [layer, ids] : placement.hot) {
    const MoeWeightsSource src = CheckpointSource(ckpt, config, layer);
    for (int32_t e : ids) {
      ASSIGN_OR_RETURN(ExpertWeights w, src.expert(e));
      ASSIGN_OR_RETURN(QuantExpert q, QuantizeExpert(w, src, po));
      HotExpertWeights h;
      h.layer = layer;
      h.expert = e;
      h.gate = ToKernelLayout(q.gate);
      h.up = ToKernelLayout(q.up);
      h.down = ToKernelLayout(q.down);
      out.push_back(std::move(h));
    }
  }
  return out;
}

}  // namespace hmoe
