#include "gpu_worker/cpu/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cpu/reference_experts.h"
#include "gpu_worker/cpu/thread_pool.h"

namespace hmoe::cpu {
namespace {

// transformers builds DeepSeek's q_a_layernorm and kv_a_layernorm with the
// RMSNorm default eps, not config.rms_norm_eps.
constexpr float kMlaNormEps = 1e-6f;

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

class CpuModel;

class CpuSequence final : public Sequence {
 public:
  CpuSequence(const CpuModel* owner, int64_t capacity, int64_t k_row, int64_t v_row, int64_t layers)
      : owner_(owner),
        capacity_(capacity),
        k_row_(k_row),
        v_row_(v_row),
        k_(static_cast<size_t>(layers)),
        v_(static_cast<size_t>(layers)) {}
  int64_t length() const override { return length_; }
  int64_t capacity() const override { return capacity_; }
  void Reset() override { length_ = 0; }

  // Grows storage to hold `n` positions (n <= capacity).
  void Reserve(int64_t n) {
    if (n <= rows_) return;
    const int64_t rows = std::min(capacity_, std::max(n, std::max<int64_t>(16, 2 * rows_)));
    for (auto& k : k_) k.resize(static_cast<size_t>(rows * k_row_));
    for (auto& v : v_) v.resize(static_cast<size_t>(rows * v_row_));
    rows_ = rows;
  }
  float* k(int layer) { return k_[static_cast<size_t>(layer)].data(); }
  float* v(int layer) { return v_[static_cast<size_t>(layer)].data(); }

  const CpuModel* owner_;
  int64_t length_ = 0;

 private:
  int64_t capacity_;
  int64_t k_row_, v_row_;  // floats per position per layer
  int64_t rows_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

// Where each token of a batch belongs: its Sequence's cache and its position.
struct TokenSlots {
  int64_t size() const { return static_cast<int64_t>(pos.size()); }
  std::vector<CpuSequence*> seq;
  std::vector<int64_t> pos;
  int64_t max_pos = 0;
};

// One MoE layer's deferred experts (ModelOptions::deferred_experts) from
// their Submit to the Wait at the end of the next layer. Owns what the call
// borrows; a call still pending at destruction (an error path) is waited on
// and its result dropped, so no ticket is left behind.
class DeferredCall {
 public:
  DeferredCall(RoutedExperts* experts, int layer) : experts_(experts), layer_(layer) {}
  DeferredCall(const DeferredCall&) = delete;
  DeferredCall& operator=(const DeferredCall&) = delete;
  ~DeferredCall() {
    if (pending_) experts_->Wait(ticket_).IgnoreError();
  }
  absl::Status Submit(int64_t T, int64_t H, int n) {
    const ExpertBatch b{.layer = layer_,
                        .num_tokens = T,
                        .hidden_size = H,
                        .hidden = hidden.data(),
                        .top_k = n,
                        .expert_ids = ids.data(),
                        .weights = weights.data()};
    out.resize(static_cast<size_t>(T * H));
    ASSIGN_OR_RETURN(ticket_, experts_->Submit(b, out.data()));
    pending_ = true;
    return absl::OkStatus();
  }
  // Waits and adds the deferred experts' sum into x ([T, H]).
  absl::Status Join(float* x) {
    pending_ = false;
    RETURN_IF_ERROR(Annotate(experts_->Wait(ticket_),
                             absl::StrCat("layer ", layer_, " deferred routed experts")));
    for (size_t i = 0; i < out.size(); ++i) x[i] += out[i];
    return absl::OkStatus();
  }
  std::vector<float> hidden;  // [T, H], the layer's input (h is overwritten by the next layer)
  std::vector<int32_t> ids;   // [T, n]
  std::vector<float> weights;
  std::vector<float> out;

 private:
  RoutedExperts* experts_;
  int layer_;
  uint64_t ticket_ = 0;
  bool pending_ = false;
};

class CpuModel final : public Model {
 public:
  static absl::StatusOr<std::unique_ptr<CpuModel>> Create(const ModelConfig& config,
                                                          const Checkpoint& ckpt,
                                                          const ModelOptions& options,
                                                          RoutedExperts* experts);

  const ModelConfig& config() const override { return c_; }
  const ModelOptions& options() const override { return options_; }
  std::unique_ptr<Sequence> NewSequence() const override {
    const int64_t k_row =
        c_.is_mla() ? c_.mla.kv_lora_rank + c_.mla.qk_rope_head_dim : c_.num_kv_heads * c_.head_dim;
    const int64_t v_row = c_.is_mla() ? 0 : k_row;
    return std::make_unique<CpuSequence>(this, options_.max_seq_len, k_row, v_row, c_.num_layers);
  }
  absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const override;

 private:
  CpuModel() = default;
  absl::Status LoadWeights(const Checkpoint& ckpt);
  void MlaAttention(int l, const float* h, const TokenSlots& at, const float* cs, float* out) const;
  void GqaAttention(int l, const float* h, const TokenSlots& at, const float* cs, float* out) const;
  // Layer l's MLP or MoE into out. `deferred`: set to the layer's deferred
  // experts' call when it defers some (ModelOptions::deferred_experts).
  absl::Status FeedForward(int l, const float* h, int64_t T, float* out,
                           std::unique_ptr<DeferredCall>* deferred) const;
  void RunMlp(const Mlp& m, const float* h, int64_t T, float* out) const;

  ModelConfig c_;
  ModelOptions options_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<RoutedExperts> owned_experts_;
  RoutedExperts* experts_ = nullptr;
  Matrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  RopeTables rope_;
  int64_t rope_dim_ = 0;
  RopeLayout rope_layout_ = RopeLayout::kHalves;
  float softmax_scale_ = 1.0f;
  GateSpec gate_;
};

absl::StatusOr<std::unique_ptr<CpuModel>> CpuModel::Create(const ModelConfig& config,
                                                           const Checkpoint& ckpt,
                                                           const ModelOptions& options,
                                                           RoutedExperts* experts) {
  if (static_cast<int64_t>(config.layers.size()) != config.num_layers)
    return absl::InvalidArgumentError("ModelConfig.layers does not match num_hidden_layers");
  if (config.quantization.method == "fp8" &&
      config.quantization.weight_block[0] != config.quantization.weight_block[1])
    return absl::UnimplementedError(absl::StrCat(
        ckpt.dir(), ": fp8 weight blocks must be square, got ", config.quantization.weight_block[0],
        "x", config.quantization.weight_block[1]));
  RETURN_IF_ERROR(CheckWeights(config, ckpt));
  auto m = std::unique_ptr<CpuModel>(new CpuModel);
  m->c_ = config;
  m->options_ = options;
  if (m->options_.num_threads == 0)
    m->options_.num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (m->options_.max_seq_len == 0) m->options_.max_seq_len = config.max_position_embeddings;
  m->pool_ = std::make_shared<ThreadPool>(m->options_.num_threads);
  RETURN_IF_ERROR(m->LoadWeights(ckpt));
  if (config.num_moe_layers() > 0) {
    if (experts) {
      m->experts_ = experts;
    } else {
      ASSIGN_OR_RETURN(auto ref, ReferenceExperts::Create(config, ckpt, m->pool_));
      m->owned_experts_ = std::move(ref);
      m->experts_ = m->owned_experts_.get();
    }
  }
  // Rotary embedding and softmax scale.
  if (config.is_mla()) {
    m->rope_dim_ = config.mla.qk_rope_head_dim;
    // V2 always rotates interleaved pairs (complex form); V3 per rope_interleave.
    m->rope_layout_ = config.arch == Architecture::kDeepseekV2 || config.rope.interleave
                          ? RopeLayout::kInterleaved
                          : RopeLayout::kHalves;
    double scale = 1.0 / std::sqrt(static_cast<double>(config.mla.qk_head_dim()));
    if (config.rope.type != RopeType::kDefault && config.rope.mscale_all_dim != 0.0) {
      const double ms = YarnGetMscale(config.rope.factor, config.rope.mscale_all_dim);
      scale *= ms * ms;
    }
    m->softmax_scale_ = static_cast<float>(scale);
  } else {
    m->rope_dim_ = config.head_dim;
    m->rope_layout_ = RopeLayout::kHalves;
    m->softmax_scale_ = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.head_dim)));
  }
  m->rope_ = ComputeRope(config.rope, m->rope_dim_);
  m->gate_ = GateSpecFor(config);
  return m;
}

absl::Status CpuModel::LoadWeights(const Checkpoint& ckpt) {
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
  auto mlp = [&](const std::string& prefix, Mlp* out) -> absl::Status {
    RETURN_IF_ERROR(lin(prefix + "gate_proj", &out->gate));
    RETURN_IF_ERROR(lin(prefix + "up_proj", &out->up));
    return lin(prefix + "down_proj", &out->down);
  };
  ASSIGN_OR_RETURN(embed_, LoadMatrix(ckpt, "model.embed_tokens.weight", block));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    ASSIGN_OR_RETURN(lm_head_, LoadMatrix(ckpt, "lm_head.weight", block));
  }
  RETURN_IF_ERROR(vec("model.norm.weight", H, &final_norm_));
  layers_.resize(static_cast<size_t>(c.num_layers));
  for (int i = 0; i < c.num_layers; ++i) {
    Layer& L = layers_[static_cast<size_t>(i)];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    const std::string a = p + "self_attn.";
    L.window = c.layers[static_cast<size_t>(i)].sliding_window;
    L.moe = c.layers[static_cast<size_t>(i)].moe;
    RETURN_IF_ERROR(vec(p + "input_layernorm.weight", H, &L.in_norm));
    RETURN_IF_ERROR(vec(p + "post_attention_layernorm.weight", H, &L.post_norm));
    if (c.is_mla()) {
      if (c.mla.q_lora_rank) {
        RETURN_IF_ERROR(lin(a + "q_a_proj", &L.q_a));
        RETURN_IF_ERROR(vec(a + "q_a_layernorm.weight", *c.mla.q_lora_rank, &L.q_a_norm));
        RETURN_IF_ERROR(lin(a + "q_b_proj", &L.q_b));
      } else {
        RETURN_IF_ERROR(lin(a + "q_proj", &L.q));
      }
      RETURN_IF_ERROR(lin(a + "kv_a_proj_with_mqa", &L.kv_a));
      RETURN_IF_ERROR(vec(a + "kv_a_layernorm.weight", c.mla.kv_lora_rank, &L.kv_a_norm));
      RETURN_IF_ERROR(lin(a + "kv_b_proj", &L.kv_b));
      if (!L.kv_b.b.empty())
        return absl::UnimplementedError(absl::StrCat(ckpt.dir(), ": ", a, "kv_b_proj.bias"));
    } else {
      RETURN_IF_ERROR(lin(a + "q_proj", &L.q));
      RETURN_IF_ERROR(lin(a + "k_proj", &L.k));
      RETURN_IF_ERROR(lin(a + "v_proj", &L.v));
      if (c.arch == Architecture::kQwen3Moe) {
        RETURN_IF_ERROR(vec(a + "q_norm.weight", c.head_dim, &L.q_norm));
        RETURN_IF_ERROR(vec(a + "k_norm.weight", c.head_dim, &L.k_norm));
      }
    }
    RETURN_IF_ERROR(lin(a + "o_proj", &L.o));
    if (!L.moe) {
      RETURN_IF_ERROR(mlp(p + "mlp.", &L.dense));
      continue;
    }
    const std::string block_name =
        c.arch == Architecture::kMixtral ? p + "block_sparse_moe." : p + "mlp.";
    ASSIGN_OR_RETURN(L.router.w, LoadMatrix(ckpt, block_name + "gate.weight", block));
    if (c.moe.score_correction_bias)
      RETURN_IF_ERROR(
          vec(block_name + "gate.e_score_correction_bias", c.moe.num_experts, &L.router_bias));
    if (c.moe.num_shared_experts > 0) {
      L.has_shared = true;
      RETURN_IF_ERROR(mlp(block_name + "shared_experts.", &L.shared));
    }
  }
  return absl::OkStatus();
}

void CpuModel::RunMlp(const Mlp& m, const float* h, int64_t T, float* out) const {
  const int64_t I = m.gate.w.rows;
  std::vector<float> g(static_cast<size_t>(T * I)), u(static_cast<size_t>(T * I));
  Linear(pool_.get(), h, T, m.gate.w, m.gate.bias(), g.data());
  Linear(pool_.get(), h, T, m.up.w, m.up.bias(), u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
  Linear(pool_.get(), g.data(), T, m.down.w, m.down.bias(), out);
}

absl::Status CpuModel::FeedForward(int l, const float* h, int64_t T, float* out,
                                   std::unique_ptr<DeferredCall>* deferred) const {
  const Layer& L = layers_[static_cast<size_t>(l)];
  if (!L.moe) {
    RunMlp(L.dense, h, T, out);
    return absl::OkStatus();
  }
  const int64_t E = c_.moe.num_experts, K = c_.moe.experts_per_token, H = c_.hidden_size;
  std::vector<float> logits(static_cast<size_t>(T * E)), weights(static_cast<size_t>(T * K));
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  Linear(pool_.get(), h, T, L.router.w, nullptr, logits.data());
  Route(gate_, logits.data(), T, L.router_bias.empty() ? nullptr : L.router_bias.data(), ids.data(),
        weights.data());
  // The last layer never defers: nothing would be left to overlap with.
  const int n = l + 1 < c_.num_layers ? options_.deferred_experts : 0;
  int64_t k_now = K;
  std::unique_ptr<DeferredCall> later;
  if (n > 0) {
    // Per token, the n lowest weights (ties: the later slot) go to `later`;
    // the others keep their order.
    later = std::make_unique<DeferredCall>(experts_, l);
    later->hidden.assign(h, h + T * H);
    later->ids.resize(static_cast<size_t>(T * n));
    later->weights.resize(static_cast<size_t>(T * n));
    k_now = K - n;
    std::vector<int64_t> order(static_cast<size_t>(K));
    std::vector<char> deferred_slot(static_cast<size_t>(K));
    for (int64_t t = 0; t < T; ++t) {
      const float* w = weights.data() + t * K;
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return w[a] < w[b] || (w[a] == w[b] && a > b); });
      std::fill(deferred_slot.begin(), deferred_slot.end(), 0);
      for (int j = 0; j < n; ++j) {
        const int64_t slot = order[static_cast<size_t>(j)];
        deferred_slot[static_cast<size_t>(slot)] = 1;
        later->ids[static_cast<size_t>(t * n + j)] = ids[static_cast<size_t>(t * K + slot)];
        later->weights[static_cast<size_t>(t * n + j)] = w[slot];
      }
      int64_t kept = 0;
      for (int64_t j = 0; j < K; ++j) {
        if (deferred_slot[static_cast<size_t>(j)]) continue;
        ids[static_cast<size_t>(t * k_now + kept)] = ids[static_cast<size_t>(t * K + j)];
        weights[static_cast<size_t>(t * k_now + kept)] = w[j];
        ++kept;
      }
    }
  }
  const ExpertBatch b{.layer = l,
                      .num_tokens = T,
                      .hidden_size = H,
                      .hidden = h,
                      .top_k = static_cast<int>(k_now),
                      .expert_ids = ids.data(),
                      .weights = weights.data()};
  // The routed experts run (remote ones: on the expert service) while this
  // thread computes the shared experts; deferred ones keep running after.
  const std::string where = absl::StrCat("layer ", l, " routed experts");
  auto ticket = experts_->Submit(b, out);
  if (!ticket.ok()) return Annotate(ticket.status(), where);
  if (later) {
    absl::Status st = later->Submit(T, H, n);
    if (!st.ok()) {
      experts_->Wait(*ticket).IgnoreError();
      return Annotate(st, absl::StrCat("layer ", l, " deferred routed experts"));
    }
  }
  std::vector<float> sh;
  if (L.has_shared) {
    sh.resize(static_cast<size_t>(T * H));
    RunMlp(L.shared, h, T, sh.data());
  }
  RETURN_IF_ERROR(Annotate(experts_->Wait(*ticket), where));
  for (size_t i = 0; i < sh.size(); ++i) out[i] += sh[i];
  *deferred = std::move(later);
  return absl::OkStatus();
}

void CpuModel::MlaAttention(int l, const float* h, const TokenSlots& at, const float* cs,
                            float* out) const {
  const int64_t T = at.size();
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
    float* dst = at.seq[t]->k(l) + at.pos[t] * row;
    RmsNorm(kva.data() + t * row, 1, r, L.kv_a_norm.data(), kMlaNormEps, dst);
    std::copy_n(kva.data() + t * row + r, rope, dst + r);
    ApplyRope(dst + r, rope, cs + t * rope, rope_layout_);
  }
  // Per (token, head): absorb kv_b's key part into the query, attend over the
  // latents, expand the latent output with kv_b's value part.
  std::vector<float> attn(static_cast<size_t>(T * nh * vd));
  const Matrix& wkv = L.kv_b.w;  // [nh * (nope + vd), r]
  pool_->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qfull(static_cast<size_t>(row)), wrow(static_cast<size_t>(r)),
        olat(static_cast<size_t>(r)), scores(static_cast<size_t>(at.max_pos + 1));
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
      ApplyRope(qfull.data() + r, rope, cs + t * rope, rope_layout_);
      const float* cache = at.seq[t]->k(l);
      AttendOne(qfull.data(), row, cache, row, cache, r, row, at.pos[t], L.window, softmax_scale_,
                scores.data(), olat.data());
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

void CpuModel::GqaAttention(int l, const float* h, const TokenSlots& at, const float* cs,
                            float* out) const {
  const int64_t T = at.size();
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
      ApplyRope(q.data() + (t * nh + i) * hd, hd, cs + t * hd, rope_layout_);
    for (int64_t i = 0; i < nkv; ++i)
      ApplyRope(k.data() + (t * nkv + i) * hd, hd, cs + t * hd, rope_layout_);
  }
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(k.data() + t * row, row, at.seq[t]->k(l) + at.pos[t] * row);
    std::copy_n(v.data() + t * row, row, at.seq[t]->v(l) + at.pos[t] * row);
  }
  std::vector<float> attn(static_cast<size_t>(T * nh * hd));
  pool_->ParallelFor(T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(at.max_pos + 1));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / nh, head = i % nh, kvh = head / group;
      const float* kc = at.seq[t]->k(l);
      const float* vc = at.seq[t]->v(l);
      AttendOne(q.data() + i * hd, hd, kc + kvh * hd, row, vc + kvh * hd, hd, row, at.pos[t],
                L.window, softmax_scale_, scores.data(), attn.data() + i * hd);
    }
  });
  Linear(pool_.get(), attn.data(), T, L.o.w, L.o.bias(), out);
}

absl::Status CpuModel::ForwardBatch(absl::Span<const ForwardStep> steps) const {
  if (steps.empty()) return absl::InvalidArgumentError("ForwardBatch: no steps");
  const bool several = steps.size() > 1;
  auto step_error = [&](size_t i, absl::Status st) {
    return several ? Annotate(st, absl::StrCat("step ", i)) : st;
  };
  TokenSlots at;
  std::vector<CpuSequence*> seqs(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const ForwardStep& st = steps[i];
    auto* s = dynamic_cast<CpuSequence*>(st.seq);
    if (s == nullptr || s->owner_ != this)
      return step_error(
          i, absl::InvalidArgumentError("Forward: the Sequence was not made by this Model"));
    if (st.logits == nullptr)
      return step_error(i, absl::InvalidArgumentError("Forward: no logits output"));
    for (size_t j = 0; j < i; ++j)
      if (seqs[j] == s)
        return step_error(i, absl::InvalidArgumentError(absl::StrCat(
                                 "ForwardBatch: the Sequence of step ", j, " appears again")));
    seqs[i] = s;
    const int64_t T = static_cast<int64_t>(st.tokens.size());
    if (T == 0) return step_error(i, absl::InvalidArgumentError("Forward: no tokens"));
    for (int64_t t = 0; t < T; ++t) {
      if (st.tokens[t] < 0 || st.tokens[t] >= c_.vocab_size)
        return step_error(i, absl::InvalidArgumentError(absl::StrCat(
                                 "token id ", st.tokens[t], " at index ", t,
                                 " is outside the vocabulary [0, ", c_.vocab_size, ")")));
    }
    const int64_t p0 = s->length_;
    if (p0 + T > s->capacity())
      return step_error(i, absl::ResourceExhaustedError(
                               absl::StrCat("sequence holds ", p0, " tokens; ", T,
                                            " more exceed its capacity of ", s->capacity())));
    for (int64_t t = 0; t < T; ++t) {
      at.seq.push_back(s);
      at.pos.push_back(p0 + t);
    }
    at.max_pos = std::max(at.max_pos, p0 + T - 1);
  }
  for (size_t i = 0; i < steps.size(); ++i)
    seqs[i]->Reserve(seqs[i]->length_ + static_cast<int64_t>(steps[i].tokens.size()));

  const int64_t T = at.size(), H = c_.hidden_size;
  std::vector<float> cs(static_cast<size_t>(T * rope_dim_));
  for (int64_t t = 0; t < T; ++t) RopeCosSin(rope_, at.pos[t], cs.data() + t * rope_dim_);
  std::vector<float> x(static_cast<size_t>(T * H)), h(static_cast<size_t>(T * H)),
      y(static_cast<size_t>(T * H));
  {
    int64_t t = 0;
    for (const ForwardStep& st : steps)
      for (int32_t id : st.tokens) embed_.RowToF32(id, x.data() + (t++) * H);
  }
  const float eps = static_cast<float>(c_.rms_norm_eps);
  // Expert Deferral: the previous layer's deferred experts, joined at the
  // end of this one.
  std::unique_ptr<DeferredCall> deferred, previous;
  for (int l = 0; l < c_.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    RmsNorm(x.data(), T, H, L.in_norm.data(), eps, h.data());
    if (c_.is_mla())
      MlaAttention(l, h.data(), at, cs.data(), y.data());
    else
      GqaAttention(l, h.data(), at, cs.data(), y.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    RmsNorm(x.data(), T, H, L.post_norm.data(), eps, h.data());
    RETURN_IF_ERROR(FeedForward(l, h.data(), T, y.data(), &deferred));
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    if (previous) RETURN_IF_ERROR(previous->Join(x.data()));
    previous = std::move(deferred);
  }
  // The rows that need logits (each step's last token, or all of it), in
  // step order, through the final norm and the head in one product.
  auto kept_rows = [](const ForwardStep& st) {
    return st.mode == LogitsMode::kAll ? static_cast<int64_t>(st.tokens.size()) : int64_t{1};
  };
  int64_t rows = 0;
  for (int64_t t0 = 0; const ForwardStep& st : steps) {
    const int64_t n = static_cast<int64_t>(st.tokens.size()), keep = kept_rows(st);
    RmsNorm(x.data() + (t0 + n - keep) * H, keep, H, final_norm_.data(), eps, h.data() + rows * H);
    rows += keep;
    t0 += n;
  }
  const int64_t V = c_.vocab_size;
  std::vector<float> all(static_cast<size_t>(rows * V));
  Linear(pool_.get(), h.data(), rows, lm_head_, nullptr, all.data());
  auto from = all.begin();
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto to = from + kept_rows(steps[i]) * V;
    steps[i].logits->assign(from, to);
    from = to;
    seqs[i]->length_ += static_cast<int64_t>(steps[i].tokens.size());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateCpuModel(const ModelConfig& config,
                                                      const Checkpoint& ckpt,
                                                      const ModelOptions& options,
                                                      RoutedExperts* experts) {
  ASSIGN_OR_RETURN(auto m, CpuModel::Create(config, ckpt, options, experts));
  return std::unique_ptr<Model>(std::move(m));
}

}  // namespace hmoe::cpu
