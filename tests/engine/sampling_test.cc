#include "gpu_worker/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

TEST(Sampling, GreedyAndEquivalentFilters) {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f, 2.0f};
  Sampler greedy(SamplingParams{}, 1);
  EXPECT_EQ(greedy.Sample(logits, {}, {}).value(), 1);  // tie between 1 and 4: lowest id
  logits[4] = 1.95f;                                    // no tie at the top for the filters below
  for (int i = 0; i < 20; ++i) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.top_k = 1;
    EXPECT_EQ(Sampler(p, static_cast<uint64_t>(i)).Sample(logits, {}, {}).value(), 1);
    p.top_k = 0;
    p.top_p = 1e-6f;
    EXPECT_EQ(Sampler(p, static_cast<uint64_t>(i)).Sample(logits, {}, {}).value(), 1);
    p.top_p = 1.0f;
    p.min_p = 1.0f;
    EXPECT_EQ(Sampler(p, static_cast<uint64_t>(i)).Sample(logits, {}, {}).value(), 1);
  }
}

// top_k keeps every token tied with the k-th logit, as transformers'
// TopKLogitsWarper does ({2, 1, 1}, k = 2: ids 1 and 2 each 21.2%).
TEST(Sampling, TopKKeepsTokensTiedWithTheKth) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  Sampler s(p, 11);
  std::map<int32_t, int> n;
  const int draws = 4000;
  for (int i = 0; i < draws; ++i) ++n[s.Sample({2.0f, 1.0f, 1.0f}, {}, {}).value()];
  const double want = std::exp(1.0) / (std::exp(2.0) + 2 * std::exp(1.0));
  EXPECT_NEAR(n[1] / static_cast<double>(draws), want, 0.03);
  EXPECT_NEAR(n[2] / static_cast<double>(draws), want, 0.03);
}

// With top_k the draw walks the kept tokens in descending order (ties: lower
// id), the request's RNG giving u in [0, total): a seed picks the same token
// on every platform (not in whatever order the selection left them).
TEST(Sampling, TopKDrawsInDescendingOrder) {
  const std::vector<float> logits = {0.3f, 1.2f, -0.5f, 1.2f, 0.9f, 2.0f, -1.0f, 0.1f};
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 4;
  p.has_seed = true;
  const std::vector<int32_t> order = {5, 1, 3, 4};  // the top 4, descending, ties by id
  for (uint64_t seed = 0; seed < 200; ++seed) {
    p.seed = seed;
    std::mt19937_64 rng(seed);
    double total = 0;
    std::vector<double> w;
    for (int32_t t : order) {
      w.push_back(std::exp((static_cast<double>(logits[t]) - 2.0) / static_cast<double>(0.9f)));
      total += w.back();
    }
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
    double acc = 0;
    int32_t want = order.back();
    for (size_t i = 0; i < order.size(); ++i) {
      acc += w[i];
      if (u < acc) {
        want = order[i];
        break;
      }
    }
    EXPECT_EQ(Sampler(p, 0).Sample(logits, {}, {}).value(), want) << "seed " << seed;
  }
}

// A DeepSeek-size vocabulary with a flat distribution: top_p keeps the
// smallest prefix of the descending order that reaches it (thousands of
// tokens, past the first partial sort), found here by sorting everything.
TEST(Sampling, TopPOverALargeVocabularyKeepsTheSmallestPrefix) {
  const int V = 129280;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(V);
  for (float& l : logits) l = normal(gen);
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.5f;
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  double sum = 0;
  for (float l : logits) sum += std::exp((l - logits[order[0]]) / 0.8);
  std::vector<bool> kept(V, false);
  double acc = 0;
  size_t n = 0;
  while (acc < 0.5 * sum) {
    acc += std::exp((logits[order[n]] - logits[order[0]]) / 0.8);
    kept[order[n++]] = true;
  }
  ASSERT_GT(n, 2048u) << "the case should need more than the first sorts";
  Sampler s(p, 3);
  int past_256 = 0;
  for (int i = 0; i < 300; ++i) {
    const int32_t t = s.Sample(logits, {}, {}).value();
    ASSERT_TRUE(kept[t]) << "token " << t << " is outside the top_p prefix";
    past_256 += std::find(order.begin(), order.begin() + 256, t) == order.begin() + 256;
  }
  EXPECT_GT(past_256, 100);
}

TEST(Sampling, SeedReproducesAndDiffers) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  SamplingParams p;
  p.temperature = 1.5f;
  p.has_seed = true;
  p.seed = 42;
  Sampler a(p, 0), b(p, 999);
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 200; ++i) {
    sa.push_back(a.Sample(logits, {}, {}).value());
    sb.push_back(b.Sample(logits, {}, {}).value());
  }
  EXPECT_EQ(sa, sb);  // the request's seed wins over the fallback
  p.seed = 43;
  Sampler c(p, 0);
  std::vector<int32_t> sc;
  for (int i = 0; i < 200; ++i) sc.push_back(c.Sample(logits, {}, {}).value());
  EXPECT_NE(sa, sc);
}

// Frequencies follow softmax(logits / T) restricted by top-k / top-p.
TEST(Sampling, Distribution) {
  std::vector<float> logits = {1.0f, 0.0f, -1.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0.7f;
  Sampler s(p, 7);
  std::map<int32_t, int> n;
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) ++n[s.Sample(logits, {}, {}).value()];
  double z = 0;
  for (float l : logits) z += std::exp(l / 0.7);
  for (int t = 0; t < 4; ++t) {
    const double want = std::exp(logits[static_cast<size_t>(t)] / 0.7) / z;
    EXPECT_NEAR(n[t] / static_cast<double>(draws), want, 0.01) << t;
  }
  // top_p = 0.6 keeps {0, 3} (0.50 + 0.30 >= 0.6), renormalized.
  p.top_p = 0.6f;
  Sampler q(p, 9);
  std::map<int32_t, int> m;
  for (int i = 0; i < draws; ++i) ++m[q.Sample(logits, {}, {}).value()];
  EXPECT_EQ(m.count(1) + m.count(2), 0u);
  const double p0 = std::exp(1 / 0.7), p3 = std::exp(0.5 / 0.7);
  EXPECT_NEAR(m[0] / static_cast<double>(draws), p0 / (p0 + p3), 0.01);
}

TEST(Sampling, Penalties) {
  std::vector<float> logits = {3.0f, 2.9f, -1.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;  // 3.0 -> 1.5 for a seen token
  EXPECT_EQ(Sampler(p, 0).Sample(logits, {0}, {}).value(), 1);
  p = SamplingParams{};
  p.presence_penalty = 0.5f;
  EXPECT_EQ(Sampler(p, 0).Sample(logits, {}, {0}).value(), 1);  // 3.0 - 0.5 < 2.9
  EXPECT_EQ(Sampler(p, 0).Sample(logits, {0}, {}).value(),
            0);  // prompt tokens: no presence penalty
  p = SamplingParams{};
  p.frequency_penalty = 0.06f;
  EXPECT_EQ(Sampler(p, 0).Sample(logits, {}, {0}).value(), 0);     // 3.0 - 0.06 > 2.9
  EXPECT_EQ(Sampler(p, 0).Sample(logits, {}, {0, 0}).value(), 1);  // 3.0 - 0.12 < 2.9
  p = SamplingParams{};
  p.repetition_penalty = 2.0f;  // negative logits are multiplied
  std::vector<float> neg = {-1.0f, -1.5f};
  EXPECT_EQ(Sampler(p, 0).Sample(neg, {0}, {}).value(), 1);
}

// A broken forward pass (NaN or +inf logits, or none finite) is an error
// naming the token, greedy or not (before: +inf made every probability NaN
// and the least likely kept token came out); -inf only masks a token.
TEST(Sampling, NonFiniteLogitsAreAnErrorAndMinusInfMasks) {
  const float inf = std::numeric_limits<float>::infinity();
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  SamplingParams random;
  random.temperature = 1.0f;
  for (const SamplingParams& p : {greedy, random}) {
    for (const std::vector<float>& bad :
         {std::vector<float>{inf, 0.0f, -1.0f}, std::vector<float>{0.0f, NAN, 5.0f},
          std::vector<float>{NAN, 5.0f, 1.0f}, std::vector<float>{-inf, -inf}}) {
      auto t = Sampler(p, 1).Sample(bad, {}, {});
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInternal) << t.status();
    }
    auto nan = Sampler(p, 1).Sample(std::vector<float>{0.0f, NAN, 5.0f}, {}, {});
    EXPECT_THAT(std::string(nan.status().message()), HasSubstr("token 1"));
    for (int seed = 0; seed < 50; ++seed) {
      auto t = Sampler(p, static_cast<uint64_t>(seed)).Sample({-inf, 0.5f, -inf, 0.0f}, {}, {});
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_TRUE(*t == 1 || *t == 3) << *t;
    }
  }
  // A tiny repetition penalty divides a positive logit past FLT_MAX: it is
  // clamped, not +inf, and the token stays the likeliest.
  SamplingParams tiny;
  tiny.repetition_penalty = 1e-30f;
  for (float temperature : {0.0f, 1.0f}) {
    tiny.temperature = temperature;
    auto t = Sampler(tiny, 3).Sample({1e10f, -1e30f, 0.0f}, {0}, {});
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(*t, 0);
  }
}

TEST(Sampling, Validation) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  std::vector<Case> cases(8);
  cases[0].p.temperature = NAN, cases[0].field = "temperature";
  cases[1].p.temperature = -0.1f, cases[1].field = "temperature";
  cases[2].p.top_p = 0.0f, cases[2].field = "top_p";
  cases[3].p.top_p = 1.5f, cases[3].field = "top_p";
  cases[4].p.top_k = -1, cases[4].field = "top_k";
  cases[5].p.min_p = 2.0f, cases[5].field = "min_p";
  cases[6].p.repetition_penalty = 0.0f, cases[6].field = "repetition_penalty";
  cases[7].p.presence_penalty = NAN, cases[7].field = "presence_penalty";
  for (const auto& c : cases) {
    absl::Status s = ValidateSamplingParams(c.p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
}

}  // namespace
// LogprobOf against a plain two-pass reference: log-softmax in long double
// and a full sort, on many vocabulary sizes, ties and masked tokens.
TEST(Sampling, LogprobOfMatchesAFullSortReference) {
  std::mt19937 rng(5);
  for (const size_t V :
       {size_t{1}, size_t{2}, size_t{7}, size_t{64}, size_t{1000}, size_t{32771}}) {
    for (const int top_n : {0, 1, 3, 20, 40}) {
      SCOPED_TRACE(absl::StrCat("V=", V, " top_n=", top_n));
      std::vector<float> logits(V);
      std::normal_distribution<float> nd(0.f, 4.f);
      for (float& l : logits) l = std::round(nd(rng) * 4) / 4;  // plenty of ties
      if (V > 3) logits[1] = -std::numeric_limits<float>::infinity();
      int32_t token = static_cast<int32_t>(rng() % V);
      if (V > 3 && token == 1) token = 0;  // not the masked one
      long double z = 0, m = -INFINITY;
      for (float l : logits) m = std::max<long double>(m, l);
      for (float l : logits) z += std::exp(static_cast<long double>(l) - m);
      const long double log_z = m + std::log(z);
      const TokenLogprob got = LogprobOf(logits, token, top_n);
      EXPECT_EQ(got.token, token);
      EXPECT_NEAR(got.logprob, static_cast<double>(logits[static_cast<size_t>(token)] - log_z),
                  1e-4);
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
      });
      if (V > 3) order.erase(std::find(order.begin(), order.end(), 1));  // masked
      ASSERT_EQ(got.top.size(), std::min<size_t>(static_cast<size_t>(top_n), order.size()));
      for (size_t i = 0; i < got.top.size(); ++i) {
        EXPECT_EQ(got.top[i].first, order[i]) << i;
        EXPECT_NEAR(got.top[i].second,
                    static_cast<double>(logits[static_cast<size_t>(order[i])] - log_z), 1e-4);
      }
    }
  }
}

}  // namespace hmoe
