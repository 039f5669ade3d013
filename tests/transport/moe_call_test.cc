// ShardInfo comparison for a shard that restarted under a connected worker;
// ValidateMoeCall's expert ids (kNoExpert, an empty slot, is accepted);
// CheckServesModel, what both the pool and the in-process handler check.
#include "common/transport/moe_call.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

ShardInfo Served() {
  ShardInfo s;
  s.model_type = "deepseek_v3";
  s.hidden = 7168;
  s.intermediate = 2048;
  s.num_experts = 256;
  s.top_k = 8;
  s.moe_layers = {3, 4, 5};
  s.shard_index = 1;
  s.num_shards = 2;
  s.split = SplitMode::kEp;
  s.expert_begin = 128;
  s.expert_end = 256;
  s.i_begin = 0;
  s.i_end = 2048;
  s.max_tokens = 8192;
  s.weight_format = "int8";
  s.conversion_id = "c1";
  s.source_fingerprint = "f1";
  s.pid = 100;
  return s;
}

TEST(ServedDifference, SameServiceRestartedIsNoDifference) {
  ShardInfo now = Served();
  now.pid = 200;           // a new process
  now.max_tokens = 16384;  // takes more than before: no caller breaks
  now.shm_available = !now.shm_available;
  now.ucx_available = !now.ucx_available;
  EXPECT_EQ(ServedDifference(Served(), now), "");
  // Packed files from before fingerprints and conversion ids were recorded:
  // unknown, not another checkpoint (ExpertPool::Connect takes them so too).
  ShardInfo old = Served();
  old.source_fingerprint.clear();
  old.conversion_id.clear();
  EXPECT_EQ(ServedDifference(Served(), old), "");
  EXPECT_EQ(ServedDifference(old, Served()), "");
}

TEST(ServedDifference, NamesTheFirstDifference) {
  const ShardInfo was = Served();
  struct Case {
    void (*change)(ShardInfo&);
    std::string want;
  };
  const Case cases[] = {
      {[](ShardInfo& s) { s.shard_index = 0; }, "shard 0/2 (was 1/2)"},
      {[](ShardInfo& s) { s.num_shards = 4; }, "shard 1/4 (was 1/2)"},
      {[](ShardInfo& s) { s.model_type = "qwen3_moe"; }, "model type qwen3_moe (was deepseek_v3)"},
      {[](ShardInfo& s) { s.hidden = 4096; }, "hidden size 4096 (was 7168)"},
      {[](ShardInfo& s) { s.intermediate = 1024; }, "expert intermediate size 1024 (was 2048)"},
      {[](ShardInfo& s) { s.num_experts = 160; }, "routed experts 160 (was 256)"},
      {[](ShardInfo& s) { s.top_k = 6; }, "top-k 6 (was 8)"},
      {[](ShardInfo& s) {
         s.moe_layers = {3, 5};
       },
       "MoE layers 3,5 (was 3,4,5)"},
      {[](ShardInfo& s) { s.split = SplitMode::kTp; }, "split tp (was ep)"},
      {[](ShardInfo& s) { s.expert_begin = 0; },
       "experts [0, 256), intermediate [0, 2048) (was [128, 256), [0, 2048))"},
      {[](ShardInfo& s) { s.i_end = 1024; },
       "experts [128, 256), intermediate [0, 1024) (was [128, 256), [0, 2048))"},
      {[](ShardInfo& s) { s.weight_format = "bf16"; }, "weight format bf16 (was int8)"},
      {[](ShardInfo& s) { s.max_tokens = 4096; }, "max tokens per call 4096 (was 8192)"},
      {[](ShardInfo& s) { s.source_fingerprint = "f2"; },
       "routed experts of another checkpoint (fingerprint f2, was f1)"},
      {[](ShardInfo& s) { s.conversion_id = "c2"; },
       "packed files of another conversion (c2, was c1)"},
      // Several at once: the first in the order above.
      {[](ShardInfo& s) {
         s.weight_format = "bf16";
         s.hidden = 4096;
       },
       "hidden size 4096 (was 7168)"},
  };
  for (const Case& c : cases) {
    ShardInfo now = was;
    c.change(now);
    EXPECT_EQ(ServedDifference(was, now), c.want);
  }
}

TEST(ValidateMoeCall, EmptySlotsAreValidOtherNegativeIdsAreNot) {
  const ShardInfo info = Served();
  const std::vector<uint16_t> hidden(2 * 7168, 0);
  std::vector<int32_t> ids = {kNoExpert, 5, 255, kNoExpert};
  const std::vector<float> w = {0.5f, 0.5f, 0.25f, 0.75f};
  MoeCall call = MoeCall::Make(3, 2, 2, 7168, hidden.data(), ids.data(), w.data());
  EXPECT_TRUE(ValidateMoeCall(info, call).ok());
  ids[1] = -2;
  absl::Status st = ValidateMoeCall(info, call);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expert_ids[1]: -2"), absl::string_view::npos) << st;
  ids[1] = 256;
  EXPECT_EQ(ValidateMoeCall(info, call).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckServesModel, NamesWhatDiffers) {
  auto c = LoadModelConfig(testing::FixturesDir() + "/deepseek_v3_tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  ShardInfo m;
  m.hidden = c->hidden_size;
  m.num_experts = c->moe.num_experts;
  m.intermediate = c->moe.intermediate_size;
  m.top_k = c->moe.experts_per_token;
  for (int l = 0; l < c->num_layers; ++l)
    if (c->layers[static_cast<size_t>(l)].moe) m.moe_layers.push_back(l);
  EXPECT_TRUE(CheckServesModel(m, *c, "expert service").ok());
  ShardInfo more = m;
  more.top_k += 2;  // a larger top-k is served too
  EXPECT_TRUE(CheckServesModel(more, *c, "expert service").ok());
  struct Case {
    void (*edit)(ShardInfo&);
    const char* says;
  };
  for (const Case& k : {
           Case{[](ShardInfo& s) { s.hidden += 1; },
                "expert service serves a different model: hidden size"},
           Case{[](ShardInfo& s) { s.num_experts += 1; }, "routed experts"},
           Case{[](ShardInfo& s) { s.intermediate += 8; }, "expert intermediate size"},
           Case{[](ShardInfo& s) { s.top_k -= 1; }, "top-k"},
           Case{[](ShardInfo& s) { s.moe_layers.pop_back(); },
                "expert service does not serve MoE layer"},
       }) {
    ShardInfo bad = m;
    k.edit(bad);
    const absl::Status st = CheckServesModel(bad, *c, "expert service");
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << k.says;
    EXPECT_NE(st.message().find(k.says), absl::string_view::npos) << st;
  }
}

}  // namespace
}  // namespace hmoe
