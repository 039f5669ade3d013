// The in-process reference RoutedExperts (see routed_experts.h).
#include "gpu_worker/cpu/reference_experts.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "gpu_worker/cpu/ops.h"

namespace hmoe {
namespace cpu {

absl::StatusOr<std::unique_ptr<ReferenceExperts>> ReferenceExperts::Create(
    const ModelConfig& config, const Checkpoint& ckpt, std::shared_ptr<ThreadPool> pool) {
  auto r = std::unique_ptr<ReferenceExperts>(new ReferenceExperts);
  r->config_ = config;
  r->pool_ = std::move(pool);
  const int64_t block =
      config.quantization.method == "fp8" ? config.quantization.weight_block[0] : 0;
  if (block > 0 && config.quantization.weight_block[1] != block)
    return absl::UnimplementedError(absl::StrCat(
        ckpt.dir(), ": fp8 weight blocks must be square, got ", config.quantization.weight_block[0],
        "x", config.quantization.weight_block[1]));
  r->layers_.resize(static_cast<size_t>(config.num_layers));
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layers[static_cast<size_t>(l)].moe) continue;
    auto& experts = r->layers_[static_cast<size_t>(l)];
    experts.resize(static_cast<size_t>(config.moe.num_experts));
    for (int e = 0; e < config.moe.num_experts; ++e) {
      Expert& x = experts[static_cast<size_t>(e)];
      ASSIGN_OR_RETURN(x.gate,
                       LoadMatrix(ckpt, ExpertWeightName(config, l, e, ExpertProj::kGate), block));
      ASSIGN_OR_RETURN(x.up,
                       LoadMatrix(ckpt, ExpertWeightName(config, l, e, ExpertProj::kUp), block));
      ASSIGN_OR_RETURN(x.down,
                       LoadMatrix(ckpt, ExpertWeightName(config, l, e, ExpertProj::kDown), block));
    }
  }
  return r;
}

absl::Status ReferenceExperts::Forward(const ExpertBatch& b, float* out) {
  RETURN_IF_ERROR(ValidateExpertBatch(config_, b));
  const int64_t T = b.num_tokens, H = b.hidden_size, K = b.top_k;
  const int64_t I = config_.moe.intermediate_size;
  const float limit = static_cast<float>(config_.v4.swiglu_limit);  // 0: no clamp
  std::fill(out, out + T * H, 0.0f);
  if (T == 0) return absl::OkStatus();
  // Group (token, slot) pairs by expert; visit experts in ascending id so each
  // token's sum has a fixed order whatever else is in the batch.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(config_.moe.num_experts));
  for (int64_t i = 0; i < T * K; ++i)
    if (b.expert_ids[i] != kNoExpert) slots[static_cast<size_t>(b.expert_ids[i])].push_back(i);
  const auto& experts = layers_[static_cast<size_t>(b.layer)];
  std::vector<float> x, g, u, d;
  for (size_t e = 0; e < slots.size(); ++e) {
    const auto& s = slots[e];
    if (s.empty()) continue;
    const int64_t n = static_cast<int64_t>(s.size());
    x.resize(static_cast<size_t>(n * H));
    g.resize(static_cast<size_t>(n * I));
    u.resize(static_cast<size_t>(n * I));
    d.resize(static_cast<size_t>(n * H));
    for (int64_t r = 0; r < n; ++r) std::copy_n(b.hidden + (s[r] / K) * H, H, x.data() + r * H);
    const Expert& ex = experts[e];
    Linear(pool_.get(), x.data(), n, ex.gate, nullptr, g.data());
    Linear(pool_.get(), x.data(), n, ex.up, nullptr, u.data());
    if (limit > 0) {  // DeepSeek-V4: gate <= limit, |up| <= limit before SiLU(gate) * up
      for (int64_t i = 0; i < n * I; ++i) {
        g[i] = std::min(g[i], limit);
        u[i] = std::clamp(u[i], -limit, limit);
      }
    }
    for (int64_t i = 0; i < n * I; ++i) g[i] = Silu(g[i]) * u[i];
    Linear(pool_.get(), g.data(), n, ex.down, nullptr, d.data());
    for (int64_t r = 0; r < n; ++r) {
      const float w = b.weights[s[r]];
      float* o = out + (s[r] / K) * H;
      const float* dr = d.data() + r * H;
      for (int64_t h = 0; h < H; ++h) o[h] += dr[h] * w;
    }
  }
  return absl::OkStatus();
}

}  // namespace cpu

absl::StatusOr<std::unique_ptr<RoutedExperts>> MakeReferenceRoutedExperts(const ModelConfig& config,
                                                                          const Checkpoint& ckpt,
                                                                          int num_threads) {
  if (num_threads <= 0)
    num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ASSIGN_OR_RETURN(std::shared_ptr<ThreadPool> pool,
                   ThreadPool::Create(UnpinnedThreads(num_threads)));
  ASSIGN_OR_RETURN(auto r, cpu::ReferenceExperts::Create(config, ckpt, std::move(pool)));
  return std::unique_ptr<RoutedExperts>(std::move(r));
}

}  // namespace hmoe
