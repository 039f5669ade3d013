// The routing kernels (gpu_worker/cuda/router_kernels.h): router top-k and Expert Deferral's split,
// against a plain CPU reference (hmoe::cpu ops where one exists, a scalar loop here otherwise), on
// many shapes, odd ones included. Skips without a usable CUDA device.
#include "gpu_worker/cuda/router_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_worker/driver/routing.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

// Scalar reference of hmoe::Route's semantics for one token.
void RouteRef(const RouteParams& p, const float* l, const float* bias, int32_t* ids, float* w) {
  const int E = p.num_experts, K = p.top_k, G = std::max(1, p.n_group), per = E / G;
  std::vector<float> scores(E), choice(E);
  if (p.sigmoid) {
    for (int e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
  } else {
    const float mx = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += (scores[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) scores[e] /= sum;
  }
  for (int e = 0; e < E; ++e) choice[e] = scores[e] + (bias ? bias[e] : 0.0f);
  // Descending by value, ties to the lower index.
  const auto before = [](const std::vector<float>& v) {
    return [&v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  std::vector<char> allowed(E, 1);
  if (p.method != 0 && G > 1) {
    std::vector<float> gs(G);
    for (int g = 0; g < G; ++g) {
      std::vector<float> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(c.begin(), c.end(), std::greater<float>());
      gs[g] = p.method == 2 ? c[0] + (per > 1 ? c[1] : -INFINITY) : c[0];
    }
    std::vector<int> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), before(gs));
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int i = 0; i < p.topk_group; ++i)
      for (int e = order[i] * per; e < (order[i] + 1) * per; ++e) allowed[e] = 1;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) cand.push_back(e);
  std::sort(cand.begin(), cand.end(), before(choice));
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += scores[cand[k]];
  for (int k = 0; k < K; ++k) {
    ids[k] = cand[k];
    w[k] = scores[cand[k]];
    if (p.norm) w[k] /= (sum + p.norm_eps);
    w[k] *= p.scale;
  }
}

void CheckRoute(const RouteParams& p, const std::vector<float>& logits,
                const std::vector<float>& bias, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t T = static_cast<int64_t>(logits.size()) / p.num_experts;
  DeviceBuffer<float> dl(logits), db(bias.empty() ? std::vector<float>{0.0f} : bias);
  DeviceBuffer<int32_t> dids(T * p.top_k);
  DeviceBuffer<float> dw(T * p.top_k);
  Check(RouteTokens(dl.get(), T, p, bias.empty() ? nullptr : db.get(), dids.get(), dw.get(),
                    nullptr));
  const std::vector<int32_t> ids = dids.Download();
  const std::vector<float> w = dw.Download();
  std::vector<int32_t> want_ids(T * p.top_k);
  std::vector<float> want_w(T * p.top_k);
  for (int64_t t = 0; t < T; ++t)
    RouteRef(p, logits.data() + t * p.num_experts, bias.empty() ? nullptr : bias.data(),
             want_ids.data() + t * p.top_k, want_w.data() + t * p.top_k);
  for (int64_t i = 0; i < T * p.top_k; ++i) {
    ASSERT_EQ(ids[i], want_ids[i]) << "token " << i / p.top_k << " slot " << i % p.top_k;
    ASSERT_NEAR(w[i], want_w[i], 1e-6 * std::fabs(want_w[i]))
        << "token " << i / p.top_k << " slot " << i % p.top_k;
  }
}

TEST(GpuKernelTest, RouteTokens) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  struct Cfg {
    int E, K, method, G, TG;
    bool norm;
    float eps, scale;
    bool use_bias;
  };
  const std::vector<Cfg> cfgs = {
      {8, 2, 0, 1, 1, true, 0.0f, 1.0f, false},       // mixtral
      {128, 8, 0, 1, 1, false, 0.0f, 1.0f, false},    // qwen3 un-normalized
      {128, 8, 0, 1, 1, true, 0.0f, 1.0f, true},      // greedy + bias
      {512, 10, 0, 1, 1, true, 0.0f, 1.0f, false},    // wide
      {160, 6, 1, 8, 3, false, 0.0f, 16.0f, false},   // deepseek-v2
      {64, 6, 1, 8, 3, true, 1e-20f, 1.0f, true},     // group limited + bias
      {256, 8, 2, 8, 4, true, 1e-20f, 2.5f, true},    // deepseek-v3
      {512, 16, 2, 16, 4, true, 1e-20f, 1.5f, true},  // max sizes
      {33, 5, 2, 3, 2, false, 0.0f, 1.0f, true},      // E not a multiple of G
      {16, 1, 1, 16, 1, false, 0.0f, 1.0f, false},    // one expert per group
      {7, 7, 0, 1, 1, true, 0.0f, 1.0f, false},       // K == E
  };
  for (const Cfg& c : cfgs) {
    for (bool sigmoid : {false, true}) {
      RouteParams p;
      p.num_experts = c.E;
      p.top_k = c.K;
      p.sigmoid = sigmoid;
      p.method = c.method;
      p.n_group = c.G;
      p.topk_group = c.TG;
      p.norm = c.norm;
      p.norm_eps = c.eps;
      p.scale = c.scale;
      for (int64_t T : {1, 3, 17, 300}) {
        std::normal_distribution<float> nd(0.0f, 2.0f);
        std::vector<float> logits(T * c.E);
        for (float& x : logits) x = nd(rng);
        const std::vector<float> bias =
            c.use_bias ? Random(c.E, rng, -0.1f, 0.1f) : std::vector<float>();
        CheckRoute(p, logits, bias,
                   "E " + std::to_string(c.E) + " K " + std::to_string(c.K) + " method " +
                       std::to_string(c.method) + " sigmoid " + std::to_string(sigmoid) + " T " +
                       std::to_string(T));
      }
    }
  }
}

TEST(GpuKernelTest, RouteTokensTiesGoToLowerIndex) {
  SKIP_WITHOUT_GPU();
  for (bool sigmoid : {false, true}) {
    RouteParams p;
    p.num_experts = 16;
    p.top_k = 4;
    p.sigmoid = sigmoid;
    // All equal except expert 9: 9 first, then 0, 1, 2.
    std::vector<float> logits(16, 0.5f);
    logits[9] = 1.0f;
    DeviceBuffer<float> dl(logits);
    DeviceBuffer<int32_t> dids(4);
    DeviceBuffer<float> dw(4);
    Check(RouteTokens(dl.get(), 1, p, nullptr, dids.get(), dw.get(), nullptr));
    EXPECT_EQ(dids.Download(), (std::vector<int32_t>{9, 0, 1, 2}));
    CheckRoute(p, logits, {}, "tie greedy");

    // Groups of 4 all tied: noaux_tc and group_limited_greedy keep groups 0, 1.
    for (int method : {1, 2}) {
      p.method = method;
      p.n_group = 4;
      p.topk_group = 2;
      std::vector<float> flat(16, 0.25f);
      flat[14] = 0.75f;  // group 3 wins; then group 0 by the tie
      Check(RouteTokens(DeviceBuffer<float>(flat).get(), 1, p, nullptr, dids.get(), dw.get(),
                        nullptr));
      EXPECT_EQ(dids.Download(), (std::vector<int32_t>{14, 0, 1, 2})) << "method " << method;
      CheckRoute(p, flat, {}, "tie groups method " + std::to_string(method));
    }
  }
}

// Expert Deferral's split against the driver's (hmoe::SplitDeferred), with
// ties (repeated weights) that the later slot must win, on odd shapes.
TEST(GpuKernelTest, SplitDeferred) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  for (int64_t T : {1, 3, 32, 77}) {
    for (int64_t K : {2, 6, 8}) {
      for (int64_t n = 0; n < K; ++n) {
        SCOPED_TRACE(::testing::Message() << "T " << T << " K " << K << " n " << n);
        std::vector<int32_t> ids(T * K);
        std::vector<float> w(T * K);
        std::uniform_int_distribution<int> id(0, 255), tie(0, 3);
        for (int64_t i = 0; i < T * K; ++i) {
          ids[i] = id(rng);
          // Few distinct weights: many ties.
          w[i] = 0.125f * static_cast<float>(tie(rng));
        }
        std::vector<int32_t> want_now(T * (K - n)), want_later(T * n);
        std::vector<float> want_wn(T * (K - n)), want_wl(T * n);
        hmoe::SplitDeferred(ids.data(), w.data(), T, K, n, want_now.data(), want_wn.data(),
                            want_later.data(), want_wl.data());
        DeviceBuffer<int32_t> di(ids), dn(T * (K - n)), dl(std::max<int64_t>(1, T * n));
        DeviceBuffer<float> dw(w), dwn(T * (K - n)), dwl(std::max<int64_t>(1, T * n));
        Check(SplitDeferred(di.get(), dw.get(), T, K, n, dn.get(), dwn.get(), dl.get(), dwl.get(),
                            nullptr));
        EXPECT_EQ(dn.Download(), want_now);
        EXPECT_EQ(dwn.Download(), want_wn);
        if (n > 0) {
          EXPECT_EQ(dl.Download(), want_later);
          EXPECT_EQ(dwl.Download(), want_wl);
        }
      }
    }
  }
  EXPECT_EQ(SplitDeferred(nullptr, nullptr, 4, 4, 4, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(SplitDeferred(nullptr, nullptr, 0, 4, 1, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaSuccess);
}

}  // namespace
}  // namespace hmoe::cuda
