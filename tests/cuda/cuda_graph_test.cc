// The CUDA backend's graph-captured passes (CudaOptions::graphs)
// against the same passes launched kernel by kernel, on every fixture: bit
// for bit, with and without Expert Deferral, solo and batched (padded
// buckets), one graph launch per pass once captured; and the sticky-error
// path (an injected device fault), in a child process of its own since it
// spoils the CUDA context. Skips without a usable GPU.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

using testing::ArgMax;
using testing::ModelFixturesRoot;

std::unique_ptr<Model> LoadCuda(const std::string& name, bool graphs, int deferred) {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.cuda.graphs = graphs;
  o.deferred_experts = deferred;
  auto m = Model::Load(ModelFixturesRoot() + "/" + name, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CudaGraphs : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

// Three sequences: a prefill each (one of them longer than a slot pass, so
// it runs the host-copy path), then greedy steps solo and batched (3
// sequences: the 4-token bucket), every logit compared bit for bit.
TEST_P(CudaGraphs, ReplayEqualsEagerBitForBit) {
  const std::string name = GetParam();
  for (int deferred : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << name << ", deferred " << deferred);
    auto g = LoadCuda(name, true, deferred);
    auto e = LoadCuda(name, false, deferred);
    ASSERT_TRUE(g && e);
    const int64_t V = g->config().vocab_size;
    const std::vector<std::vector<int32_t>> prompts = {
        {1, 5, 17, 42, 7}, {3, 9, 1}, std::vector<int32_t>(40, 11)};
    std::vector<std::unique_ptr<Sequence>> gs, es;
    std::vector<int32_t> next;
    for (const auto& p : prompts) {
      gs.push_back(g->NewSequence());
      es.push_back(e->NewSequence());
      auto lg = g->Prefill(*gs.back(), p, LogitsMode::kLast);
      auto le = e->Prefill(*es.back(), p, LogitsMode::kLast);
      ASSERT_TRUE(lg.ok() && le.ok()) << lg.status() << " " << le.status();
      EXPECT_TRUE(SameBits(*lg, *le)) << "prefill of " << p.size() << " tokens";
      next.push_back(static_cast<int32_t>(ArgMax(le->data(), V)));
    }
    const ModelStats before = g->stats();
    int passes = 0;
    for (int step = 0; step < 6; ++step) {
      // Solo: sequence 0 (the 1-token bucket).
      auto lg = g->Decode(*gs[0], next[0]);
      auto le = e->Decode(*es[0], next[0]);
      ASSERT_TRUE(lg.ok() && le.ok()) << lg.status() << " " << le.status();
      EXPECT_TRUE(SameBits(*lg, *le)) << "solo step " << step;
      next[0] = static_cast<int32_t>(ArgMax(le->data(), V));
      ++passes;
      // Batched: all three.
      std::vector<std::vector<float>> og(3), oe(3);
      std::vector<ForwardStep> sg, se;
      for (size_t i = 0; i < 3; ++i) {
        const absl::Span<const int32_t> tok(&next[i], 1);
        sg.push_back({gs[i].get(), tok, LogitsMode::kLast, &og[i]});
        se.push_back({es[i].get(), tok, LogitsMode::kLast, &oe[i]});
      }
      ASSERT_TRUE(g->ForwardBatch(sg).ok());
      ASSERT_TRUE(e->ForwardBatch(se).ok());
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(SameBits(og[i], oe[i])) << "batched step " << step << " sequence " << i;
        next[i] = static_cast<int32_t>(ArgMax(oe[i].data(), V));
      }
      ++passes;
    }
    const ModelStats after = g->stats();
    // Every decode pass is one graph launch; the buckets (1 and 4) were
    // captured during the prefills or the first steps, so replays launch
    // nothing kernel by kernel.
    EXPECT_EQ(after.graph_launches - before.graph_launches, passes);
    EXPECT_LE(after.graph_captures, 3);
    const ModelStats e_stats = e->stats();
    EXPECT_EQ(e_stats.graph_launches, 0);
    EXPECT_EQ(e_stats.graph_captures, 0);
    std::printf(
        "[ graphs   ] %s deferred %d: %lld launches, %lld captures; %lld kernel launches "
        "in %d replayed passes\n",
        name.c_str(), deferred,
        static_cast<long long>(after.graph_launches - before.graph_launches),
        static_cast<long long>(after.graph_captures),
        static_cast<long long>(after.kernel_launches - before.kernel_launches), passes);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGraphs,
                         ::testing::ValuesIn(testing::CudaModelFixtureNames()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// An injected sticky device error (CudaOptions::debug_fault_after):
// the pass it hits fails, health() reports it from then on and every later
// pass fails with it; 0, or the number of the check that failed.
int StickyErrorScenario() {
  ModelOptions o;
  o.backend = "cuda";
  o.num_threads = 2;
  o.cuda.debug_fault_after = 2;
  auto m = Model::Load(ModelFixturesRoot() + "/qwen3_moe_tiny", o);
  if (!m.ok()) return 10;
  auto s = (*m)->NewSequence();
  const std::vector<int32_t> p{1, 2, 3};
  if (!(*m)->Prefill(*s, p).ok()) return 11;  // pass 1
  if (!(*m)->Decode(*s, 4).ok()) return 12;   // pass 2
  if (!(*m)->health().ok()) return 13;
  if ((*m)->Decode(*s, 5).ok()) return 14;  // pass 3: the fault
  if ((*m)->health().ok()) return 15;
  if ((*m)->Decode(*s, 5).ok()) return 16;  // sticky
  if (s->length() != 4) return 17;          // the failed passes left no tokens
  std::fprintf(stderr, "health: %s\n", (*m)->health().ToString().c_str());
  return 0;
}

// In a child process of its own: the error spoils the CUDA context.
TEST(CudaGraphsDeathTest, InjectedStickyErrorFailsPassesAndHealth) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(StickyErrorScenario()), ::testing::ExitedWithCode(0), "health: INTERNAL");
}

}  // namespace
}  // namespace hmoe
