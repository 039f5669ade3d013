// RoutedExperts::MakeSlots, the in-process adapter of the fixed expert-call
// slots (gpu_worker/transport/expert_slots.h), over a fixture's reference
// experts: each slot's answer is Forward's on the same (bf16) rows; misuse
// is reported by TakeStatus, never acted on; the one region is released
// once, at destruction.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gpu_worker/routed_experts.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kMaxTokens = 8;

// One call: bf16 rows (what a slot holds) and their f32 widening (what
// Forward is given, as the adapter widens them).
struct Call {
  int32_t layer = 0, tokens = 0, top_k = 0;
  std::vector<uint16_t> hidden;
  std::vector<float> wide;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Call MakeCall(const ModelConfig& c, int32_t layer, int32_t tokens, int32_t top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.05f, 1.f);
  Call r;
  r.layer = layer;
  r.tokens = tokens;
  r.top_k = top_k;
  for (int64_t i = 0; i < tokens * c.hidden_size; ++i) {
    r.hidden.push_back(F32ToBf16(nd(rng)));
    r.wide.push_back(Bf16ToF32(r.hidden.back()));
  }
  std::vector<int32_t> all(static_cast<size_t>(c.moe.num_experts));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
  for (int32_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int32_t j = 0; j < top_k; ++j) {
      r.ids.push_back(all[static_cast<size_t>(j)]);
      r.weights.push_back(ud(rng));
    }
  }
  return r;
}

class InProcessSlots : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::FixturesDir() + "/deepseek_v3_tiny";
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    auto ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(*ckpt);
    auto ref = MakeReferenceRoutedExperts(config_, *ckpt_, 1);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = std::move(*ref);
    for (size_t i = 0; i < config_.layers.size(); ++i)
      if (config_.layers[i].moe) moe_layers_.push_back(static_cast<int32_t>(i));
    ASSERT_FALSE(moe_layers_.empty());
    ASSERT_GE(config_.moe.experts_per_token, 2);
  }
  ExpertSlotsOptions Options(int num_slots) const {
    ExpertSlotsOptions o;
    o.hidden = config_.hidden_size;
    o.num_slots = num_slots;
    o.max_tokens = kMaxTokens;
    o.top_k = static_cast<int32_t>(config_.moe.experts_per_token);
    return o;
  }
  // Forward's answer to `c`.
  std::vector<float> Want(const Call& c) {
    std::vector<float> out(static_cast<size_t>(c.tokens * config_.hidden_size), -1.f);
    ExpertBatch b;
    b.layer = c.layer;
    b.num_tokens = c.tokens;
    b.hidden_size = config_.hidden_size;
    b.hidden = c.wide.data();
    b.top_k = c.top_k;
    b.expert_ids = c.ids.data();
    b.weights = c.weights.data();
    absl::Status st = ref_->Forward(b, out.data());
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }
  static void Fill(const ExpertSlots& s, int slot, const Call& c) {
    const SlotView v = s.view(slot);
    if (!c.hidden.empty()) std::memcpy(v.hidden, c.hidden.data(), c.hidden.size() * 2);
    if (!c.ids.empty()) std::memcpy(v.ids, c.ids.data(), c.ids.size() * 4);
    if (!c.weights.empty()) std::memcpy(v.weights, c.weights.data(), c.weights.size() * 4);
  }
  static std::vector<float> Out(const ExpertSlots& s, int slot, int32_t tokens) {
    const float* o = s.view(slot).out;
    return std::vector<float>(o, o + static_cast<size_t>(tokens) * static_cast<size_t>(s.hidden()));
  }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<RoutedExperts> ref_;
  std::vector<int32_t> moe_layers_;
};

TEST_F(InProcessSlots, SlotsInFlightEqualForwardRoundAfterRound) {
  constexpr int kSlots = 3;
  std::vector<HostRegion> released;
  ExpertSlotsOptions o = Options(kSlots);
  o.before_release = [&](void* base, uint64_t bytes) {
    released.push_back(HostRegion{base, bytes});
  };
  auto made = ref_->MakeSlots(o);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<ExpertSlots> s = std::move(*made);
  EXPECT_STREQ(s->kind(), "in-process");
  EXPECT_EQ(s->num_slots(), kSlots);
  EXPECT_EQ(s->max_tokens(), kMaxTokens);
  EXPECT_EQ(s->top_k(), config_.moe.experts_per_token);
  EXPECT_EQ(s->hidden(), config_.hidden_size);
  auto gen = s->Prepare(absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(gen.ok()) << gen.status();
  const std::vector<HostRegion> regions = s->regions();
  ASSERT_EQ(regions.size(), 1u);
  const auto b = reinterpret_cast<uintptr_t>(regions[0].base);
  const uint64_t t = kMaxTokens, h = static_cast<uint64_t>(config_.hidden_size),
                 k = static_cast<uint64_t>(s->top_k());
  std::vector<SlotView> views;
  for (int i = 0; i < kSlots; ++i) {
    const SlotView v = s->view(i);
    views.push_back(v);
    for (const auto& [p, bytes] :
         std::vector<std::pair<const void*, uint64_t>>{{v.hidden, t * h * 2},
                                                       {v.ids, t * k * 4},
                                                       {v.weights, t * k * 4},
                                                       {v.out, t * h * 4}}) {
      const auto q = reinterpret_cast<uintptr_t>(p);
      EXPECT_TRUE(q >= b && q + bytes <= b + regions[0].bytes) << "slot " << i;
    }
  }

  const int32_t full = static_cast<int32_t>(config_.moe.experts_per_token);
  static constexpr int32_t kTokens[] = {1, 3, kMaxTokens, 5};
  for (int r = 0; r < 8; ++r) {
    SCOPED_TRACE(absl::StrCat("round ", r));
    std::vector<Call> calls;
    for (int i = 0; i < kSlots; ++i) {
      const size_t j = static_cast<size_t>(i + r);
      calls.push_back(MakeCall(config_, moe_layers_[j % moe_layers_.size()], kTokens[j % 4],
                               j % 2 == 0 ? full : full / 2,
                               static_cast<uint64_t>(r * 10 + i + 1)));
    }
    auto g = s->Prepare(absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(*g, *gen);
    for (int i = 0; i < kSlots; ++i) {
      EXPECT_EQ(s->view(i).hidden, views[static_cast<size_t>(i)].hidden);
      EXPECT_EQ(s->view(i).out, views[static_cast<size_t>(i)].out);
      Fill(*s, i, calls[static_cast<size_t>(i)]);
    }
    for (int i = 0; i < kSlots; ++i) {
      const Call& c = calls[static_cast<size_t>(i)];
      s->Submit(i, c.layer, c.tokens, c.top_k);
    }
    for (int i = kSlots; i-- > 0;) s->Wait(i);
    absl::Status st = s->TakeStatus();
    ASSERT_TRUE(st.ok()) << st;
    for (int i = 0; i < kSlots; ++i) {
      const Call& c = calls[static_cast<size_t>(i)];
      EXPECT_EQ(Out(*s, i, c.tokens), Want(c)) << "slot " << i;  // the same math: bit for bit
    }
  }
  EXPECT_GE(s->TakeWaitNs(), 0);
  EXPECT_EQ(s->TakeWaitNs(), 0);
  EXPECT_TRUE(released.empty());
  s.reset();
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].base, regions[0].base);
  EXPECT_EQ(released[0].bytes, regions[0].bytes);
}

TEST_F(InProcessSlots, MisuseAndRefusalsAreReportedAndCleared) {
  auto made = ref_->MakeSlots(Options(2));
  ASSERT_TRUE(made.ok()) << made.status();
  ExpertSlots& s = **made;
  const int32_t layer = moe_layers_[0], k = static_cast<int32_t>(config_.moe.experts_per_token);
  auto expect_misuse = [&](const std::string& says) {
    SCOPED_TRACE(says);
    absl::Status st = s.TakeStatus();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(says));
    EXPECT_TRUE(s.TakeStatus().ok());
  };
  s.Submit(0, layer, 0, k);
  s.Wait(0);
  EXPECT_TRUE(s.TakeStatus().ok());
  s.Wait(0);
  expect_misuse("without a submit");
  const Call c = MakeCall(config_, layer, 3, k, 7);
  Fill(s, 0, c);
  s.Submit(0, layer, c.tokens, k);
  s.Submit(0, layer, c.tokens, k);
  expect_misuse("submitted again");
  s.Wait(0);
  EXPECT_TRUE(s.TakeStatus().ok());
  EXPECT_EQ(Out(s, 0, c.tokens), Want(c));
  s.Submit(2, layer, 1, k);
  expect_misuse("no slot 2 of 2");
  s.Wait(-1);
  expect_misuse("no slot -1 of 2");
  s.Submit(1, layer, kMaxTokens + 1, k);
  expect_misuse("over the slots'");
  s.Wait(1);
  EXPECT_TRUE(s.TakeStatus().ok());
  // The experts' own refusals: a dense layer, an expert id out of range.
  Call bad = MakeCall(config_, layer, 2, k, 8);
  bad.ids[3] = static_cast<int32_t>(config_.moe.num_experts);
  Fill(s, 1, bad);
  s.Submit(1, layer, bad.tokens, k);
  s.Wait(1);
  absl::Status st = s.TakeStatus();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("expert id"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("(slot 1)"));
  ASSERT_FALSE(config_.layers[0].moe);
  s.Submit(1, 0, 1, k);
  s.Wait(1);
  EXPECT_EQ(s.TakeStatus().code(), absl::StatusCode::kInvalidArgument);
  // and the slot serves the next call
  Fill(s, 1, c);
  s.Submit(1, layer, c.tokens, k);
  s.Wait(1);
  EXPECT_TRUE(s.TakeStatus().ok());
  EXPECT_EQ(Out(s, 1, c.tokens), Want(c));
}

TEST_F(InProcessSlots, FailuresAreMappedAndBadOptionsRefused) {
  ExpertSlotsOptions o = Options(1);
  o.map_failure = [](const absl::Status& st) {
    return absl::UnavailableError(absl::StrCat("mapped: ", st.message()));
  };
  auto made = ref_->MakeSlots(o);
  ASSERT_TRUE(made.ok()) << made.status();
  (*made)->Wait(0);
  absl::Status st = (*made)->TakeStatus();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("mapped: "));

  for (auto edit : std::vector<std::function<void(ExpertSlotsOptions&)>>{
           [](auto& x) { x.hidden = 0; }, [](auto& x) { x.num_slots = 0; },
           [](auto& x) { x.num_slots = -1; }, [](auto& x) { x.max_tokens = 0; },
           [](auto& x) { x.top_k = -2; }}) {
    ExpertSlotsOptions x = Options(2);
    edit(x);
    EXPECT_EQ(ref_->MakeSlots(x).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// After a failure not yet taken, a pass's later calls are not sent (their
// out regions stay as they were); TakeStatus ends the pass and calls go
// out again.
TEST_F(InProcessSlots, AFailedPassSendsNoMoreCallsUntilTakeStatus) {
  auto made = ref_->MakeSlots(Options(3));
  ASSERT_TRUE(made.ok()) << made.status();
  ExpertSlots& s = **made;
  const int32_t layer = moe_layers_[0], K = s.top_k();
  const Call good = MakeCall(config_, layer, 2, K, 7);
  Call bad = good;
  bad.ids[0] = static_cast<int32_t>(config_.moe.num_experts);  // out of range
  Fill(s, 0, bad);
  Fill(s, 1, good);
  std::memset(const_cast<float*>(s.view(1).out), 0, 2 * s.hidden() * sizeof(float));
  s.Submit(0, layer, 2, K);
  s.Wait(0);                 // the failure is known here
  s.Submit(1, layer, 2, K);  // a later layer of the same pass: not sent
  s.Wait(1);
  EXPECT_EQ(Out(s, 1, 2), std::vector<float>(static_cast<size_t>(2 * s.hidden()), 0.f));
  EXPECT_EQ(s.TakeStatus().code(), absl::StatusCode::kInvalidArgument);
  s.Submit(1, layer, 2, K);
  s.Wait(1);
  EXPECT_TRUE(s.TakeStatus().ok());
  EXPECT_EQ(Out(s, 1, 2), Want(good));
}

}  // namespace
}  // namespace hmoe
