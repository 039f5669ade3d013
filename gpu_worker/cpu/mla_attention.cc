// AttentionKind::kMla on the reference backend: DeepSeek's multi-head latent
// attention over a cache of normed latents and roped shared keys; and
// AttentionKind::kMlaDsa: the same over the keys a DsaIndexer selects.
#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cpu/attention.h"
#include "gpu_worker/cpu/dsa_indexer.h"

namespace hmoe::cpu {
namespace {

class MlaAttention final : public AttentionOp {
 public:
  // `indexer` null: every visible key (kMla).
  MlaAttention(const ModelConfig& c, const AttentionSpec& spec, std::unique_ptr<DsaIndexer> indexer)
      : c_(c), spec_(spec), indexer_(std::move(indexer)) {}

  absl::Status Load(const Checkpoint& ckpt, const LayerNames& n, const WeightLoad& block) override {
    if (c_.mla.q_lora_rank) {
      RETURN_IF_ERROR(LoadLin(ckpt, n.q_a, block, &q_a_));
      ASSIGN_OR_RETURN(q_a_norm_, LoadVector(ckpt, n.q_a_norm, *c_.mla.q_lora_rank));
      RETURN_IF_ERROR(LoadLin(ckpt, n.q_b, block, &q_b_));
    } else {
      RETURN_IF_ERROR(LoadLin(ckpt, n.q, block, &q_));
    }
    RETURN_IF_ERROR(LoadLin(ckpt, n.kv_a, block, &kv_a_));
    ASSIGN_OR_RETURN(kv_a_norm_, LoadVector(ckpt, n.kv_a_norm, c_.mla.kv_lora_rank));
    RETURN_IF_ERROR(LoadLin(ckpt, n.kv_b, PlainLoad(block), &kv_b_));
    if (!kv_b_.b.empty())
      return absl::UnimplementedError(absl::StrCat(ckpt.dir(), ": ", n.kv_b, ".bias"));
    if (indexer_) RETURN_IF_ERROR(indexer_->Load(ckpt, n, block.fp8_block));
    return LoadLin(ckpt, n.o, block, &o_);
  }

  void Forward(const AttentionPass& p, const float* h, float* out) const override;

 private:
  ModelConfig c_;
  AttentionSpec spec_;
  Lin q_, q_a_, q_b_, kv_a_, kv_b_, o_;
  std::vector<float> q_a_norm_, kv_a_norm_;
  std::unique_ptr<DsaIndexer> indexer_;
};

void MlaAttention::Forward(const AttentionPass& p, const float* h, float* out) const {
  const int64_t T = p.T;
  ThreadPool* pool = p.pool;
  const float* cs = p.rope_cs;
  const RopeLayout layout = spec_.geometry.rope_layout;
  const int64_t nh = c_.num_heads, nope = c_.mla.qk_nope_head_dim, rope = c_.mla.qk_rope_head_dim;
  const int64_t vd = c_.mla.v_head_dim, r = c_.mla.kv_lora_rank, qk = nope + rope;
  // Cache row: latent, then roped shared key (dk floats; MLA's), then
  // (kMlaDsa) the indexer's key.
  const int64_t row = spec_.cache.k_row, dk = spec_.dk;
  std::vector<float> q(static_cast<size_t>(T * nh * qk)), qa;
  if (c_.mla.q_lora_rank) {
    const int64_t qr = *c_.mla.q_lora_rank;
    qa.resize(static_cast<size_t>(T * qr));
    Linear(pool, h, T, q_a_.w, q_a_.bias(), qa.data());
    RmsNorm(qa.data(), T, qr, q_a_norm_.data(), kMlaNormEps, qa.data());
    Linear(pool, qa.data(), T, q_b_.w, q_b_.bias(), q.data());
  } else {
    Linear(pool, h, T, q_.w, q_.bias(), q.data());
  }
  std::vector<float> kva(static_cast<size_t>(T * dk));
  Linear(pool, h, T, kv_a_.w, kv_a_.bias(), kva.data());
  for (int64_t t = 0; t < T; ++t) {
    float* dst = p.k[t] + p.pos[t] * row;
    RmsNorm(kva.data() + t * dk, 1, r, kv_a_norm_.data(), kMlaNormEps, dst);
    std::copy_n(kva.data() + t * dk + r, rope, dst + r);
    ApplyRope(dst + r, rope, cs + t * rope, layout);
    KvRoundPart(p.kv, dst, r);  // parts: the latent, the roped key (not the indexer's key)
    KvRoundPart(p.kv, dst + r, rope);
  }
  // kMlaDsa: the positions each token attends over (its indexer's top-k).
  std::vector<std::vector<int64_t>> selected;
  if (indexer_) indexer_->Select(p, h, qa.data(), &selected);
  // Per (token, head): absorb kv_b's key part into the query, attend over the
  // latents, expand the latent output with kv_b's value part.
  std::vector<float> attn(static_cast<size_t>(T * nh * vd));
  const Matrix& wkv = kv_b_.w;  // [nh * (nope + vd), r]
  pool->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qfull(static_cast<size_t>(dk)), wrow(static_cast<size_t>(r)),
        olat(static_cast<size_t>(r)), scores(static_cast<size_t>(p.max_pos + 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / nh, hd = i % nh;
      const float* qh = q.data() + t * nh * qk + hd * qk;
      std::fill(qfull.begin(), qfull.begin() + r, 0.0f);
      for (int64_t j = 0; j < nope; ++j) {
        wkv.RowToF32(hd * (nope + vd) + j, wrow.data());
        const float qj = qh[j];
        for (int64_t c = 0; c < r; ++c) qfull[c] += qj * wrow[c];
      }
      std::copy_n(qh + nope, rope, qfull.data() + r);
      ApplyRope(qfull.data() + r, rope, cs + t * rope, layout);
      const float* cache = p.k[t];
      if (indexer_ && !selected[static_cast<size_t>(t)].empty()) {
        AttendRows(qfull.data(), dk, cache, row, cache, r, row,
                   selected[static_cast<size_t>(t)].data(),
                   static_cast<int64_t>(selected[static_cast<size_t>(t)].size()),
                   spec_.geometry.softmax_scale, scores.data(), olat.data());
      } else {
        AttendOne(qfull.data(), dk, cache, row, cache, r, row, p.pos[t], spec_.window,
                  spec_.geometry.softmax_scale, scores.data(), olat.data());
      }
      float* o = attn.data() + t * nh * vd + hd * vd;
      for (int64_t d = 0; d < vd; ++d) {
        wkv.RowToF32(hd * (nope + vd) + nope + d, wrow.data());
        float acc = 0.0f;
        for (int64_t c = 0; c < r; ++c) acc += wrow[c] * olat[c];
        o[d] = acc;
      }
    }
  });
  Linear(pool, attn.data(), T, o_.w, o_.bias(), out);
}

}  // namespace

std::unique_ptr<AttentionOp> MakeMlaAttention(const ModelConfig& config,
                                              const AttentionSpec& spec) {
  return std::make_unique<MlaAttention>(config, spec, nullptr);
}

std::unique_ptr<AttentionOp> MakeMlaDsaAttention(const ModelConfig& config,
                                                 const AttentionSpec& spec) {
  return std::make_unique<MlaAttention>(
      config, spec, std::make_unique<DsaIndexer>(config, spec.dk, spec.cache.k_row));
}

}  // namespace hmoe::cpu
