// AttentionKind::kGqa on the reference backend: grouped-query attention
// over cached keys and values per kv head; q/k RMSNorm per head when the spec
// says (qwen3_moe, glm4_moe), RoPE over the spec's rope_dim leading dims of
// each head (all, or a part: glm4_moe's partial rotary).
#include <algorithm>
#include <vector>

#include "common/status.h"
#include "gpu_worker/cpu/attention.h"

namespace hmoe::cpu {
namespace {

class GqaAttention final : public AttentionOp {
 public:
  GqaAttention(const ModelConfig& c, const AttentionSpec& spec) : c_(c), spec_(spec) {}

  absl::Status Load(const Checkpoint& ckpt, const LayerNames& n, const WeightLoad& block) override {
    RETURN_IF_ERROR(LoadLin(ckpt, n.q, block, &q_));
    RETURN_IF_ERROR(LoadLin(ckpt, n.k, block, &k_));
    RETURN_IF_ERROR(LoadLin(ckpt, n.v, block, &v_));
    if (spec_.qk_norm) {
      ASSIGN_OR_RETURN(q_norm_, LoadVector(ckpt, n.q_norm, c_.head_dim));
      ASSIGN_OR_RETURN(k_norm_, LoadVector(ckpt, n.k_norm, c_.head_dim));
    }
    return LoadLin(ckpt, n.o, block, &o_);
  }

  void Forward(const AttentionPass& p, const float* h, float* out) const override;

 private:
  ModelConfig c_;
  AttentionSpec spec_;
  Lin q_, k_, v_, o_;
  std::vector<float> q_norm_, k_norm_;  // spec_.qk_norm
};

void GqaAttention::Forward(const AttentionPass& p, const float* h, float* out) const {
  const int64_t T = p.T;
  ThreadPool* pool = p.pool;
  const float* cs = p.rope_cs;
  const RopeLayout layout = spec_.geometry.rope_layout;
  const int64_t nh = spec_.num_heads, nkv = spec_.num_kv_heads, hd = spec_.dk;
  const int64_t rd = spec_.geometry.rope_dim;
  const int64_t row = spec_.cache.k_row, group = nh / nkv;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  std::vector<float> q(static_cast<size_t>(T * nh * hd)), k(static_cast<size_t>(T * row)),
      v(static_cast<size_t>(T * row));
  Linear(pool, h, T, q_.w, q_.bias(), q.data());
  Linear(pool, h, T, k_.w, k_.bias(), k.data());
  Linear(pool, h, T, v_.w, v_.bias(), v.data());
  if (!q_norm_.empty()) {
    RmsNorm(q.data(), T * nh, hd, q_norm_.data(), eps, q.data());
    RmsNorm(k.data(), T * nkv, hd, k_norm_.data(), eps, k.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < nh; ++i)
      ApplyRope(q.data() + (t * nh + i) * hd, rd, cs + t * rd, layout);
    for (int64_t i = 0; i < nkv; ++i)
      ApplyRope(k.data() + (t * nkv + i) * hd, rd, cs + t * rd, layout);
  }
  for (int64_t t = 0; t < T; ++t) {
    float* kd = p.k[t] + p.pos[t] * row;
    float* vd = p.v[t] + p.pos[t] * row;
    std::copy_n(k.data() + t * row, row, kd);
    std::copy_n(v.data() + t * row, row, vd);
    for (int64_t g = 0; g < nkv; ++g) {  // parts: each kv head's key and value
      KvRoundPart(p.kv, kd + g * spec_.k_head_offset, hd);
      KvRoundPart(p.kv, vd + g * spec_.v_head_offset, hd);
    }
  }
  std::vector<float> attn(static_cast<size_t>(T * nh * hd));
  pool->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(p.max_pos + 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / nh, head = i % nh, kvh = head / group;
      AttendOne(q.data() + i * hd, hd, p.k[t] + kvh * spec_.k_head_offset, row,
                p.v[t] + kvh * spec_.v_head_offset, hd, row, p.pos[t], spec_.window,
                spec_.geometry.softmax_scale, scores.data(), attn.data() + i * hd);
    }
  });
  Linear(pool, attn.data(), T, o_.w, o_.bias(), out);
}

}  // namespace

std::unique_ptr<AttentionOp> MakeGqaAttention(const ModelConfig& config,
                                              const AttentionSpec& spec) {
  return std::make_unique<GqaAttention>(config, spec);
}

}  // namespace hmoe::cpu
