#include "gpu_worker/cpu/deepseek_v4_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/driver/rope.h"

namespace hmoe::cpu {
namespace {

using Vec = std::vector<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// y[rows] = w[rows, cols] x[cols].
void MatVec(const Vec& w, int64_t rows, int64_t cols, const float* x, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w.data() + r * cols;
    double acc = 0;
    for (int64_t k = 0; k < cols; ++k) acc += static_cast<double>(row[k]) * x[k];
    y[r] = static_cast<float>(acc);
  }
}

double Dot(const float* a, const float* b, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(a[i]) * b[i];
  return acc;
}

// x *= rsqrt(mean(x^2) + eps), then * weight when given.
void Norm(float* x, int64_t n, const float* weight, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r * (weight != nullptr ? weight[i] : 1.0f);
}

// Rotates the trailing 2 * inv_freq.size() dims of x[d] (interleaved pairs)
// to position `pos`; sign -1 rotates back (the attention output's de-rope).
void RopeTail(float* x, int64_t d, const RopeTables& t, int64_t pos, float sign) {
  const int64_t half = static_cast<int64_t>(t.inv_freq.size());
  std::vector<float> cs(static_cast<size_t>(2 * half));
  RopeCosSin(t, pos, cs.data());
  float* r = x + d - 2 * half;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cs[static_cast<size_t>(2 * i)], s = sign * cs[static_cast<size_t>(2 * i + 1)];
    const float x0 = r[2 * i], x1 = r[2 * i + 1];
    r[2 * i] = x0 * c - x1 * s;
    r[2 * i + 1] = x1 * c + x0 * s;
  }
}

float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

class V4Forward {
 public:
  V4Forward(const ModelConfig& c, const Checkpoint& ckpt) : c_(c), ckpt_(ckpt) {
    const int64_t rot = c.v4.qk_rope_head_dim;
    main_rope_ = ComputeRope(c.rope, rot);
    compress_rope_ = ComputeRope(c.v4.compress_rope, rot);
    eps_ = static_cast<float>(c.rms_norm_eps);
  }

  absl::StatusOr<Vec> Run(const std::vector<int32_t>& ids);

 private:
  absl::StatusOr<Vec> Get(const std::string& name, int64_t numel) {
    return LoadVector(ckpt_, name, numel);
  }
  // pre (consumed: the collapsed input), post and comb of one hyper-connection.
  absl::Status HyperConnection(const std::string& prefix, const Vec& streams, int64_t S,
                               Vec* collapsed, Vec* post, Vec* comb);
  absl::StatusOr<Vec> Attention(int layer, const Vec& x, int64_t S);
  absl::StatusOr<Vec> Moe(int layer, const Vec& x, const std::vector<int32_t>& ids);
  absl::StatusOr<Vec> Compress(const std::string& prefix, const Vec& x, int64_t S, int64_t d,
                               int64_t rate, bool overlap);

  const ModelConfig& c_;
  const Checkpoint& ckpt_;
  RopeTables main_rope_, compress_rope_;
  float eps_ = 1e-6f;
};

absl::Status V4Forward::HyperConnection(const std::string& prefix, const Vec& streams, int64_t S,
                                        Vec* collapsed, Vec* post, Vec* comb) {
  const int64_t M = c_.v4.hc_mult, H = c_.hidden_size, W = (2 + M) * M;
  const float hc_eps = static_cast<float>(c_.v4.hc_eps);
  ASSIGN_OR_RETURN(const Vec fn, Get(prefix + "fn", W * M * H));
  ASSIGN_OR_RETURN(const Vec base, Get(prefix + "base", W));
  ASSIGN_OR_RETURN(const Vec scale, Get(prefix + "scale", 3));
  collapsed->assign(static_cast<size_t>(S * H), 0.0f);
  post->assign(static_cast<size_t>(S * M), 0.0f);
  comb->assign(static_cast<size_t>(S * M * M), 0.0f);
  Vec flat(static_cast<size_t>(M * H)), mix(static_cast<size_t>(W));
  for (int64_t s = 0; s < S; ++s) {
    const float* h = streams.data() + s * M * H;
    std::copy(h, h + M * H, flat.begin());
    Norm(flat.data(), M * H, nullptr, eps_);
    MatVec(fn, W, M * H, flat.data(), mix.data());
    float* cb = comb->data() + s * M * M;
    for (int64_t i = 0; i < M; ++i) {
      const float pre = 1.0f / (1.0f + std::exp(-(mix[i] * scale[0] + base[i]))) + hc_eps;
      (*post)[s * M + i] = 2.0f / (1.0f + std::exp(-(mix[M + i] * scale[1] + base[M + i])));
      for (int64_t k = 0; k < H; ++k) (*collapsed)[s * H + k] += pre * h[i * H + k];
      // comb row i: softmax over j, then + eps.
      float mx = kNegInf;
      for (int64_t j = 0; j < M; ++j) {
        cb[i * M + j] = mix[2 * M + i * M + j] * scale[2] + base[2 * M + i * M + j];
        mx = std::max(mx, cb[i * M + j]);
      }
      float sum = 0;
      for (int64_t j = 0; j < M; ++j) sum += cb[i * M + j] = std::exp(cb[i * M + j] - mx);
      for (int64_t j = 0; j < M; ++j) cb[i * M + j] = cb[i * M + j] / sum + hc_eps;
    }
    // Sinkhorn: columns, then (rows, columns) iters - 1 times.
    auto cols = [&] {
      for (int64_t j = 0; j < M; ++j) {
        float sum = 0;
        for (int64_t i = 0; i < M; ++i) sum += cb[i * M + j];
        for (int64_t i = 0; i < M; ++i) cb[i * M + j] /= sum + hc_eps;
      }
    };
    auto rows = [&] {
      for (int64_t i = 0; i < M; ++i) {
        float sum = 0;
        for (int64_t j = 0; j < M; ++j) sum += cb[i * M + j];
        for (int64_t j = 0; j < M; ++j) cb[i * M + j] /= sum + hc_eps;
      }
    };
    cols();
    for (int64_t it = 0; it + 1 < c_.v4.hc_sinkhorn_iters; ++it) {
      rows();
      cols();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Vec> V4Forward::Compress(const std::string& prefix, const Vec& x, int64_t S,
                                        int64_t d, int64_t rate, bool overlap) {
  const int64_t H = c_.hidden_size, width = overlap ? 2 * d : d, n = S / rate;
  ASSIGN_OR_RETURN(const Vec wkv, Get(prefix + "wkv.weight", width * H));
  ASSIGN_OR_RETURN(const Vec wgate, Get(prefix + "wgate.weight", width * H));
  ASSIGN_OR_RETURN(const Vec ape, Get(prefix + "ape", rate * width));
  ASSIGN_OR_RETURN(const Vec norm, Get(prefix + "norm.weight", d));
  Vec kv(static_cast<size_t>(n * rate * width)), gate(kv.size());
  for (int64_t t = 0; t < n * rate; ++t) {
    MatVec(wkv, width, H, x.data() + t * H, kv.data() + t * width);
    MatVec(wgate, width, H, x.data() + t * H, gate.data() + t * width);
    for (int64_t j = 0; j < width; ++j) gate[t * width + j] += ape[(t % rate) * width + j];
  }
  Vec out(static_cast<size_t>(n * d));
  std::vector<float> g, v;
  for (int64_t w = 0; w < n; ++w) {
    for (int64_t j = 0; j < d; ++j) {
      g.clear();
      v.clear();
      if (overlap && w > 0)  // the previous window's first series
        for (int64_t t = (w - 1) * rate; t < w * rate; ++t) {
          g.push_back(gate[t * width + j]);
          v.push_back(kv[t * width + j]);
        }
      const int64_t off = overlap ? d : 0;  // this window's (second) series
      for (int64_t t = w * rate; t < (w + 1) * rate; ++t) {
        g.push_back(gate[t * width + off + j]);
        v.push_back(kv[t * width + off + j]);
      }
      const float mx = *std::max_element(g.begin(), g.end());
      float sum = 0;
      for (float& e : g) sum += e = std::exp(e - mx);
      double acc = 0;
      for (size_t i = 0; i < g.size(); ++i) acc += static_cast<double>(g[i] / sum) * v[i];
      out[w * d + j] = static_cast<float>(acc);
    }
    Norm(out.data() + w * d, d, norm.data(), eps_);
    RopeTail(out.data() + w * d, d, compress_rope_, w * rate, 1.0f);
  }
  return out;
}

absl::StatusOr<Vec> V4Forward::Attention(int layer, const Vec& x, int64_t S) {
  const LayerSpec& l = c_.layers[static_cast<size_t>(layer)];
  const int64_t H = c_.hidden_size, D = c_.head_dim, N = c_.num_heads, Q = c_.v4.q_lora_rank;
  const int64_t G = c_.v4.o_groups, R = c_.v4.o_lora_rank, W = l.sliding_window;
  const std::string a = absl::StrCat("model.layers.", layer, ".attn.");
  const RopeTables& rope = l.attention == AttentionKind::kV4Sliding ? main_rope_ : compress_rope_;
  ASSIGN_OR_RETURN(const Vec wq_a, Get(a + "wq_a.weight", Q * H));
  ASSIGN_OR_RETURN(const Vec q_norm, Get(a + "q_norm.weight", Q));
  ASSIGN_OR_RETURN(const Vec wq_b, Get(a + "wq_b.weight", N * D * Q));
  ASSIGN_OR_RETURN(const Vec wkv, Get(a + "wkv.weight", D * H));
  ASSIGN_OR_RETURN(const Vec kv_norm, Get(a + "norm.weight", D));
  ASSIGN_OR_RETURN(const Vec wo_a, Get(a + "wo_a.weight", G * R * (N * D / G)));
  ASSIGN_OR_RETURN(const Vec wo_b, Get(a + "wo_b.weight", H * G * R));
  ASSIGN_OR_RETURN(const Vec sinks, Get(a + "attn_sink", N));
  Vec qr(static_cast<size_t>(S * Q)), q(static_cast<size_t>(S * N * D)),
      kv(static_cast<size_t>(S * D));
  for (int64_t s = 0; s < S; ++s) {
    MatVec(wq_a, Q, H, x.data() + s * H, qr.data() + s * Q);
    Norm(qr.data() + s * Q, Q, q_norm.data(), eps_);
    MatVec(wq_b, N * D, Q, qr.data() + s * Q, q.data() + s * N * D);
    for (int64_t h = 0; h < N; ++h) {
      Norm(q.data() + (s * N + h) * D, D, nullptr, eps_);
      RopeTail(q.data() + (s * N + h) * D, D, rope, s, 1.0f);
    }
    MatVec(wkv, D, H, x.data() + s * H, kv.data() + s * D);
    Norm(kv.data() + s * D, D, kv_norm.data(), eps_);
    RopeTail(kv.data() + s * D, D, rope, s, 1.0f);
  }
  // Compressed entries, and per query the ones it reads.
  const int64_t rate = l.compress_rate;
  Vec comp;
  std::vector<std::vector<int64_t>> chosen(static_cast<size_t>(S));
  if (l.attention != AttentionKind::kV4Sliding) {
    const bool csa = l.attention == AttentionKind::kV4Csa;
    ASSIGN_OR_RETURN(comp, Compress(a + "compressor.", x, S, D, rate, csa));
    const int64_t n = S / rate;
    if (!csa) {
      for (int64_t s = 0; s < S; ++s)
        for (int64_t w = 0; w < std::min(n, (s + 1) / rate); ++w)
          chosen[static_cast<size_t>(s)].push_back(w);
    } else {
      const int64_t ID = c_.dsa.head_dim, IH = c_.dsa.n_heads;
      const std::string ix = a + "indexer.";
      ASSIGN_OR_RETURN(const Vec icomp, Compress(ix + "compressor.", x, S, ID, rate, true));
      ASSIGN_OR_RETURN(const Vec iwq_b, Get(ix + "wq_b.weight", IH * ID * Q));
      ASSIGN_OR_RETURN(const Vec iw, Get(ix + "weights_proj.weight", IH * H));
      Vec iq(static_cast<size_t>(IH * ID)), wts(static_cast<size_t>(IH));
      const float softmax_scale = 1.0f / std::sqrt(static_cast<float>(ID));
      const float weights_scale = 1.0f / std::sqrt(static_cast<float>(IH));
      for (int64_t s = 0; s < S; ++s) {
        const int64_t vis = std::min(n, (s + 1) / rate);
        if (vis == 0) continue;
        MatVec(iwq_b, IH * ID, Q, qr.data() + s * Q, iq.data());
        for (int64_t h = 0; h < IH; ++h) RopeTail(iq.data() + h * ID, ID, compress_rope_, s, 1.0f);
        MatVec(iw, IH, H, x.data() + s * H, wts.data());
        std::vector<float> score(static_cast<size_t>(vis));
        for (int64_t t = 0; t < vis; ++t) {
          float acc = 0;
          for (int64_t h = 0; h < IH; ++h) {
            const float dot =
                static_cast<float>(Dot(iq.data() + h * ID, icomp.data() + t * ID, ID));
            acc += std::max(dot, 0.0f) * softmax_scale * (wts[h] * weights_scale);
          }
          score[static_cast<size_t>(t)] = acc;
        }
        std::vector<int64_t> order(static_cast<size_t>(vis));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t r) {
          return score[static_cast<size_t>(p)] > score[static_cast<size_t>(r)];
        });
        order.resize(static_cast<size_t>(std::min(vis, c_.dsa.topk)));
        chosen[static_cast<size_t>(s)] = order;
      }
    }
  }
  // Attention over the window's keys and the chosen entries (K = V), with a
  // per-head sink in the softmax; the output's rope dims rotated back.
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Vec o(static_cast<size_t>(N * D)), y(static_cast<size_t>(G * R)), out(static_cast<size_t>(S * H));
  std::vector<const float*> keys;
  std::vector<float> logit;
  for (int64_t s = 0; s < S; ++s) {
    keys.clear();
    for (int64_t t = std::max<int64_t>(0, s - W + 1); t <= s; ++t)
      keys.push_back(kv.data() + t * D);
    for (int64_t w : chosen[static_cast<size_t>(s)]) keys.push_back(comp.data() + w * D);
    for (int64_t h = 0; h < N; ++h) {
      const float* qh = q.data() + (s * N + h) * D;
      logit.assign(keys.size(), 0.0f);
      float mx = sinks[static_cast<size_t>(h)];
      for (size_t k = 0; k < keys.size(); ++k) {
        logit[k] = static_cast<float>(Dot(qh, keys[k], D)) * scale;
        mx = std::max(mx, logit[k]);
      }
      float sum = std::exp(sinks[static_cast<size_t>(h)] - mx);
      for (float& e : logit) sum += e = std::exp(e - mx);
      float* oh = o.data() + h * D;
      for (int64_t j = 0; j < D; ++j) {
        double acc = 0;
        for (size_t k = 0; k < keys.size(); ++k)
          acc += static_cast<double>(logit[k] / sum) * keys[k][j];
        oh[j] = static_cast<float>(acc);
      }
      RopeTail(oh, D, rope, s, -1.0f);
    }
    const int64_t per = N * D / G;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < R; ++r)
        y[g * R + r] =
            static_cast<float>(Dot(wo_a.data() + (g * R + r) * per, o.data() + g * per, per));
    MatVec(wo_b, H, G * R, y.data(), out.data() + s * H);
  }
  return out;
}

absl::StatusOr<Vec> V4Forward::Moe(int layer, const Vec& x, const std::vector<int32_t>& ids) {
  const LayerSpec& l = c_.layers[static_cast<size_t>(layer)];
  const int64_t H = c_.hidden_size, E = c_.moe.num_experts, K = c_.moe.experts_per_token;
  const int64_t I = c_.moe.intermediate_size, S = static_cast<int64_t>(ids.size());
  const std::string f = absl::StrCat("model.layers.", layer, ".ffn.");
  const float limit = static_cast<float>(c_.v4.swiglu_limit);
  ASSIGN_OR_RETURN(const Vec gate, Get(f + "gate.weight", E * H));
  Vec bias;
  std::vector<int64_t> table;
  if (l.router == RouterKind::kHash) {
    const std::string name = f + "gate.tid2eid";
    const TensorEntry* e = ckpt_.Find(name);
    if (e == nullptr) return absl::NotFoundError(absl::StrCat(ckpt_.dir(), ": no tensor ", name));
    ASSIGN_OR_RETURN(const Tensor t, ckpt_.Get(name));
    table.resize(static_cast<size_t>(c_.vocab_size * K));
    for (size_t i = 0; i < table.size(); ++i) {
      if (e->dtype == DType::kI64) {
        std::memcpy(&table[i], static_cast<const uint8_t*>(t.raw()) + i * 8, 8);
      } else {
        int32_t v = 0;
        std::memcpy(&v, static_cast<const uint8_t*>(t.raw()) + i * 4, 4);
        table[i] = v;
      }
    }
  } else {
    ASSIGN_OR_RETURN(bias, Get(f + "gate.bias", E));
  }
  // One SwiGLU MLP with the clamp: gate <= limit, |up| <= limit.
  auto mlp = [&](const std::string& p, int64_t width, const float* in, float* acc,
                 float weight) -> absl::Status {
    ASSIGN_OR_RETURN(const Vec w1, Get(p + "w1.weight", width * H));
    ASSIGN_OR_RETURN(const Vec w3, Get(p + "w3.weight", width * H));
    ASSIGN_OR_RETURN(const Vec w2, Get(p + "w2.weight", H * width));
    Vec g(static_cast<size_t>(width)), u(g.size()), y(static_cast<size_t>(H));
    MatVec(w1, width, H, in, g.data());
    MatVec(w3, width, H, in, u.data());
    for (int64_t i = 0; i < width; ++i) {
      const float gi = std::min(g[i], limit), ui = std::clamp(u[i], -limit, limit);
      g[i] = Silu(gi) * ui;
    }
    MatVec(w2, H, width, g.data(), y.data());
    for (int64_t k = 0; k < H; ++k) acc[k] += weight * y[k];
    return absl::OkStatus();
  };
  Vec out(static_cast<size_t>(S * H), 0.0f), logits(static_cast<size_t>(E)), sc(logits.size());
  for (int64_t s = 0; s < S; ++s) {
    const float* in = x.data() + s * H;
    MatVec(gate, E, H, in, logits.data());
    for (int64_t e = 0; e < E; ++e) sc[e] = std::sqrt(Softplus(logits[e]));
    std::vector<int64_t> chosen;
    if (l.router == RouterKind::kHash) {
      for (int64_t k = 0; k < K; ++k) chosen.push_back(table[static_cast<size_t>(ids[s] * K + k)]);
    } else {
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t p, int64_t r) { return sc[p] + bias[p] > sc[r] + bias[r]; });
      chosen.assign(order.begin(), order.begin() + K);
    }
    float sum = 0;
    for (int64_t e : chosen) sum += sc[e];
    for (int64_t e : chosen) {
      const float w = sc[e] / (sum + 1e-20f) * static_cast<float>(c_.moe.routed_scaling_factor);
      RETURN_IF_ERROR(mlp(absl::StrCat(f, "experts.", e, "."), I, in, out.data() + s * H, w));
    }
    RETURN_IF_ERROR(
        mlp(f + "shared_experts.", I * c_.moe.num_shared_experts, in, out.data() + s * H, 1.0f));
  }
  return out;
}

absl::StatusOr<Vec> V4Forward::Run(const std::vector<int32_t>& ids) {
  const int64_t S = static_cast<int64_t>(ids.size()), H = c_.hidden_size, M = c_.v4.hc_mult;
  const int64_t V = c_.vocab_size;
  ASSIGN_OR_RETURN(const Vec embed, Get("model.embed_tokens.weight", V * H));
  Vec hs(static_cast<size_t>(S * M * H));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t m = 0; m < M; ++m)
      std::copy(embed.begin() + ids[static_cast<size_t>(s)] * H,
                embed.begin() + (ids[static_cast<size_t>(s)] + 1) * H,
                hs.begin() + (s * M + m) * H);
  Vec collapsed, post, comb;
  // streams = post * block(norm(collapsed)) + comb^T streams.
  auto mix = [&](const Vec& block) {
    Vec next(hs.size());
    for (int64_t s = 0; s < S; ++s)
      for (int64_t j = 0; j < M; ++j)
        for (int64_t k = 0; k < H; ++k) {
          float acc = post[s * M + j] * block[s * H + k];
          for (int64_t i = 0; i < M; ++i)
            acc += comb[(s * M + i) * M + j] * hs[(s * M + i) * H + k];
          next[(s * M + j) * H + k] = acc;
        }
    hs = std::move(next);
  };
  for (int i = 0; i < static_cast<int>(c_.num_layers); ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    RETURN_IF_ERROR(HyperConnection(p + "hc_attn_", hs, S, &collapsed, &post, &comb));
    ASSIGN_OR_RETURN(const Vec attn_norm, Get(p + "attn_norm.weight", H));
    for (int64_t s = 0; s < S; ++s) Norm(collapsed.data() + s * H, H, attn_norm.data(), eps_);
    ASSIGN_OR_RETURN(const Vec attn, Attention(i, collapsed, S));
    mix(attn);
    RETURN_IF_ERROR(HyperConnection(p + "hc_ffn_", hs, S, &collapsed, &post, &comb));
    ASSIGN_OR_RETURN(const Vec ffn_norm, Get(p + "ffn_norm.weight", H));
    for (int64_t s = 0; s < S; ++s) Norm(collapsed.data() + s * H, H, ffn_norm.data(), eps_);
    ASSIGN_OR_RETURN(const Vec moe, Moe(i, collapsed, ids));
    mix(moe);
  }
  // The head's collapse (sigmoid weights, no mixing), the final norm, the LM head.
  ASSIGN_OR_RETURN(const Vec hc_fn, Get("model.hc_head.hc_fn", M * M * H));
  ASSIGN_OR_RETURN(const Vec hc_base, Get("model.hc_head.hc_base", M));
  ASSIGN_OR_RETURN(const Vec hc_scale, Get("model.hc_head.hc_scale", 1));
  ASSIGN_OR_RETURN(const Vec norm, Get("model.norm.weight", H));
  ASSIGN_OR_RETURN(const Vec head, Get("head.weight", V * H));
  Vec logits(static_cast<size_t>(S * V)), flat(static_cast<size_t>(M * H)),
      mixes(static_cast<size_t>(M)), y(static_cast<size_t>(H));
  for (int64_t s = 0; s < S; ++s) {
    const float* h = hs.data() + s * M * H;
    std::copy(h, h + M * H, flat.begin());
    Norm(flat.data(), M * H, nullptr, eps_);
    MatVec(hc_fn, M, M * H, flat.data(), mixes.data());
    std::fill(y.begin(), y.end(), 0.0f);
    for (int64_t i = 0; i < M; ++i) {
      const float pre = 1.0f / (1.0f + std::exp(-(mixes[i] * hc_scale[0] + hc_base[i]))) +
                        static_cast<float>(c_.v4.hc_eps);
      for (int64_t k = 0; k < H; ++k) y[k] += pre * h[i * H + k];
    }
    Norm(y.data(), H, norm.data(), eps_);
    MatVec(head, V, H, y.data(), logits.data() + s * V);
  }
  return logits;
}

}  // namespace

absl::StatusOr<std::vector<float>> DeepseekV4Logits(const ModelConfig& config,
                                                    const Checkpoint& ckpt,
                                                    const std::vector<int32_t>& ids) {
  if (config.arch != Architecture::kDeepseekV4)
    return absl::InvalidArgumentError(
        absl::StrCat("DeepseekV4Logits: model_type is ", config.model_type, ", not deepseek_v4"));
  for (int32_t id : ids)
    if (id < 0 || id >= config.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(
          "DeepseekV4Logits: token id ", id, " is outside the vocabulary of ", config.vocab_size));
  V4Forward f(config, ckpt);
  return f.Run(ids);
}

}  // namespace hmoe::cpu
