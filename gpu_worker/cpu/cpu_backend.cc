#include "gpu_worker/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/driver/model_driver.h"
#include "gpu_worker/driver/weight_names.h"

namespace hmoe::cpu {
namespace {

struct Lin {
  Matrix w;
  std::vector<float> b;  // empty: no bias
  const float* bias() const { return b.empty() ? nullptr : b.data(); }
};

struct Mlp {
  Lin gate, up, down;
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  int64_t window = 0;
  // MLA
  Lin q, q_a, q_b, kv_a, kv_b, o;
  std::vector<float> q_a_norm, kv_a_norm;
  // GQA (q and o shared with MLA's names)
  Lin k, v;
  std::vector<float> q_norm, k_norm;  // Qwen3
  // feed-forward
  bool moe = false;
  Mlp dense;
  Lin router;
  std::vector<float> router_bias;  // e_score_correction_bias (selection only)
  bool has_shared = false;
  Mlp shared;
};

// Per layer, f32 rows: MLA the normed latent then the roped shared key; GQA
// the keys and the values. Storage grows on demand up to the capacity and is
// kept on Shrink.
class CpuKvCache final : public KvCache {
 public:
  CpuKvCache(int64_t capacity, int64_t k_row, int64_t v_row, int64_t layers)
      : capacity_(capacity),
        k_row_(k_row),
        v_row_(v_row),
        k_(static_cast<size_t>(layers)),
        v_(static_cast<size_t>(layers)) {}
  absl::Status Reserve(int64_t n) override {
    if (n <= rows_) return absl::OkStatus();
    const int64_t rows = std::min(capacity_, std::max(n, std::max<int64_t>(16, 2 * rows_)));
    for (auto& k : k_) k.resize(static_cast<size_t>(rows * k_row_));
    for (auto& v : v_) v.resize(static_cast<size_t>(rows * v_row_));
    rows_ = rows;
    return absl::OkStatus();
  }
  void Shrink(int64_t) override {}
  float* k(int layer) { return k_[static_cast<size_t>(layer)].data(); }
  float* v(int layer) { return v_[static_cast<size_t>(layer)].data(); }

 private:
  int64_t capacity_;
  int64_t k_row_, v_row_;  // floats per position per layer
  int64_t rows_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

class CpuBackend final : public LayerBackend {
 public:
  CpuBackend(const ModelConfig& config, std::shared_ptr<ThreadPool> pool)
      : c_(config), pool_(std::move(pool)), geo_(AttentionGeometryFor(config)) {}
  absl::Status LoadWeights(const Checkpoint& ckpt);

  const char* name() const override { return "cpu"; }
  std::unique_ptr<KvCache> NewKvCache(int64_t capacity) override {
    const int64_t k_row =
        c_.is_mla() ? c_.mla.kv_lora_rank + c_.mla.qk_rope_head_dim : c_.num_kv_heads * c_.head_dim;
    const int64_t v_row = c_.is_mla() ? 0 : k_row;
    return std::make_unique<CpuKvCache>(capacity, k_row, v_row, c_.num_layers);
  }

  absl::Status Begin(const PassTokens& tokens) override {
    pass_ = &tokens;
    const int64_t T = tokens.size(), H = c_.hidden_size;
    x_.resize(static_cast<size_t>(T * H));
    h_.resize(x_.size());
    y_.resize(x_.size());
    for (int64_t t = 0; t < T; ++t) embed_.RowToF32(tokens.ids[t], x_.data() + t * H);
    return absl::OkStatus();
  }
  absl::Status Attention(int l) override {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const int64_t T = pass_->size(), H = c_.hidden_size;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    RmsNorm(x_.data(), T, H, L.in_norm.data(), eps, h_.data());
    if (c_.is_mla())
      MlaAttention(l, h_.data(), pass_->rope_cs.data(), y_.data());
    else
      GqaAttention(l, h_.data(), pass_->rope_cs.data(), y_.data());
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += y_[i];
    RmsNorm(x_.data(), T, H, L.post_norm.data(), eps, h_.data());
    return absl::OkStatus();
  }
  absl::Status DenseMlp(int l) override {
    RunMlp(layers_[static_cast<size_t>(l)].dense, h_.data(), pass_->size(), y_.data());
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += y_[i];
    return absl::OkStatus();
  }
  absl::Status Route(int l, const GateSpec& gate, RoutedInput* out) override {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const int64_t T = pass_->size(), E = gate.num_experts, K = gate.top_k;
    logits_.resize(static_cast<size_t>(T * E));
    ids_.resize(static_cast<size_t>(T * K));
    weights_.resize(static_cast<size_t>(T * K));
    Linear(pool_.get(), h_.data(), T, L.router.w, nullptr, logits_.data());
    hmoe::Route(gate, logits_.data(), T, L.router_bias.empty() ? nullptr : L.router_bias.data(),
                ids_.data(), weights_.data());
    *out = RoutedInput{h_.data(), ids_.data(), weights_.data()};
    return absl::OkStatus();
  }
  absl::Status StartSharedExperts(int l) override {
    const Layer& L = layers_[static_cast<size_t>(l)];
    if (L.has_shared) RunMlp(L.shared, h_.data(), pass_->size(), y_.data());
    return absl::OkStatus();
  }
  absl::Status AddExperts(int l, const float* routed) override {
    // The routed sum, then the shared experts' output, join the residual.
    const bool shared = layers_[static_cast<size_t>(l)].has_shared;
    for (size_t i = 0; i < x_.size(); ++i) {
      float v = routed != nullptr ? routed[i] : 0.0f;
      if (shared) v += y_[i];
      x_[i] += v;
    }
    return absl::OkStatus();
  }
  absl::Status AddToResidual(const float* v) override {
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += v[i];
    return absl::OkStatus();
  }
  absl::Status Logits(float* out) override {
    const int64_t H = c_.hidden_size, rows = static_cast<int64_t>(pass_->logit_rows.size());
    const float eps = static_cast<float>(c_.rms_norm_eps);
    for (int64_t i = 0; i < rows; ++i)
      RmsNorm(x_.data() + pass_->logit_rows[static_cast<size_t>(i)] * H, 1, H, final_norm_.data(),
              eps, h_.data() + i * H);
    Linear(pool_.get(), h_.data(), rows, lm_head_, nullptr, out);
    return absl::OkStatus();
  }
  absl::Status Commit() override {
    pass_ = nullptr;
    return absl::OkStatus();
  }
  void Abort() override { pass_ = nullptr; }

 private:
  CpuKvCache* Kv(int64_t t) const {
    return static_cast<CpuKvCache*>(pass_->kv[static_cast<size_t>(t)]);
  }
  void MlaAttention(int l, const float* h, const float* cs, float* out) const;
  void GqaAttention(int l, const float* h, const float* cs, float* out) const;
  void RunMlp(const Mlp& m, const float* h, int64_t T, float* out) const;

  ModelConfig c_;
  std::shared_ptr<ThreadPool> pool_;
  AttentionGeometry geo_;
  Matrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  // The pass in progress.
  const PassTokens* pass_ = nullptr;
  std::vector<float> x_, h_, y_, logits_, weights_;
  std::vector<int32_t> ids_;
};

absl::Status CpuBackend::LoadWeights(const Checkpoint& ckpt) {
  const ModelConfig& c = c_;
  const int64_t H = c.hidden_size;
  const int64_t block = c.quantization.method == "fp8" ? c.quantization.weight_block[0] : 0;
  // A linear layer: its weight, and its bias when the checkpoint has one.
  auto lin = [&](const std::string& prefix, Lin* out) -> absl::Status {
    ASSIGN_OR_RETURN(out->w, LoadMatrix(ckpt, prefix + ".weight", block));
    ASSIGN_OR_RETURN(out->b, LoadOptionalVector(ckpt, prefix + ".bias", out->w.rows));
    return absl::OkStatus();
  };
  auto vec = [&](const std::string& name, int64_t n, std::vector<float>* out) -> absl::Status {
    ASSIGN_OR_RETURN(*out, LoadVector(ckpt, name, n));
    return absl::OkStatus();
  };
  auto mlp = [&](const MlpNames& n, Mlp* out) -> absl::Status {
    RETURN_IF_ERROR(lin(n.gate, &out->gate));
    RETURN_IF_ERROR(lin(n.up, &out->up));
    return lin(n.down, &out->down);
  };
  const ModelNames names;
  ASSIGN_OR_RETURN(embed_, LoadMatrix(ckpt, names.embed, block));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    ASSIGN_OR_RETURN(lm_head_, LoadMatrix(ckpt, names.lm_head, block));
  }
  RETURN_IF_ERROR(vec(names.final_norm, H, &final_norm_));
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int i = 0; i < c.num_layers; ++i) {
    Layer& L = layers_[static_cast<size_t>(i)];
    const LayerNames n = NamesForLayer(c, i);
    L.window = c.layers[static_cast<size_t>(i)].sliding_window;
    L.moe = c.layers[static_cast<size_t>(i)].moe;
    RETURN_IF_ERROR(vec(n.input_norm, H, &L.in_norm));
    RETURN_IF_ERROR(vec(n.post_norm, H, &L.post_norm));
    if (c.is_mla()) {
      if (c.mla.q_lora_rank) {
        RETURN_IF_ERROR(lin(n.q_a, &L.q_a));
        RETURN_IF_ERROR(vec(n.q_a_norm, *c.mla.q_lora_rank, &L.q_a_norm));
        RETURN_IF_ERROR(lin(n.q_b, &L.q_b));
      } else {
        RETURN_IF_ERROR(lin(n.q, &L.q));
      }
      RETURN_IF_ERROR(lin(n.kv_a, &L.kv_a));
      RETURN_IF_ERROR(vec(n.kv_a_norm, c.mla.kv_lora_rank, &L.kv_a_norm));
      RETURN_IF_ERROR(lin(n.kv_b, &L.kv_b));
      if (!L.kv_b.b.empty())
        return absl::UnimplementedError(absl::StrCat(ckpt.dir(), ": ", n.kv_b, ".bias"));
    } else {
      RETURN_IF_ERROR(lin(n.q, &L.q));
      RETURN_IF_ERROR(lin(n.k, &L.k));
      RETURN_IF_ERROR(lin(n.v, &L.v));
      if (c.arch == Architecture::kQwen3Moe) {
        RETURN_IF_ERROR(vec(n.q_norm, c.head_dim, &L.q_norm));
        RETURN_IF_ERROR(vec(n.k_norm, c.head_dim, &L.k_norm));
      }
    }
    RETURN_IF_ERROR(lin(n.o, &L.o));
    if (!L.moe) {
      RETURN_IF_ERROR(mlp(n.dense, &L.dense));
      continue;
    }
    ASSIGN_OR_RETURN(L.router.w, LoadMatrix(ckpt, n.router, block));
    if (c.moe.score_correction_bias)
      RETURN_IF_ERROR(vec(n.router_bias, c.moe.num_experts, &L.router_bias));
    if (c.moe.num_shared_experts > 0) {
      L.has_shared = true;
      RETURN_IF_ERROR(mlp(n.shared, &L.shared));
    }
  }
  return absl::OkStatus();
}

void CpuBackend::RunMlp(const Mlp& m, const float* h, int64_t T, float* out) const {
  const int64_t I = m.gate.w.rows;
  std::vector<float> g(static_cast<size_t>(T * I)), u(static_cast<size_t>(T * I));
  Linear(pool_.get(), h, T, m.gate.w, m.gate.bias(), g.data());
  Linear(pool_.get(), h, T, m.up.w, m.up.bias(), u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
  Linear(pool_.get(), g.data(), T, m.down.w, m.down.bias(), out);
}

void CpuBackend::MlaAttention(int l, const float* h, const float* cs, float* out) const {
  const int64_t T = pass_->size();
  const Layer& L = layers_[static_cast<size_t>(l)];
  const int64_t nh = c_.num_heads, nope = c_.mla.qk_nope_head_dim, rope = c_.mla.qk_rope_head_dim;
  const int64_t vd = c_.mla.v_head_dim, r = c_.mla.kv_lora_rank, qk = nope + rope;
  const int64_t row = r + rope;  // cache row: latent, then roped shared key
  std::vector<float> q(static_cast<size_t>(T * nh * qk));
  if (c_.mla.q_lora_rank) {
    const int64_t qr = *c_.mla.q_lora_rank;
    std::vector<float> qa(static_cast<size_t>(T * qr));
    Linear(pool_.get(), h, T, L.q_a.w, L.q_a.bias(), qa.data());
    RmsNorm(qa.data(), T, qr, L.q_a_norm.data(), kMlaNormEps, qa.data());
    Linear(pool_.get(), qa.data(), T, L.q_b.w, L.q_b.bias(), q.data());
  } else {
    Linear(pool_.get(), h, T, L.q.w, L.q.bias(), q.data());
  }
  std::vector<float> kva(static_cast<size_t>(T * row));
  Linear(pool_.get(), h, T, L.kv_a.w, L.kv_a.bias(), kva.data());
  for (int64_t t = 0; t < T; ++t) {
    float* dst = Kv(t)->k(l) + pass_->pos[t] * row;
    RmsNorm(kva.data() + t * row, 1, r, L.kv_a_norm.data(), kMlaNormEps, dst);
    std::copy_n(kva.data() + t * row + r, rope, dst + r);
    ApplyRope(dst + r, rope, cs + t * rope, geo_.rope_layout);
  }
  // Per (token, head): absorb kv_b's key part into the query, attend over the
  // latents, expand the latent output with kv_b's value part.
  std::vector<float> attn(static_cast<size_t>(T * nh * vd));
  const Matrix& wkv = L.kv_b.w;  // [nh * (nope + vd), r]
  pool_->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qfull(static_cast<size_t>(row)), wrow(static_cast<size_t>(r)),
        olat(static_cast<size_t>(r)), scores(static_cast<size_t>(pass_->max_pos + 1));
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
      ApplyRope(qfull.data() + r, rope, cs + t * rope, geo_.rope_layout);
      const float* cache = Kv(t)->k(l);
      AttendOne(qfull.data(), row, cache, row, cache, r, row, pass_->pos[t], L.window,
                geo_.softmax_scale, scores.data(), olat.data());
      float* o = attn.data() + t * nh * vd + hd * vd;
      for (int64_t d = 0; d < vd; ++d) {
        wkv.RowToF32(hd * (nope + vd) + nope + d, wrow.data());
        float acc = 0.0f;
        for (int64_t c = 0; c < r; ++c) acc += wrow[c] * olat[c];
        o[d] = acc;
      }
    }
  });
  Linear(pool_.get(), attn.data(), T, L.o.w, L.o.bias(), out);
}

void CpuBackend::GqaAttention(int l, const float* h, const float* cs, float* out) const {
  const int64_t T = pass_->size();
  const Layer& L = layers_[static_cast<size_t>(l)];
  const int64_t nh = c_.num_heads, nkv = c_.num_kv_heads, hd = c_.head_dim;
  const int64_t row = nkv * hd, group = nh / nkv;
  const float eps = static_cast<float>(c_.rms_norm_eps);
  std::vector<float> q(static_cast<size_t>(T * nh * hd)), k(static_cast<size_t>(T * row)),
      v(static_cast<size_t>(T * row));
  Linear(pool_.get(), h, T, L.q.w, L.q.bias(), q.data());
  Linear(pool_.get(), h, T, L.k.w, L.k.bias(), k.data());
  Linear(pool_.get(), h, T, L.v.w, L.v.bias(), v.data());
  if (!L.q_norm.empty()) {
    RmsNorm(q.data(), T * nh, hd, L.q_norm.data(), eps, q.data());
    RmsNorm(k.data(), T * nkv, hd, L.k_norm.data(), eps, k.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < nh; ++i)
      ApplyRope(q.data() + (t * nh + i) * hd, hd, cs + t * hd, geo_.rope_layout);
    for (int64_t i = 0; i < nkv; ++i)
      ApplyRope(k.data() + (t * nkv + i) * hd, hd, cs + t * hd, geo_.rope_layout);
  }
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(k.data() + t * row, row, Kv(t)->k(l) + pass_->pos[t] * row);
    std::copy_n(v.data() + t * row, row, Kv(t)->v(l) + pass_->pos[t] * row);
  }
  std::vector<float> attn(static_cast<size_t>(T * nh * hd));
  pool_->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(pass_->max_pos + 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / nh, head = i % nh, kvh = head / group;
      const float* kc = Kv(t)->k(l);
      const float* vc = Kv(t)->v(l);
      AttendOne(q.data() + i * hd, hd, kc + kvh * hd, row, vc + kvh * hd, hd, row, pass_->pos[t],
                L.window, geo_.softmax_scale, scores.data(), attn.data() + i * hd);
    }
  });
  Linear(pool_.get(), attn.data(), T, L.o.w, L.o.bias(), out);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCpuBackend(const ModelConfig& config,
                                                               const Checkpoint& ckpt,
                                                               const ModelOptions& options,
                                                               std::shared_ptr<ThreadPool> pool) {
  (void)options;
  auto b = std::make_unique<CpuBackend>(config, std::move(pool));
  RETURN_IF_ERROR(b->LoadWeights(ckpt));
  return std::unique_ptr<LayerBackend>(std::move(b));
}

}  // namespace hmoe::cpu
