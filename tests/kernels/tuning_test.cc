// Kernel tuning as a typed option: parsing from the environment, validation,
// the log string, RunMoe's use of it (rejects invalid settings, profiles into
// the workspace). That every valid setting computes the same numbers is
// moe_test.cc's AmxEmulationTuningTest.
#include "expert_service/kernels/tuning.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "expert_service/kernels/moe.h"
#include "moe_test_util.h"

namespace hmoe {
namespace {

using testing::RandomBatch;
using testing::RandomSource;
using testing::SharedPool;

using Env = std::map<std::string, std::string>;

absl::StatusOr<KernelTuning> FromEnv(const Env& env) {
  return KernelTuningFromEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(KernelTuningTest, DefaultsAreValidAndPrintAsNothing) {
  const KernelTuning d;
  EXPECT_TRUE(ValidateKernelTuning(d).ok());
  EXPECT_EQ(KernelTuningToString(d), "");
  auto t = FromEnv({});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(KernelTuningToString(*t), "");
}

TEST(KernelTuningTest, EveryVariableReachesItsField) {
  // One non-default valid value per variable; each must show in the string
  // (so it was stored) and change exactly one setting.
  const Env values = {
      {"HMOE_AMX_KC_BYTES", "512"},    {"HMOE_AMX_PREFETCH", "0"},    {"HMOE_AMX_ORDER", "0"},
      {"HMOE_AMX_STREAM", "0"},        {"HMOE_AMX_TAIL16", "0"},      {"HMOE_AMX_ORDER0_ROWS", "0"},
      {"HMOE_AMX_I4_STAGE", "0"},      {"HMOE_FEW_PF_I4", "0"},       {"HMOE_FEW_PF_I8", "4096"},
      {"HMOE_FEW_PF_BF16", "64"},      {"HMOE_MOE_TASK_PANELS", "4"}, {"HMOE_MOE_LOOKAHEAD", "0"},
      {"HMOE_MOE_GATHER_STREAM", "0"}, {"HMOE_PROFILE", "1"},
  };
  ASSERT_EQ(values.size(), KernelTuningVariables().size()) << "a variable without a case here";
  for (const std::string& name : KernelTuningVariables()) {
    ASSERT_EQ(values.count(name), 1u) << name;
    auto t = FromEnv({{name, values.at(name)}});
    ASSERT_TRUE(t.ok()) << name << ": " << t.status();
    EXPECT_EQ(KernelTuningToString(*t), name + "=" + values.at(name));
  }
  auto all = FromEnv(values);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->amx.kc_bytes, 512);
  EXPECT_FALSE(all->amx.prefetch);
  EXPECT_EQ(all->amx.order, 0);
  EXPECT_FALSE(all->amx.stream);
  EXPECT_FALSE(all->amx.tail16);
  EXPECT_EQ(all->amx.order0_rows, 0);
  EXPECT_FALSE(all->amx.i4_stage);
  EXPECT_EQ(all->few.pf_i4, 0);
  EXPECT_EQ(all->few.pf_i8, 4096);
  EXPECT_EQ(all->few.pf_bf16, 64);
  EXPECT_EQ(all->moe.task_panels, 4);
  EXPECT_FALSE(all->moe.lookahead);
  EXPECT_FALSE(all->moe.gather_stream);
  EXPECT_TRUE(all->moe.profile);
  EXPECT_TRUE(ValidateKernelTuning(*all).ok());
}

TEST(KernelTuningTest, BadValuesNameTheVariable) {
  struct Case {
    const char* name;
    const char* value;
    const char* want;  // in the message
  };
  const Case cases[] = {
      {"HMOE_AMX_KC_BYTES", "300", "power of two from 256 to 4096"},
      {"HMOE_AMX_KC_BYTES", "128", "power of two"},
      {"HMOE_AMX_KC_BYTES", "8192", "power of two"},
      {"HMOE_AMX_STREAM", "2", "0 or 1"},
      {"HMOE_AMX_STREAM", "yes", "0 or 1"},
      {"HMOE_AMX_TAIL16", "", "0 or 1"},
      {"HMOE_AMX_ORDER0_ROWS", "513", "from 0 to 512"},
      {"HMOE_FEW_PF_I8", "70000", "from 0 to 65536"},
      {"HMOE_FEW_PF_BF16", "12x", "from 0 to 65536"},
      {"HMOE_FEW_PF_I4", "99999999999999999999", "from 0 to 65536"},
      {"HMOE_MOE_TASK_PANELS", "5", "even number from 2 to 32"},
      {"HMOE_MOE_TASK_PANELS", "34", "even number"},
      {"HMOE_PROFILE", "on", "0 or 1"},
  };
  for (const Case& c : cases) {
    auto t = FromEnv({{c.name, c.value}});
    ASSERT_FALSE(t.ok()) << c.name << "=" << c.value;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(t.status().message());
    EXPECT_NE(msg.find(std::string(c.name) + "=\"" + c.value + "\""), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.want), std::string::npos) << msg;
  }
}

TEST(KernelTuningTest, ValidateNamesTheField) {
  KernelTuning t;
  t.moe.task_panels = 3;
  absl::Status s = ValidateKernelTuning(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("HMOE_MOE_TASK_PANELS is 3"), absl::string_view::npos) << s;
  t = KernelTuning();
  t.amx.kc_bytes = 100;
  s = ValidateKernelTuning(t);
  EXPECT_NE(s.message().find("HMOE_AMX_KC_BYTES is 100"), absl::string_view::npos) << s;
  t = KernelTuning();
  t.amx.order0_rows = -1;
  EXPECT_FALSE(ValidateKernelTuning(t).ok());
  t = KernelTuning();
  t.few.pf_bf16 = -64;
  EXPECT_FALSE(ValidateKernelTuning(t).ok());
  for (int64_t kc : {0, 256, 512, 1024, 2048, 4096}) {
    t = KernelTuning();
    t.amx.kc_bytes = kc;
    EXPECT_TRUE(ValidateKernelTuning(t).ok()) << kc;
  }
}

TEST(KernelTuningTest, RunMoeRejectsInvalidTuning) {
  auto src = RandomSource(64, 32, 2, 3);
  auto L = Pack(src, {}, SharedPool()).value();
  auto ws = MoeWorkspace::Create(L, 4, 2, SharedPool()).value();
  auto b = RandomBatch(4, 2, 64, 2, 1);
  std::vector<float> out(4 * 64);
  RunOptions ro;
  ro.tuning.moe.task_panels = 0;
  absl::Status s = RunMoe(L, b.input(), out.data(), SharedPool(), *ws, ro);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("HMOE_MOE_TASK_PANELS"), absl::string_view::npos) << s;
  MoeInput empty = b.input();
  empty.tokens = 0;
  EXPECT_EQ(RunMoe(L, empty, out.data(), SharedPool(), *ws, ro).code(),
            absl::StatusCode::kInvalidArgument)
      << "rejected with no tokens too";
}

// The profile lives in the workspace: counted only for calls with
// MoeTuning::profile, taken and reset by TakeProfile, apart per workspace.
TEST(KernelTuningTest, ProfileAccumulatesPerWorkspace) {
  auto src = RandomSource(64, 32, 4, 5);
  auto L = Pack(src, {}, SharedPool()).value();
  auto ws1 = MoeWorkspace::Create(L, 40, 2, SharedPool()).value();
  auto ws2 = MoeWorkspace::Create(L, 40, 2, SharedPool()).value();
  auto b = RandomBatch(40, 2, 64, 4, 9);
  std::vector<float> out(40 * 64);
  RunOptions on, off;
  on.tuning.moe.profile = true;
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(RunMoe(L, b.input(), out.data(), SharedPool(), *ws1, on).ok());
  ASSERT_TRUE(RunMoe(L, b.input(), out.data(), SharedPool(), *ws1, off).ok());
  ASSERT_TRUE(RunMoe(L, b.input(), out.data(), SharedPool(), *ws2, off).ok());
  const MoePhaseProfile p = ws1->TakeProfile();
  EXPECT_EQ(p.calls, 3);
  double total = 0;
  for (double s : p.seconds) {
    EXPECT_GE(s, 0.0);
    total += s;
  }
  EXPECT_GT(total, 0.0);
  const std::string text = p.ToString();
  EXPECT_EQ(text.rfind("3 calls, us per call: route ", 0), 0u) << text;
  EXPECT_NE(text.find(" reduce "), std::string::npos) << text;
  EXPECT_EQ(MoePhaseProfile().ToString(), "no calls");
  EXPECT_EQ(ws1->TakeProfile().calls, 0) << "TakeProfile starts over";
  EXPECT_EQ(ws2->TakeProfile().calls, 0) << "calls without profile are not counted";
}

}  // namespace
}  // namespace hmoe
