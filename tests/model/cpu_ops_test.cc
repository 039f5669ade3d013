// Unit tests of the CPU reference backend's pieces against direct formulas.
#include <atomic>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"
#include "common/runtime/thread_pool.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/driver/routing.h"
#include "gtest/gtest.h"

namespace hmoe::cpu {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void LinearCase(int64_t T, int64_t K) {
  const int64_t N = 300;
  std::vector<float> x = Random(T * K, 1), wf = Random(N * K, 2), bias = Random(N, 3);
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wb[i] = F32ToBf16(wf[i]);
    wf[i] = Bf16ToF32(wb[i]);
  }
  Matrix mf{N, K, wf.data(), nullptr, nullptr}, mb{N, K, nullptr, wb.data(), nullptr};
  auto pool = ThreadPool::Create(UnpinnedThreads(3)).value();
  std::vector<float> yf(T * N), yb(T * N), y1(N);
  Linear(pool.get(), x.data(), T, mf, bias.data(), yf.data());
  Linear(nullptr, x.data(), T, mb, bias.data(), yb.data());
  EXPECT_EQ(yf, yb);
  for (int64_t t = 0; t < T; ++t) {
    Linear(pool.get(), x.data() + t * K, 1, mf, bias.data(), y1.data());
    for (int64_t n = 0; n < N; ++n) {
      ASSERT_EQ(y1[n], yf[t * N + n]);  // bit-identical whatever the batch
      double ref = bias[n];
      for (int64_t k = 0; k < K; ++k) ref += double(x[t * K + k]) * wf[n * K + k];
      EXPECT_NEAR(yf[t * N + n], ref, 1e-4);
    }
  }
}

// Every batch size (and K with or without a tail) gives each row the bits
// it gets alone: ForwardBatch relies on it.
TEST(Ops, LinearBf16MatchesF32AndIgnoresBatching) {
  for (const auto& [T, K] : std::vector<std::pair<int64_t, int64_t>>{
           {5, 37}, {1, 37}, {4, 64}, {9, 64}, {13, 7}, {8, 129}}) {
    SCOPED_TRACE(::testing::Message() << "T " << T << " K " << K);
    LinearCase(T, K);
  }
}

// The AVX2 and AVX-512 paths give the scalar loop's bits: bf16 and f32 weights,
// K with and without a tail, several T, with a bias and without.
TEST(Ops, LinearSimdPathsEqualScalarBitForBit) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2";
  auto two = ThreadPool::Create(UnpinnedThreads(2)).value();
  // K 4100 on one thread: several L2 row chunks (~256 KiB of weights: 12-14
  // rows f32, 28-30 bf16) in one range, each with a K tail of 4.
  for (int64_t K : {1, 7, 8, 9, 16, 37, 64, 129, 2048, 4100}) {
    ThreadPool* pool = K == 4100 ? nullptr : two.get();
    // T and N around the blocks of 2 or 4 rows x 4 tokens.
    for (int64_t T : {1, 3, 4, 5, 8, 13}) {
      SCOPED_TRACE(::testing::Message() << "K " << K << " T " << T);
      const int64_t N = 67;
      std::vector<float> x = Random(T * K, 11, 4.0f), wf = Random(N * K, 12), bias = Random(N, 13);
      std::vector<uint16_t> wb(wf.size());
      for (size_t i = 0; i < wf.size(); ++i) wb[i] = F32ToBf16(wf[i]);
      const Matrix mf{N, K, wf.data(), nullptr, nullptr}, mb{N, K, nullptr, wb.data(), nullptr};
      for (const Matrix* m : {&mf, &mb}) {
        for (const float* b :
             {static_cast<const float*>(bias.data()), static_cast<const float*>(nullptr)}) {
          std::vector<float> scalar(T * N);
          Linear(pool, x.data(), T, *m, b, scalar.data(), LinearIsa::kScalar);
          for (LinearIsa isa : {LinearIsa::kAvx2, LinearIsa::kAvx512}) {
            if (isa > BestLinearIsa()) continue;  // the test's first line covers AVX2
            std::vector<float> simd(T * N);
            Linear(pool, x.data(), T, *m, b, simd.data(), isa);
            ASSERT_EQ(simd, scalar)
                << (m == &mf ? "f32" : "bf16") << (isa == LinearIsa::kAvx2 ? " avx2" : " avx512");
          }
        }
      }
    }
  }
}

TEST(Ops, RmsNorm) {
  const int64_t n = 24;
  std::vector<float> x = Random(2 * n, 4, 3.0f), w = Random(n, 5), y(2 * n);
  RmsNorm(x.data(), 2, n, w.data(), 1e-5f, y.data());
  for (int r = 0; r < 2; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[r * n + i], w[i] * x[r * n + i] * inv, 1e-5);
  }
}

TEST(Rope, DefaultAndLinearInvFreq) {
  RopeConfig r;
  r.theta = 10000.0;
  RopeTables t = ComputeRope(r, 16);
  ASSERT_EQ(t.inv_freq.size(), 8u);
  EXPECT_EQ(t.attention_factor, 1.0f);
  for (int i = 0; i < 8; ++i)
    EXPECT_NEAR(t.inv_freq[i], std::pow(10000.0, -2.0 * i / 16),
                1e-6 * std::pow(10000.0, -2.0 * i / 16));
  r.type = RopeType::kLinear;
  r.factor = 4.0;
  RopeTables l = ComputeRope(r, 16);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(l.inv_freq[i], t.inv_freq[i] / 4.0f);
}

// YaRN (Peng et al. 2023; DeepSeek's yarn) written out directly in double.
TEST(Rope, YarnInvFreqAndAttentionFactor) {
  RopeConfig r;
  r.type = RopeType::kYarn;
  r.theta = 10000.0;
  r.factor = 40.0;
  r.original_max_position_embeddings = 4096;
  r.beta_fast = 32.0;
  r.beta_slow = 1.0;
  r.mscale = 1.0;
  r.mscale_all_dim = 0.8;
  const int d = 64;
  RopeTables t = ComputeRope(r, d);
  const double pi = std::acos(-1.0);
  auto corr = [&](double rot) {
    return d * std::log(4096 / (rot * 2 * pi)) / (2 * std::log(10000.0));
  };
  const double low = std::max(0.0, std::floor(corr(32))),
               high = std::min<double>(d - 1, std::ceil(corr(1)));
  for (int i = 0; i < d / 2; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / d);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);  // 0: keep, 1: interpolate
    const double want = base * (1 - ramp) + base / 40.0 * ramp;
    EXPECT_NEAR(t.inv_freq[i], want, 2e-6 * want) << i;
  }
  r.truncate = false;  // the correction range unrounded
  RopeTables u = ComputeRope(r, d);
  const double ulow = std::max(0.0, corr(32)), uhigh = std::min<double>(d - 1, corr(1));
  for (int i = 0; i < d / 2; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / d);
    const double ramp = std::clamp((i - ulow) / (uhigh - ulow), 0.0, 1.0);
    EXPECT_NEAR(u.inv_freq[i], base * (1 - ramp) + base / 40.0 * ramp, 2e-6 * base) << i;
  }
  r.truncate = true;
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);  // fastest dims extrapolate
  EXPECT_NEAR(t.inv_freq[d / 2 - 1], std::pow(10000.0, -2.0 * (d / 2 - 1) / d) / 40,
              1e-9);  // slowest interpolate
  const double m = 0.1 * 1.0 * std::log(40.0) + 1, mad = 0.1 * 0.8 * std::log(40.0) + 1;
  EXPECT_NEAR(t.attention_factor, m / mad, 1e-6);
  r.mscale = 0.0;  // mscale absent: get_mscale(factor) alone, whatever mscale_all_dim
  EXPECT_NEAR(ComputeRope(r, d).attention_factor, m, 1e-6);
  r.mscale = 1.0;
  r.mscale_all_dim = 0.0;  // mscale_all_dim absent: likewise
  EXPECT_NEAR(ComputeRope(r, d).attention_factor, m, 1e-6);
  r.attention_factor = 0.5;  // explicit value wins
  EXPECT_FLOAT_EQ(ComputeRope(r, d).attention_factor, 0.5f);
  EXPECT_DOUBLE_EQ(YarnGetMscale(1.0, 3.0), 1.0);
}

TEST(Rope, LayoutsAgreeAndDependOnRelativePosition) {
  RopeConfig r;
  RopeTables t = ComputeRope(r, 8);
  std::vector<float> cs(8);
  RopeCosSin(t, 5, cs.data());
  // Interleaved pairs (x0, x1) are the complex number x0 + i x1 times e^{i pos f}.
  std::vector<float> x = Random(8, 6), halves(8), inter = x;
  for (int i = 0; i < 4; ++i) {
    halves[i] = x[2 * i];
    halves[i + 4] = x[2 * i + 1];
  }
  ApplyRope(inter.data(), 8, cs.data(), RopeLayout::kInterleaved);
  ApplyRope(halves.data(), 8, cs.data(), RopeLayout::kHalves);
  for (int i = 0; i < 4; ++i) {
    const double a = 5.0 * t.inv_freq[i];
    EXPECT_NEAR(inter[2 * i], x[2 * i] * std::cos(a) - x[2 * i + 1] * std::sin(a), 1e-5);
    EXPECT_NEAR(inter[2 * i + 1], x[2 * i] * std::sin(a) + x[2 * i + 1] * std::cos(a), 1e-5);
    EXPECT_FLOAT_EQ(halves[i], inter[2 * i]);
    EXPECT_FLOAT_EQ(halves[i + 4], inter[2 * i + 1]);
  }
  // q(m) . k(n) depends on m - n only.
  std::vector<float> q = Random(8, 7), k = Random(8, 8);
  auto dot_at = [&](int m, int n) {
    std::vector<float> a = q, b = k, c1(8), c2(8);
    RopeCosSin(t, m, c1.data());
    RopeCosSin(t, n, c2.data());
    ApplyRope(a.data(), 8, c1.data(), RopeLayout::kHalves);
    ApplyRope(b.data(), 8, c2.data(), RopeLayout::kHalves);
    return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
  };
  EXPECT_NEAR(dot_at(7, 3), dot_at(104, 100), 1e-4);
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// DeepSeek-V3 noaux_tc: groups ranked by the sum of their top-2 biased scores,
// experts chosen by biased score, weighted by the unbiased sigmoid score.
TEST(Gate, NoauxTcGroupLimitedWithSelectionOnlyBias) {
  GateSpec g;
  g.num_experts = 8;
  g.top_k = 2;
  g.kind = RouterKind::kSigmoidGroupedTopk;
  g.method = TopkMethod::kNoauxTc;
  g.n_group = 4;
  g.topk_group = 2;
  g.norm_topk_prob = true;
  g.norm_eps = 1e-20f;
  g.routed_scaling_factor = 2.5f;
  const std::vector<float> logits{2.0f, -1.0f, 1.5f, 1.4f, -2.0f, -2.0f, 0.0f, 0.1f};
  int32_t ids[2];
  float w[2];
  // No bias: groups {2,3} (1.62) and {0,1} (1.15) win; experts 0 and 2.
  Route(g, logits.data(), 1, nullptr, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 2);
  const float s0 = Sigmoid(2.0f), s2 = Sigmoid(1.5f);
  EXPECT_FLOAT_EQ(w[0], s0 / (s0 + s2) * 2.5f);
  // Bias lifts expert 7: group {6,7} (1.525) beats {0,1}; expert 0, the best
  // raw score, is out with its group; 7's weight is its unbiased score.
  const std::vector<float> bias{0, 0, 0, 0, 0, 0, 0, 0.5f};
  Route(g, logits.data(), 1, bias.data(), ids, w);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 2);
  const float s7 = Sigmoid(0.1f);
  EXPECT_FLOAT_EQ(w[0], s7 / (s7 + s2) * 2.5f);
  EXPECT_FLOAT_EQ(w[1], s2 / (s7 + s2) * 2.5f);
  // Without the group limit the raw winner comes back.
  g.topk_group = 4;
  Route(g, logits.data(), 1, bias.data(), ids, w);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 0);
}

// DeepSeek-V2 group_limited_greedy: groups ranked by their max softmax score;
// weights not normalized, scaled.
TEST(Gate, GroupLimitedGreedyUsesGroupMax) {
  GateSpec g;
  g.num_experts = 6;
  g.top_k = 2;
  g.method = TopkMethod::kGroupLimitedGreedy;
  g.n_group = 3;
  g.topk_group = 1;
  g.routed_scaling_factor = 1.75f;
  const std::vector<float> logits{3.0f, -5.0f, 2.5f, 2.4f, 0.0f, 0.0f};
  std::vector<double> p(6);
  double sum = 0;
  for (int i = 0; i < 6; ++i) sum += (p[i] = std::exp(double(logits[i])));
  for (auto& v : p) v /= sum;
  int32_t ids[2];
  float w[2];
  Route(g, logits.data(), 1, nullptr, ids, w);
  EXPECT_EQ(ids[0], 0);  // group {0,1} has the max (3.0) although {2,3} has the larger sum
  EXPECT_EQ(ids[1], 1);
  EXPECT_NEAR(w[0], p[0] * 1.75, 1e-6);
  EXPECT_NEAR(w[1], p[1] * 1.75, 1e-9);
}

TEST(Gate, SoftmaxTopkRenormalized) {
  GateSpec g;
  g.num_experts = 4;
  g.top_k = 2;
  g.norm_topk_prob = true;
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 1.0f, /*token 2*/ 1.0f, 1.0f, 3.0f, -2.0f};
  int32_t ids[4];
  float w[4];
  Route(g, logits.data(), 2, nullptr, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_NEAR(w[0], std::exp(2.0) / (std::exp(2.0) + std::exp(1.0)), 1e-6);
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
  EXPECT_EQ(ids[2], 2);
  EXPECT_EQ(ids[3], 0);  // tie between experts 0 and 1: the lower id
}

TEST(Gate, SpecPerArchitecture) {
  ModelConfig c;
  c.moe.num_experts = 8;
  c.moe.experts_per_token = 2;
  c.moe.norm_topk_prob = true;
  c.moe.routed_scaling_factor = 2.0;
  c.moe.n_group = 2;
  c.moe.topk_group = 1;
  c.moe.topk_method = TopkMethod::kGroupLimitedGreedy;
  c.arch = Architecture::kDeepseekV2;
  GateSpec v2 = GateSpecFor(c);
  EXPECT_FALSE(v2.norm_topk_prob);  // transformers' V2 never renormalizes
  EXPECT_EQ(v2.kind, RouterKind::kSoftmaxTopk);
  EXPECT_EQ(v2.routed_scaling_factor, 2.0f);
  c.arch = Architecture::kDeepseekV3;
  GateSpec v3 = GateSpecFor(c);
  EXPECT_EQ(v3.kind, RouterKind::kSigmoidGroupedTopk);
  EXPECT_EQ(v3.method, TopkMethod::kNoauxTc);
  EXPECT_TRUE(v3.norm_topk_prob);
  EXPECT_EQ(v3.norm_eps, 1e-20f);
  c.arch = Architecture::kMixtral;
  GateSpec mx = GateSpecFor(c);
  EXPECT_TRUE(mx.norm_topk_prob);
  EXPECT_EQ(mx.routed_scaling_factor, 1.0f);
  EXPECT_EQ(mx.n_group, 1);
}

TEST(Attention, SlidingWindowSeesOnlyTheLastWindowKeys) {
  EXPECT_TRUE(Visible(9, 9, 3));
  EXPECT_TRUE(Visible(9, 7, 3));
  EXPECT_FALSE(Visible(9, 6, 3));
  EXPECT_FALSE(Visible(5, 6, 0));
  EXPECT_TRUE(Visible(9, 0, 0));
  const int64_t S = 10, d = 6, W = 3;
  std::vector<float> q = Random(d, 9), k = Random(S * d, 10), v = Random(S * d, 11);
  std::vector<float> scores(S), windowed(d), truncated(d), full(d);
  AttendOne(q.data(), d, k.data(), d, v.data(), d, d, S - 1, W, 0.5f, scores.data(),
            windowed.data());
  // Same as full causal attention over only the last W keys.
  AttendOne(q.data(), d, k.data() + (S - W) * d, d, v.data() + (S - W) * d, d, d, W - 1, 0, 0.5f,
            scores.data(), truncated.data());
  AttendOne(q.data(), d, k.data(), d, v.data(), d, d, S - 1, 0, 0.5f, scores.data(), full.data());
  for (int i = 0; i < d; ++i) EXPECT_FLOAT_EQ(windowed[i], truncated[i]);
  EXPECT_NE(windowed, full);
  // A direct softmax.
  double p[3], z = 0;
  for (int s = 0; s < 3; ++s) {
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += double(q[i]) * k[(S - W + s) * d + i];
    z += (p[s] = std::exp(0.5 * dot));
  }
  for (int i = 0; i < d; ++i) {
    double o = 0;
    for (int s = 0; s < 3; ++s) o += p[s] / z * v[(S - W + s) * d + i];
    EXPECT_NEAR(windowed[i], o, 1e-5);
  }
}

}  // namespace
}  // namespace hmoe::cpu
