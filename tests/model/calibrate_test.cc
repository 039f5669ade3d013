// CalibrateRouting (gpu_worker/calibrate.h): a prompts file run through a
// model leaves routing counts of exactly its tokens, from which a placement
// can be planned; bad files are refused naming the file (and the line).
#include "gpu_worker/calibrate.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/expert_placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

class CalibrateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::ModelFixturesRoot() + "/ds3_fortunes";
    auto tok = Tokenizer::FromFile(dir + "/tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
    ModelOptions o;
    o.num_threads = 2;
    o.max_seq_len = 24;  // the long line below is cut
    auto m = Model::Load(dir, o);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_.file(name);
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tok_;
  std::unique_ptr<Model> model_;
};

TEST_F(CalibrateTest, CountsExactlyThePromptsTokens) {
  const std::vector<std::string> lines = {
      "A fortune a day keeps the doctor away.", "You will meet a tall stranger.",
      "Patience is a virtue, and virtue is its own reward; the reward of patience is a longer "
      "line than the context holds, so it is cut."};
  int64_t expect_tokens = 0, expect_cut = 0;
  for (const std::string& l : lines) {
    auto ids = tok_->Encode(l, true);
    ASSERT_TRUE(ids.ok());
    const int64_t n = static_cast<int64_t>(ids->size());
    expect_tokens += std::min<int64_t>(n, 24);
    expect_cut += n > 24;
  }
  ASSERT_EQ(expect_cut, 1) << "the third line should exceed the 24-token context";
  const std::string path =
      Write("prompts.txt", lines[0] + "\n\n" + lines[1] + "\r\n" + lines[2] + "\n");
  auto r = CalibrateRouting(*model_, *tok_, path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompts, 3);
  EXPECT_EQ(r->tokens, expect_tokens);
  EXPECT_EQ(r->truncated, 1);
  const ModelConfig& c = model_->config();
  ASSERT_EQ(static_cast<int64_t>(r->routing.layers.size()), c.num_moe_layers());
  for (const RoutingTable::Layer& l : r->routing.layers) {
    uint64_t sum = 0;
    for (uint64_t n : l.tokens) sum += n;
    EXPECT_EQ(sum, static_cast<uint64_t>(expect_tokens * c.moe.experts_per_token)) << l.layer;
  }
  // The counts plan a placement: a budget of two experts takes two.
  PlacementOptions plo;
  plo.expert_bytes = 1000;
  plo.budget_bytes = 2000;
  auto p = PlanPlacement(r->routing, c, plo);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_hot, 2);
  EXPECT_GT(p->hot_fraction, 0);
}

TEST_F(CalibrateTest, BadFilesAreRefusedNamingTheFileAndLine) {
  const std::string missing = dir_.file("none.txt");
  auto r = CalibrateRouting(*model_, *tok_, missing);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(missing));

  const std::string empty = Write("empty.txt", "\n\n\r\n");
  r = CalibrateRouting(*model_, *tok_, empty);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(empty + ": no prompt"));

  const std::string bad = Write("bad.txt", "fine\nnot \xff utf-8\n");
  r = CalibrateRouting(*model_, *tok_, bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(bad + ":2:"));
}

}  // namespace
}  // namespace hmoe
