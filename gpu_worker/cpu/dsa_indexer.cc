#include "gpu_worker/cpu/dsa_indexer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/status.h"

namespace hmoe::cpu {
namespace {

// transformers' nn.LayerNorm(head_dim, eps=1e-6) of the indexer key.
constexpr float kIndexerNormEps = 1e-6f;

void LayerNorm(const float* x, int64_t n, const float* w, const float* b, float* y) {
  float mean = 0.0f;
  for (int64_t i = 0; i < n; ++i) mean += x[i];
  mean /= static_cast<float>(n);
  float var = 0.0f;
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(var + kIndexerNormEps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

}  // namespace

DsaIndexer::DsaIndexer(const ModelConfig& config, int64_t key_offset, int64_t row)
    : c_(config), key_offset_(key_offset), row_(row) {}

absl::Status DsaIndexer::Load(const Checkpoint& ckpt, const LayerNames& n, int64_t fp8_block) {
  const WeightLoad block{fp8_block};
  RETURN_IF_ERROR(LoadLin(ckpt, n.idx_q, block, &wq_));
  RETURN_IF_ERROR(LoadLin(ckpt, n.idx_k, block, &wk_));
  RETURN_IF_ERROR(LoadLin(ckpt, n.idx_weights, block, &weights_));
  ASSIGN_OR_RETURN(norm_w_, LoadVector(ckpt, n.idx_k_norm + ".weight", c_.dsa.head_dim));
  ASSIGN_OR_RETURN(norm_b_, LoadVector(ckpt, n.idx_k_norm + ".bias", c_.dsa.head_dim));
  return absl::OkStatus();
}

void DsaIndexer::Select(const AttentionPass& p, const float* h, const float* q_lora,
                        std::vector<std::vector<int64_t>>* selected) const {
  const int64_t T = p.T, D = c_.dsa.head_dim, nh = c_.dsa.n_heads, topk = c_.dsa.topk;
  const int64_t rope = c_.mla.qk_rope_head_dim;
  const RopeLayout layout = c_.dsa.rope_interleave ? RopeLayout::kInterleaved : RopeLayout::kHalves;
  std::vector<float> k(static_cast<size_t>(T * D));
  Linear(p.pool, h, T, wk_.w, wk_.bias(), k.data());
  for (int64_t t = 0; t < T; ++t) {
    float* dst = p.k[t] + p.pos[t] * row_ + key_offset_;
    LayerNorm(k.data() + t * D, D, norm_w_.data(), norm_b_.data(), dst);
    ApplyRope(dst, rope, p.rope_cs + t * rope, layout);
  }
  std::vector<float> q(static_cast<size_t>(T * nh * D)), w(static_cast<size_t>(T * nh));
  Linear(p.pool, q_lora, T, wq_.w, wq_.bias(), q.data());
  Linear(p.pool, h, T, weights_.w, weights_.bias(), w.data());
  const float head_scale = 1.0f / std::sqrt(static_cast<float>(nh));
  const float dot_scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hd = 0; hd < nh; ++hd)
      ApplyRope(q.data() + (t * nh + hd) * D, rope, p.rope_cs + t * rope, layout);
    for (int64_t hd = 0; hd < nh; ++hd) w[t * nh + hd] *= head_scale;
  }
  selected->assign(static_cast<size_t>(T), {});
  p.pool->ParallelFor(T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score;
    for (int64_t t = t0; t < t1; ++t) {
      std::vector<int64_t>& sel = (*selected)[static_cast<size_t>(t)];
      const int64_t n = p.pos[t] + 1;
      if (n <= topk) continue;  // every visible key (left empty)
      sel.resize(static_cast<size_t>(n));
      std::iota(sel.begin(), sel.end(), 0);
      score.assign(static_cast<size_t>(n), 0.0f);
      const float* qt = q.data() + t * nh * D;
      const float* wt = w.data() + t * nh;
      for (int64_t s = 0; s < n; ++s) {
        const float* ks = p.k[t] + s * row_ + key_offset_;
        float acc = 0.0f;
        for (int64_t hd = 0; hd < nh; ++hd) {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qt[hd * D + d] * ks[d];
          acc += wt[hd] * std::max(dot * dot_scale, 0.0f);
        }
        score[static_cast<size_t>(s)] = acc;
      }
      std::nth_element(sel.begin(), sel.begin() + topk, sel.end(), [&](int64_t a, int64_t b) {
        const float sa = score[static_cast<size_t>(a)], sb = score[static_cast<size_t>(b)];
        return sa > sb || (sa == sb && a < b);
      });
      sel.resize(static_cast<size_t>(topk));
      std::sort(sel.begin(), sel.end());
    }
  });
}

}  // namespace hmoe::cpu
