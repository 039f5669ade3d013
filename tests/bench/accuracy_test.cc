// bench/accuracy.h, the library of hmoe-bench-accuracy, on a few held-out
// docs of the ds3_fortunes fixture: the exact model against itself costs
// nothing, and deferral and int4 experts (through the expert service's own
// kernels, in-process) change the numbers.
#include "bench/accuracy.h"

#include <string>
#include <vector>

#include "common/model_config.h"
#include "gpu_worker/server/local_experts.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

constexpr int kThreads = 2;

std::string Dir() { return testing::FixturesDir() + "/ds3_fortunes"; }

TEST(Accuracy, SplitDocsDropsBlankDocs) {
  EXPECT_EQ(accuracy::SplitDocs("a\n%\n \n\t\n%\nb c\n%\n"),
            (std::vector<std::string>{"a", "b c"}));
  EXPECT_EQ(accuracy::SplitDocs("one\n%\ntwo"), (std::vector<std::string>{"one", "two"}));
  EXPECT_TRUE(accuracy::SplitDocs("").empty());
}

TEST(Accuracy, StandardVariantsCarryTheIssueTargets) {
  std::vector<std::string> names;
  for (const accuracy::Variant& v : accuracy::StandardVariants()) {
    names.push_back(v.name);
    if (v.name == "deferral 2" || v.name == "int8" || v.name == "kv fp8") {
      ASSERT_TRUE(v.max_ppl_change_pct) << v.name;
      EXPECT_EQ(*v.max_ppl_change_pct, 0.5) << v.name;
    } else if (v.format == WeightFormat::kInt4) {
      ASSERT_TRUE(v.max_ppl_change_pct) << v.name;
      EXPECT_EQ(*v.max_ppl_change_pct, 3.0) << v.name;
    } else if (v.dense_weights != DenseWeights::kAuto) {
      EXPECT_FALSE(v.service_experts) << v.name;
      ASSERT_TRUE(v.max_ppl_change_pct) << v.name;
      EXPECT_EQ(*v.max_ppl_change_pct, v.dense_weights == DenseWeights::kInt4 ? 2.0 : 0.3)
          << v.name;
    } else {
      EXPECT_FALSE(v.max_ppl_change_pct) << v.name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"deferral 0", "deferral 1", "deferral 2", "deferral 3",
                                             "bf16", "int8", "int4 g32", "int4 g64", "int4 g128",
                                             "dense fp8", "dense int8", "dense int4", "kv bf16",
                                             "kv fp8"}));
  // The exact model and every row but the KV ones keep the f32 KV cache.
  EXPECT_EQ(accuracy::Variant{"exact"}.kv_dtype, KvDtype::kF32);
  for (const accuracy::Variant& v : accuracy::StandardVariants()) {
    if (v.name.rfind("kv ", 0) != 0) {
      EXPECT_EQ(v.kv_dtype, KvDtype::kF32) << v.name;
    }
  }
}

TEST(Accuracy, HandlerExpertsRefuseAnotherModelsShard) {
  auto config = LoadModelConfig(Dir());
  ASSERT_TRUE(config.ok()) << config.status();
  ShardOptions so;
  so.model_dir = Dir();
  so.threads = kThreads;
  auto shard = ExpertShard::Load(so);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_TRUE(HandlerRoutedExperts::Create(*config, shard->get()).ok());
  ModelConfig wider = *config;
  wider.moe.num_experts += 1;
  auto refused = HandlerRoutedExperts::Create(wider, shard->get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("routed experts"), std::string::npos)
      << refused.status();
}

TEST(Accuracy, ExactAgainstItselfIsZeroAndApproximationsDiffer) {
  auto tok = Tokenizer::FromFile(Dir() + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto set = accuracy::LoadEvalSet(testing::FixturesDir() + "/corpus_heldout.txt", **tok, 0, 1,
                                   /*max_docs=*/6);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->docs.size(), 6u);
  for (const auto& d : set->docs) {
    EXPECT_EQ(d.front(), 0);
    EXPECT_EQ(d.back(), 1);
  }

  auto score = [&](const accuracy::Variant& v) -> std::vector<float> {
    auto m = accuracy::LoadVariant(Dir(), v, kThreads);
    EXPECT_TRUE(m.ok()) << v.name << ": " << m.status();
    if (!m.ok()) return {};
    EXPECT_EQ(m->shard != nullptr, v.service_experts) << v.name;
    auto logits = accuracy::ScoreLogits(*m->model, *set);
    EXPECT_TRUE(logits.ok()) << v.name << ": " << logits.status();
    return logits.ok() ? *logits : std::vector<float>{};
  };
  const int64_t V = 3072;
  const std::vector<float> exact = score(accuracy::Variant{"exact"});
  ASSERT_EQ(exact.size(), static_cast<size_t>(set->scored_tokens * V));

  // A second exact model: bit for bit the same logits.
  auto same = accuracy::Compare(*set, exact, score(accuracy::Variant{"deferral 0"}), V);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->tokens, set->scored_tokens);
  EXPECT_EQ(same->mean_kl, 0.0);
  EXPECT_EQ(same->top1_agreement, 1.0);
  EXPECT_EQ(same->ppl, same->exact_ppl);
  EXPECT_EQ(same->ppl_change_pct, 0.0);
  EXPECT_GT(same->exact_ppl, 1.0);

  accuracy::Variant deferral{"deferral 2"};
  deferral.deferred_experts = 2;
  accuracy::Variant int4{"int4 g32"};
  int4.service_experts = true;
  int4.format = WeightFormat::kInt4;
  int4.group = 32;
  accuracy::Variant dense{"dense int8"};
  dense.dense_weights = DenseWeights::kInt8;
  for (const accuracy::Variant& v : {deferral, int4, dense}) {
    auto m = accuracy::Compare(*set, exact, score(v), V);
    ASSERT_TRUE(m.ok()) << v.name << ": " << m.status();
    EXPECT_EQ(m->exact_ppl, same->exact_ppl) << v.name;
    EXPECT_GT(m->mean_kl, 0.0) << v.name;
    EXPECT_NE(m->ppl, m->exact_ppl) << v.name;
    EXPECT_GT(m->top1_agreement, 0.5) << v.name;  // an approximation, not another model
    EXPECT_LE(m->top1_agreement, 1.0) << v.name;
  }

  auto short_one = accuracy::Compare(*set, exact, absl::MakeConstSpan(exact).subspan(V), V);
  EXPECT_EQ(short_one.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
