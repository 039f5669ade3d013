#include "gpu_worker/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cpu/attention.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cpu/residual.h"
#include "gpu_worker/driver/attention.h"
#include "gpu_worker/driver/model_driver.h"
#include "gpu_worker/driver/residual.h"
#include "gpu_worker/driver/weight_names.h"

namespace hmoe::cpu {
namespace {

struct Mlp {
  Lin gate, up, down;
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  std::unique_ptr<AttentionOp> attention;  // its kind's (attention.h)
  // feed-forward
  bool moe = false;
  Mlp dense;
  Lin router;
  std::vector<float> router_bias;  // e_score_correction_bias (selection only)
  bool has_shared = false;
  Mlp shared;
};

// Per layer, f32 rows as the layer's attention kind lays them out
// (AttentionSpec::cache): key rows, and value rows when it keeps any.
// Storage grows on demand up to the capacity and is kept on Shrink.
class CpuKvCache final : public KvCache {
 public:
  CpuKvCache(int64_t capacity, std::vector<KvLayout> layouts)
      : capacity_(capacity),
        layouts_(std::move(layouts)),
        k_(layouts_.size()),
        v_(layouts_.size()) {}
  absl::Status Reserve(int64_t n) override {
    if (n <= rows_) return absl::OkStatus();
    const int64_t rows = std::min(capacity_, std::max(n, std::max<int64_t>(16, 2 * rows_)));
    for (size_t l = 0; l < layouts_.size(); ++l) {
      k_[l].resize(static_cast<size_t>(rows * layouts_[l].k_row));
      v_[l].resize(static_cast<size_t>(rows * layouts_[l].v_row));
    }
    rows_ = rows;
    return absl::OkStatus();
  }
  void Shrink(int64_t) override {}
  float* k(int layer) { return k_[static_cast<size_t>(layer)].data(); }
  float* v(int layer) { return v_[static_cast<size_t>(layer)].data(); }

 private:
  int64_t capacity_;
  std::vector<KvLayout> layouts_;  // per layer
  int64_t rows_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

class CpuBackend final : public LayerBackend {
 public:
  CpuBackend(const ModelConfig& config, const ModelOptions& options,
             std::shared_ptr<ThreadPool> pool)
      : c_(config),
        load_(WeightLoadFor(config, options.weights)),
        pool_(std::move(pool)),
        kv_(KvElemOf(options.kv_dtype)) {}
  absl::Status LoadWeights(const Checkpoint& ckpt);

  const char* name() const override { return "cpu"; }
  std::unique_ptr<KvCache> NewKvCache(int64_t capacity) override {
    return std::make_unique<CpuKvCache>(capacity, cache_layouts_);
  }

  absl::Status Begin(const PassTokens& tokens) override {
    pass_ = &tokens;
    const int64_t T = tokens.size(), H = c_.hidden_size;
    h_.resize(static_cast<size_t>(T * H));
    y_.resize(h_.size());
    for (int64_t t = 0; t < T; ++t) embed_.RowToF32(tokens.ids[t], h_.data() + t * H);
    residual_->Begin(h_.data(), T);
    layer_ = 0;
    return absl::OkStatus();
  }
  absl::Status Attention(int l) override {
    const Layer& L = layers_[static_cast<size_t>(l)];
    const int64_t T = pass_->size(), H = c_.hidden_size;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    layer_ = l;
    RmsNorm(residual_->Input(l, Sublayer::kAttention), T, H, L.in_norm.data(), eps, h_.data());
    kv_k_.resize(static_cast<size_t>(T));
    kv_v_.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      kv_k_[static_cast<size_t>(t)] = Kv(t)->k(l);
      kv_v_[static_cast<size_t>(t)] = Kv(t)->v(l);
    }
    const AttentionPass p{.pool = pool_.get(),
                          .T = T,
                          .pos = pass_->pos.data(),
                          .max_pos = pass_->max_pos,
                          .rope_cs = pass_->rope_cs.data(),
                          .k = kv_k_.data(),
                          .v = kv_v_.data(),
                          .kv = kv_};
    L.attention->Forward(p, h_.data(), y_.data());
    residual_->Join(l, Sublayer::kAttention, y_.data());
    RmsNorm(residual_->Input(l, Sublayer::kFeedForward), T, H, L.post_norm.data(), eps, h_.data());
    return absl::OkStatus();
  }
  absl::Status DenseMlp(int l) override {
    RunMlp(layers_[static_cast<size_t>(l)].dense, h_.data(), pass_->size(), y_.data());
    residual_->Join(l, Sublayer::kFeedForward, y_.data());
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
    for (size_t i = 0; i < y_.size(); ++i) {
      float v = routed != nullptr ? routed[i] : 0.0f;
      if (shared) v += y_[i];
      y_[i] = v;
    }
    residual_->Join(l, Sublayer::kFeedForward, y_.data());
    return absl::OkStatus();
  }
  absl::Status AddToResidual(const float* v) override {
    residual_->Join(layer_, Sublayer::kFeedForward, v);
    return absl::OkStatus();
  }
  absl::Status Logits(float* out) override {
    const int64_t H = c_.hidden_size, rows = static_cast<int64_t>(pass_->logit_rows.size());
    const float eps = static_cast<float>(c_.rms_norm_eps);
    const float* x = residual_->Output();
    for (int64_t i = 0; i < rows; ++i)
      RmsNorm(x + pass_->logit_rows[static_cast<size_t>(i)] * H, 1, H, final_norm_.data(), eps,
              h_.data() + i * H);
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
  void RunMlp(const Mlp& m, const float* h, int64_t T, float* out) const;

  ModelConfig c_;
  WeightLoad load_;  // the dense weights' stored form (ModelOptions::weights)
  std::shared_ptr<ThreadPool> pool_;
  KvElem kv_ = KvElem::kF32;  // ModelOptions::kv_dtype
  Matrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<KvLayout> cache_layouts_;  // per layer, its attention kind's
  std::unique_ptr<Residual> residual_;   // the config's residual scheme
  // The pass in progress.
  const PassTokens* pass_ = nullptr;
  int layer_ = 0;  // the layer whose sublayers run
  std::vector<float> h_, y_, logits_, weights_;
  std::vector<int32_t> ids_;
  std::vector<float*> kv_k_, kv_v_;  // [T] the layer's caches of each token
};

absl::Status CpuBackend::LoadWeights(const Checkpoint& ckpt) {
  const ModelConfig& c = c_;
  const int64_t H = c.hidden_size;
  const int64_t block = c.quantization.method == "fp8" ? c.quantization.weight_block[0] : 0;
  // A linear layer: its weight, and its bias when the checkpoint has one.
  auto lin = [&](const std::string& prefix, Lin* out) -> absl::Status {
    return LoadLin(ckpt, prefix, load_, out);
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
    ASSIGN_OR_RETURN(lm_head_, LoadDenseAsMatrix(ckpt, names.lm_head, load_));
  }
  RETURN_IF_ERROR(vec(names.final_norm, H, &final_norm_));
  ASSIGN_OR_RETURN(const ResidualSpec residual, ResidualSpecFor(c));
  ASSIGN_OR_RETURN(residual_, MakeResidual(residual, H));
  layers_.resize(static_cast<size_t>(c.num_layers));
  cache_layouts_.resize(layers_.size());
  for (int i = 0; i < c.num_layers; ++i) {
    Layer& L = layers_[static_cast<size_t>(i)];
    const LayerNames n = NamesForLayer(c, i);
    L.moe = c.layers[static_cast<size_t>(i)].moe;
    RETURN_IF_ERROR(vec(n.input_norm, H, &L.in_norm));
    RETURN_IF_ERROR(vec(n.post_norm, H, &L.post_norm));
    ASSIGN_OR_RETURN(const AttentionSpec spec, AttentionSpecFor(c, i));
    ASSIGN_OR_RETURN(L.attention, MakeAttentionOp(c, spec));
    RETURN_IF_ERROR(L.attention->Load(ckpt, n, load_));
    cache_layouts_[static_cast<size_t>(i)] = spec.cache;
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

}  // namespace

absl::StatusOr<std::unique_ptr<LayerBackend>> CreateCpuBackend(const ModelConfig& config,
                                                               const Checkpoint& ckpt,
                                                               const ModelOptions& options,
                                                               std::shared_ptr<ThreadPool> pool) {
  if (config.arch == Architecture::kDeepseekV4)
    return absl::UnimplementedError(absl::StrCat(
        "cpu backend: ", config.model_type,
        " (attention kinds v4_sliding / v4_csa / v4_hca, router kind hash, residual kind mhc) does "
        "not run through the model driver yet"));
  auto b = std::make_unique<CpuBackend>(config, options, std::move(pool));
  RETURN_IF_ERROR(b->LoadWeights(ckpt));
  return std::unique_ptr<LayerBackend>(std::move(b));
}

}  // namespace hmoe::cpu
