#include "gpu_worker/hot_weights.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/checkpoint_source.h"
#include "common/status.h"

namespace hmoe {

KernelMatrixBytes KernelLayoutBytes(WeightFormat f, int group, int64_t rows, int64_t cols) {
  return {rows * RowBytes(f, cols), ScaleCount(f, group, rows, cols) *
                                        static_cast<int64_t>(HasScales(f) ? sizeof(float) : 0)};
}

HostQuantMatrix ToKernelLayout(const QuantMatrix& m) {
  HostQuantMatrix h;
  h.format = m.format;
  h.group = m.group;
  h.rows = m.rows;
  h.cols = m.cols;
  h.scale = m.scale;
  switch (m.format) {
    case WeightFormat::kBf16:
      h.w.resize(m.bf16.size() * 2);
      std::memcpy(h.w.data(), m.bf16.data(), h.w.size());
      break;
    case WeightFormat::kInt8:
      h.w.resize(m.q.size());
      std::memcpy(h.w.data(), m.q.data(), h.w.size());
      break;
    case WeightFormat::kInt4: {
      const int64_t half = (m.cols + 1) / 2;
      h.w.assign(static_cast<size_t>(m.rows * half), 0);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c) {
          const uint8_t v = static_cast<uint8_t>(m.q[static_cast<size_t>(r * m.cols + c)]) & 0xF;
          h.w[static_cast<size_t>(r * half + c / 2)] |= static_cast<uint8_t>(v << (4 * (c % 2)));
        }
      break;
    }
    case WeightFormat::kMxfp4:
    case WeightFormat::kInt4Bf16:
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8:
      // The codes as stored; bf16 / e8m0 scales widened to f32 (exact).
      h.w = m.packed;
      h.scale.resize(static_cast<size_t>(ScaleCount(m.format, m.group, m.rows, m.cols)));
      for (int64_t i = 0; i < static_cast<int64_t>(h.scale.size()); ++i) {
        const size_t j = static_cast<size_t>(i);
        h.scale[j] = Traits(m.format).scale_type == ScaleType::kBf16   ? Bf16ToF32(m.scale_bf16[j])
                     : Traits(m.format).scale_type == ScaleType::kE8M0 ? E8M0ToF32(m.scale_e8m0[j])
                                                                       : m.scale[j];
      }
      break;
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
  const KernelMatrixBytes gu = KernelLayoutBytes(format, group, I, H),
                          d = KernelLayoutBytes(format, group, H, I);
  return 2 * (gu.w + gu.scale) + d.w + d.scale;
}

absl::StatusOr<std::vector<HotExpertWeights>> LoadHotExperts(const Checkpoint& ckpt,
                                                             const ModelConfig& config,
                                                             const Placement& placement,
                                                             WeightFormat format, int group) {
  return LoadHotExperts([&](int layer) { return CheckpointSource(ckpt, config, layer); }, config,
                        placement, format, group);
}

absl::StatusOr<std::vector<HotExpertWeights>> LoadHotExperts(const ExpertSourceFn& source,
                                                             const ModelConfig& config,
                                                             const Placement& placement,
                                                             WeightFormat format, int group) {
  RETURN_IF_ERROR(CheckPlacementFits(placement, config));
  QuantOptions po;
  po.format = format;
  po.group = group;
  // The sources checked first (cheap), then the experts quantized in
  // parallel: each is independent, and one costs up to seconds (synthetic
  // weights, fp8 dequantization).
  struct Job {
    const MoeWeightsSource* src;
    int32_t layer, expert;
  };
  std::vector<MoeWeightsSource> sources;
  sources.reserve(placement.hot.size());
  std::vector<Job> jobs;
  for (const auto& [layer, ids] : placement.hot) {
    MoeWeightsSource& src = sources.emplace_back(source(layer));
    if (src.hidden != config.hidden_size || src.intermediate != config.moe.intermediate_size ||
        src.num_experts != config.moe.num_experts)
      return absl::FailedPreconditionError(absl::StrCat(
          "hot experts: layer ", layer, "'s expert source holds ", src.num_experts, " experts of ",
          src.hidden, " x ", src.intermediate, "; the model has ", config.moe.num_experts, " of ",
          config.hidden_size, " x ", config.moe.intermediate_size));
    for (int32_t e : ids) jobs.push_back({&src, layer, e});
  }
  std::vector<HotExpertWeights> out(jobs.size());
  std::vector<absl::Status> errors(jobs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
      absl::StatusOr<ExpertWeights> w = jobs[j].src->expert(jobs[j].expert);
      absl::StatusOr<QuantExpert> q =
          w.ok() ? QuantizeExpert(*w, *jobs[j].src, po) : absl::StatusOr<QuantExpert>(w.status());
      if (!q.ok()) {
        errors[j] = q.status();
        continue;
      }
      HotExpertWeights& h = out[j];
      h.layer = jobs[j].layer;
      h.expert = jobs[j].expert;
      h.gate = ToKernelLayout(q->gate);
      h.up = ToKernelLayout(q->up);
      h.down = ToKernelLayout(q->down);
    }
  };
  const size_t n = std::min<size_t>(jobs.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  for (const absl::Status& st : errors) RETURN_IF_ERROR(st);  // the first in placement order
  return out;
}

}  // namespace hmoe
