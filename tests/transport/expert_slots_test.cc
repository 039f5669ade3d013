// ExpertSlots (expert_slots.h) from ExpertPool::MakeSlots against a real
// expert service, over each transport: zero copy in a segment of its own for
// one shm shard, staged through the pool otherwise. The slot index is the
// only ticket: several slots in flight, reused round after round, must give
// what ExpertPool::Run gives on the same inputs; misuse is reported, never
// acted on; a killed or hung service ends every Wait by its deadline and the
// slots serve again once it is back.
#include "gpu_worker/transport/expert_slots.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/shm_client.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::MaxRelDiff;
using ::hmoe::testing::RandomCall;
using ::hmoe::testing::ServiceProcess;
using ::hmoe::testing::TempDir;
using ::testing::HasSubstr;

constexpr int32_t kMaxTokens = 16;  // the service's --max-tokens, and the slots'

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }
void UseLoopbackUcx() { setenv("UCX_TLS", "tcp,sm,self", 0); }
double Secs(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// A random call of `tokens` x `top_k` (top_k may be below the shard's, as a
// deferred half sends).
RandomCall MakeCall(const ShardInfo& info, int32_t layer, int32_t tokens, int32_t top_k,
                    uint64_t seed) {
  ShardInfo i = info;
  i.top_k = top_k;
  return ::hmoe::testing::MakeRandomCall(i, layer, tokens, seed);
}

// Writes `rc`'s request into slot `slot`'s regions.
void Fill(const ExpertSlots& s, int slot, const RandomCall& rc) {
  const SlotView v = s.view(slot);
  if (!rc.hidden.empty()) std::memcpy(v.hidden, rc.hidden.data(), rc.hidden.size() * 2);
  if (!rc.ids.empty()) std::memcpy(v.ids, rc.ids.data(), rc.ids.size() * 4);
  if (!rc.weights.empty()) std::memcpy(v.weights, rc.weights.data(), rc.weights.size() * 4);
}

std::vector<float> Out(const ExpertSlots& s, int slot, int32_t tokens) {
  const float* o = s.view(slot).out;
  return std::vector<float>(o, o + static_cast<size_t>(tokens) * static_cast<size_t>(s.hidden()));
}

// calls[i] in slot i, all in flight at once, waited in reverse order; the
// first failure, or the first answer unlike want[i].
absl::Status Round(ExpertSlots& s, const std::vector<RandomCall>& calls,
                   const std::vector<std::vector<float>>& want) {
  for (size_t i = 0; i < calls.size(); ++i) Fill(s, static_cast<int>(i), calls[i]);
  for (size_t i = 0; i < calls.size(); ++i)
    s.Submit(static_cast<int>(i), calls[i].layer, calls[i].tokens, calls[i].top_k);
  for (size_t i = calls.size(); i-- > 0;) s.Wait(static_cast<int>(i));
  RETURN_IF_ERROR(s.TakeStatus());
  for (size_t i = 0; i < calls.size(); ++i) {
    const double d = MaxRelDiff(Out(s, static_cast<int>(i), calls[i].tokens), want[i]);
    if (d > 1e-5)
      return absl::InternalError(absl::StrCat("slot ", i, " (", calls[i].tokens, " tokens, top-k ",
                                              calls[i].top_k, "): max rel diff ", d));
  }
  return absl::OkStatus();
}

bool Inside(const std::vector<HostRegion>& regions, const void* p, uint64_t bytes) {
  const auto q = reinterpret_cast<uintptr_t>(p);
  for (const HostRegion& r : regions) {
    const auto b = reinterpret_cast<uintptr_t>(r.base);
    if (p != nullptr && q >= b && q + bytes <= b + r.bytes) return true;
  }
  return false;
}

// Every slot's four regions lie inside regions(), and no two overlap.
void ExpectViewsInsideRegions(const ExpertSlots& s) {
  const std::vector<HostRegion> regions = s.regions();
  const uint64_t t = static_cast<uint64_t>(s.max_tokens()), h = static_cast<uint64_t>(s.hidden()),
                 k = static_cast<uint64_t>(s.top_k());
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (int i = 0; i < s.num_slots(); ++i) {
    const SlotView v = s.view(i);
    const std::pair<const void*, uint64_t> parts[] = {
        {v.hidden, t * h * 2}, {v.ids, t * k * 4}, {v.weights, t * k * 4}, {v.out, t * h * 4}};
    for (const auto& [p, bytes] : parts) {
      EXPECT_TRUE(Inside(regions, p, bytes)) << "slot " << i << ": " << p << " + " << bytes;
      spans.emplace_back(reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes);
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << i;
}

bool SameViews(const ExpertSlots& s, const std::vector<SlotView>& was) {
  for (int i = 0; i < s.num_slots(); ++i) {
    const SlotView v = s.view(i);
    const SlotView& w = was[static_cast<size_t>(i)];
    if (v.hidden != w.hidden || v.ids != w.ids || v.weights != w.weights || v.out != w.out)
      return false;
  }
  return true;
}

std::vector<SlotView> Views(const ExpertSlots& s) {
  std::vector<SlotView> v;
  for (int i = 0; i < s.num_slots(); ++i) v.push_back(s.view(i));
  return v;
}

// Whether this process maps the shm client's memfd at `base`.
bool MapsShmSegmentAt(const void* base) {
  std::ifstream maps("/proc/self/maps");
  const std::string start = absl::StrCat(absl::Hex(reinterpret_cast<uintptr_t>(base)), "-");
  for (std::string line; std::getline(maps, line);) {
    if (line.rfind(start, 0) == 0 && line.find("memfd:hmoe-shm") != std::string::npos) return true;
  }
  return false;
}

// Records before_release calls.
struct Releases {
  std::mutex mu;
  std::vector<HostRegion> seen;
  std::function<void(void*, uint64_t)> Hook() {
    return [this](void* base, uint64_t bytes) {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(HostRegion{base, bytes});
    };
  }
  std::vector<HostRegion> Get() {
    std::lock_guard<std::mutex> lock(mu);
    return seen;
  }
};

class ExpertSlotsTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override {
    UseLoopbackUcx();
    ASSERT_TRUE(
        proc_.Start({"--model-dir=" + ModelDir(), absl::StrCat("--max-tokens=", kMaxTokens)},
                    dir_.file("port")));
    ExpertPoolOptions po;
    po.targets = {proc_.target()};
    po.transport = GetParam();
    auto pool = ExpertPool::Connect(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    info_ = pool_->model();
    ASSERT_EQ(info_.max_tokens, kMaxTokens);
    ASSERT_GE(info_.top_k, 2);
  }
  bool shm() const { return GetParam() == TransportKind::kShm; }
  ExpertSlotsOptions Options(int num_slots, absl::Duration call_timeout) const {
    ExpertSlotsOptions o;
    o.hidden = info_.hidden;
    o.num_slots = num_slots;
    o.max_tokens = kMaxTokens;
    o.top_k = static_cast<int32_t>(info_.top_k);
    o.call_timeout = call_timeout;
    return o;
  }
  std::unique_ptr<ExpertSlots> Make(const ExpertSlotsOptions& o) {
    auto s = pool_->MakeSlots(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  // Round r's call for slot i: token counts 1, 3, max, 7, 2 and top-k full
  // or half, over every MoE layer, each slot a different shape each round.
  std::vector<RandomCall> Calls(int n, int r) const {
    static constexpr int32_t kTokens[] = {1, 3, kMaxTokens, 7, 2};
    const int32_t full = static_cast<int32_t>(info_.top_k);
    std::vector<RandomCall> calls;
    for (int i = 0; i < n; ++i) {
      const size_t j = static_cast<size_t>(i + r);
      calls.push_back(MakeCall(info_, info_.moe_layers[j % info_.moe_layers.size()], kTokens[j % 5],
                               j % 2 == 0 ? full : full / 2,
                               static_cast<uint64_t>(r * 100 + i + 1)));
    }
    return calls;
  }
  // What ExpertPool::Run answers for each call.
  std::vector<std::vector<float>> Want(const std::vector<RandomCall>& calls) {
    std::vector<std::vector<float>> want;
    for (const RandomCall& c : calls) {
      want.emplace_back(static_cast<size_t>(c.tokens * info_.hidden), -1.f);
      absl::Status st = pool_->Run(c.call(), want.back().data(), absl::Now() + absl::Seconds(10));
      EXPECT_TRUE(st.ok()) << st;
    }
    return want;
  }
  // Round(...) until it succeeds (a restarted service is reached again after
  // the channel's backoff), Prepare before each, at most 15 s; the last status.
  absl::Status RoundUntilServed(ExpertSlots& s, const std::vector<RandomCall>& calls,
                                const std::vector<std::vector<float>>& want) {
    absl::Status st;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    do {
      st = s.Prepare(absl::Now() + absl::Seconds(2)).status();
      if (st.ok()) st = Round(s, calls, want);
      if (!st.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (!st.ok() && std::chrono::steady_clock::now() < until);
    return st;
  }

  TempDir dir_;
  ServiceProcess proc_;
  std::unique_ptr<ExpertPool> pool_;
  ShardInfo info_;
};

TEST_P(ExpertSlotsTest, SlotsInFlightMatchThePoolRoundAfterRound) {
  constexpr int kSlots = 4;
  auto s = Make(Options(kSlots, absl::Seconds(10)));
  ASSERT_NE(s, nullptr);
  EXPECT_STREQ(s->kind(), shm() ? "shm (zero copy)" : "staged");
  EXPECT_EQ(s->num_slots(), kSlots);
  EXPECT_EQ(s->max_tokens(), kMaxTokens);
  EXPECT_EQ(s->top_k(), info_.top_k);
  EXPECT_EQ(s->hidden(), info_.hidden);
  auto gen = s->Prepare(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(gen.ok()) << gen.status();
  const std::vector<HostRegion> regions = s->regions();
  ASSERT_EQ(regions.size(), 1u);
  ExpectViewsInsideRegions(*s);
  if (shm()) {  // the one region is the client's segment
    ShmGeometry geo;
    geo.slots = kSlots;
    geo.hidden = info_.hidden;
    geo.max_tokens = kMaxTokens;
    geo.max_top_k = info_.top_k;
    EXPECT_EQ(regions[0].bytes, geo.total_bytes());
    EXPECT_TRUE(MapsShmSegmentAt(regions[0].base)) << regions[0].base;
  }
  const std::vector<SlotView> views = Views(*s);
  for (int r = 0; r < 12; ++r) {
    SCOPED_TRACE(absl::StrCat("round ", r));
    const std::vector<RandomCall> calls = Calls(kSlots, r);
    const std::vector<std::vector<float>> want = Want(calls);
    auto g = s->Prepare(absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, *gen);  // nothing moved: the same generation, views and region
    EXPECT_TRUE(SameViews(*s, views));
    ASSERT_EQ(s->regions().size(), 1u);
    EXPECT_EQ(s->regions()[0].base, regions[0].base);
    absl::Status st = Round(*s, calls, want);
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_GT(s->TakeWaitNs(), 0);
  EXPECT_EQ(s->TakeWaitNs(), 0);  // cleared
}

// The device-side calls' contract (ExpertSlots::device_wait, Arm): over shm
// the word lies in the region, is in the busy range exactly while a call is
// at the service (held there by SIGSTOP), leaves it when the answer is in,
// and Wait then returns at once with that answer; a call never sent leaves
// the word outside the range; an armed call is sent by storing `request`
// into the word. service_alive follows the service's death. Other
// transports have no word (their calls stay host nodes).
TEST_P(ExpertSlotsTest, DeviceWordIsBusyExactlyWhileTheCallIsAtTheServiceAndSendsArmedCalls) {
  auto s = Make(Options(2, absl::Seconds(10)));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->Prepare(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(s->service_alive());
  EXPECT_FALSE(s->has_failure());
  EXPECT_EQ(s->call_timeout(), absl::Seconds(10));
  if (!shm()) {
    for (int i = 0; i < 2; ++i) EXPECT_EQ(s->device_wait(i).word, nullptr) << i;
    EXPECT_FALSE(s->Arm(0, info_.moe_layers[0], 1, 1)) << "staged slots are sent by the host";
    EXPECT_EQ(s->TakeStatus().code(), absl::StatusCode::kUnimplemented);
    return;
  }
  EXPECT_EQ(s->device_wait(2).word, nullptr) << "out of range";
  auto word = [&](int i) {
    return reinterpret_cast<const std::atomic<uint32_t>*>(s->device_wait(i).word)->load();
  };
  auto busy = [&](int i) {
    const ExpertSlots::DeviceWait w = s->device_wait(i);
    const uint32_t v = word(i);
    return v >= w.busy_lo && v <= w.busy_hi;
  };
  for (int i = 0; i < 2; ++i) {
    ASSERT_NE(s->device_wait(i).word, nullptr);
    EXPECT_TRUE(Inside(s->regions(), s->device_wait(i).word, 4)) << i;
    EXPECT_LE(s->device_wait(i).busy_lo, s->device_wait(i).busy_hi);
    EXPECT_FALSE(busy(i)) << "idle slot " << i;
  }
  EXPECT_NE(s->device_wait(0).word, s->device_wait(1).word);
  const int32_t layer = info_.moe_layers[0], k = static_cast<int32_t>(info_.top_k);
  const RandomCall rc = MakeCall(info_, layer, 5, k, 21);
  const std::vector<std::vector<float>> want = Want({rc});
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    proc_.Signal(SIGSTOP);
    Fill(*s, 0, rc);
    s->Submit(0, rc.layer, rc.tokens, rc.top_k);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_TRUE(busy(0)) << "word " << word(0) << " while the service is stopped";
    EXPECT_FALSE(busy(1));
    proc_.Signal(SIGCONT);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (busy(0) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    ASSERT_FALSE(busy(0)) << "still busy 5 s after SIGCONT";
    const auto t0 = std::chrono::steady_clock::now();
    s->Wait(0);
    EXPECT_LT(Secs(std::chrono::steady_clock::now() - t0), 0.05) << "Wait after the word moved";
    ASSERT_TRUE(s->TakeStatus().ok());
    EXPECT_LE(MaxRelDiff(Out(*s, 0, rc.tokens), want[0]), 1e-5);
    EXPECT_FALSE(busy(0)) << "released";
  }
  // The device's send, played by this thread: Arm writes the call without
  // sending it; storing `request` into the word sends it, also after the
  // server has idled for a while (polling on: it naps 1 ms at a time).
  const ExpertSlots::DeviceWait dw = s->device_wait(0);
  ASSERT_NE(dw.request, 0u);
  auto* state = reinterpret_cast<std::atomic<uint32_t>*>(dw.word);
  for (int idle_ms : {0, 300}) {
    SCOPED_TRACE(absl::StrCat("device send after ", idle_ms, " ms idle"));
    s->SetDeviceSends(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(idle_ms));
    Fill(*s, 0, rc);
    ASSERT_TRUE(s->Arm(0, rc.layer, rc.tokens, rc.top_k));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(busy(0)) << "armed is not sent";
    const auto t0 = std::chrono::steady_clock::now();
    state->store(dw.request, std::memory_order_release);
    const auto until = t0 + std::chrono::seconds(5);
    while (busy(0) && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    ASSERT_FALSE(busy(0)) << "not answered 5 s after the device's send";
    EXPECT_LT(Secs(std::chrono::steady_clock::now() - t0), 0.5);
    s->Wait(0);
    ASSERT_TRUE(s->TakeStatus().ok());
    EXPECT_LE(MaxRelDiff(Out(*s, 0, rc.tokens), want[0]), 1e-5);
    s->SetDeviceSends(false);
  }
  // Armed and never sent (the pass stopped first): Wait releases it at once.
  ASSERT_TRUE(s->Arm(0, rc.layer, rc.tokens, rc.top_k));
  const auto t1 = std::chrono::steady_clock::now();
  s->Wait(0);
  EXPECT_LT(Secs(std::chrono::steady_clock::now() - t1), 0.05);
  EXPECT_EQ(s->TakeStatus().code(), absl::StatusCode::kAborted);
  Fill(*s, 0, rc);
  s->Submit(0, rc.layer, rc.tokens, rc.top_k);  // the slot is free again
  s->Wait(0);
  ASSERT_TRUE(s->TakeStatus().ok());
  EXPECT_LE(MaxRelDiff(Out(*s, 0, rc.tokens), want[0]), 1e-5);

  // A failure (a slot out of range) shows in has_failure until taken; a
  // call after it is not sent, so its word never turns busy.
  s->Submit(5, layer, 1, k);
  EXPECT_TRUE(s->has_failure());
  s->Submit(1, rc.layer, rc.tokens, rc.top_k);
  EXPECT_FALSE(busy(1)) << "a call after a failure was sent";
  s->Wait(1);
  EXPECT_FALSE(s->TakeStatus().ok());
  EXPECT_FALSE(s->has_failure());
  // The service's death.
  proc_.Kill(SIGKILL);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (s->service_alive() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_FALSE(s->service_alive());
}

TEST_P(ExpertSlotsTest, EmptyCallsAndMisuseAreReportedAndTakeStatusClears) {
  auto s = Make(Options(2, absl::Seconds(10)));
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->Prepare(absl::Now() + absl::Seconds(5)).ok());
  const int32_t layer = info_.moe_layers[0], k = static_cast<int32_t>(info_.top_k);
  auto expect_misuse = [&](const std::string& what, const std::string& says) {
    SCOPED_TRACE(what);
    absl::Status st = s->TakeStatus();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(says));
    EXPECT_TRUE(s->TakeStatus().ok()) << "TakeStatus did not clear";
  };

  s->Submit(0, layer, 0, k);  // nothing to compute
  s->Wait(0);
  EXPECT_TRUE(s->TakeStatus().ok());

  s->Wait(1);
  expect_misuse("wait without submit", "without a submit");

  const RandomCall rc = MakeCall(info_, layer, 3, k, 11);
  const std::vector<std::vector<float>> want = Want({rc});
  Fill(*s, 0, rc);
  s->Submit(0, layer, rc.tokens, k);
  s->Submit(0, layer, rc.tokens, k);  // refused: the first call is not waited on yet
  expect_misuse("submit twice", "submitted again");
  s->Wait(0);  // the first call's answer, untouched by the refused one
  EXPECT_TRUE(s->TakeStatus().ok());
  EXPECT_LT(MaxRelDiff(Out(*s, 0, rc.tokens), want[0]), 1e-5);

  for (int slot : {-1, 2, 1000}) {
    s->Submit(slot, layer, 1, k);
    expect_misuse(absl::StrCat("submit slot ", slot), absl::StrCat("no slot ", slot, " of 2"));
    s->Wait(slot);
    expect_misuse(absl::StrCat("wait slot ", slot), absl::StrCat("no slot ", slot, " of 2"));
  }
  // Over the slots' capacity: refused at Submit; Wait returns at once.
  for (const auto& [tokens, top_k] :
       std::vector<std::pair<int32_t, int32_t>>{{kMaxTokens + 1, k}, {-1, k}, {1, k + 1}, {1, 0}}) {
    s->Submit(0, layer, tokens, top_k);
    expect_misuse(absl::StrCat(tokens, " tokens x top-k ", top_k), "over the slots'");
    const auto t0 = std::chrono::steady_clock::now();
    s->Wait(0);
    EXPECT_LT(Secs(std::chrono::steady_clock::now() - t0), 0.1);
    EXPECT_TRUE(s->TakeStatus().ok());
  }
  // Only the first failure is kept, annotated with the layer and slot.
  s->Wait(1);
  s->Submit(7, layer, 1, k);
  absl::Status first = s->TakeStatus();
  EXPECT_EQ(first.code(), absl::StatusCode::kFailedPrecondition) << first;
  EXPECT_THAT(std::string(first.message()), HasSubstr("without a submit"));
  EXPECT_THAT(std::string(first.message()), HasSubstr("routed experts (slot 1)"));
  EXPECT_TRUE(s->TakeStatus().ok());

  // The service's (or the pool's) own refusal names the field; the slot
  // serves the next call.
  RandomCall bad = MakeCall(info_, layer, 2, k, 12);
  bad.ids[1] = static_cast<int32_t>(info_.num_experts);
  Fill(*s, 1, bad);
  s->Submit(1, layer, bad.tokens, k);
  s->Wait(1);
  absl::Status refused = s->TakeStatus();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("expert_ids"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("slot 1"));

  const std::vector<RandomCall> calls = Calls(2, 3);
  absl::Status st = Round(*s, calls, Want(calls));
  EXPECT_TRUE(st.ok()) << st;
}

TEST_P(ExpertSlotsTest, MakeSlotsRefusesWhatTheShardCannotTake) {
  const ExpertSlotsOptions good = Options(2, absl::Seconds(10));
  struct Case {
    std::string what;
    std::function<void(ExpertSlotsOptions&)> edit;
    absl::StatusCode code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"max_tokens over the shard's", [](auto& o) { o.max_tokens = kMaxTokens + 1; },
       absl::StatusCode::kFailedPrecondition, "tokens per call"},
      {"top_k over the shard's", [](auto& o) { ++o.top_k; }, absl::StatusCode::kFailedPrecondition,
       "top-k"},
      {"hidden size", [](auto& o) { o.hidden += 1; }, absl::StatusCode::kInvalidArgument,
       "hidden size"},
      {"no hidden size", [](auto& o) { o.hidden = 0; }, absl::StatusCode::kInvalidArgument,
       "hidden size"},
      {"no slots", [](auto& o) { o.num_slots = 0; }, absl::StatusCode::kInvalidArgument,
       "num_slots"},
      {"negative slots", [](auto& o) { o.num_slots = -1; }, absl::StatusCode::kInvalidArgument,
       "num_slots"},
      {"no tokens", [](auto& o) { o.max_tokens = 0; }, absl::StatusCode::kInvalidArgument,
       "max_tokens"},
      {"no top-k", [](auto& o) { o.top_k = 0; }, absl::StatusCode::kInvalidArgument, "top_k"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ExpertSlotsOptions o = good;
    c.edit(o);
    auto s = pool_->MakeSlots(o);
    EXPECT_EQ(s.status().code(), c.code) << s.status();
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.says));
  }
  // Smaller than the shard: fine, and the slots' own capacity is enforced.
  ExpertSlotsOptions small = good;
  small.max_tokens = 5;
  small.top_k = 2;
  auto s = pool_->MakeSlots(small);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->Prepare(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ((*s)->max_tokens(), 5);
  EXPECT_EQ((*s)->top_k(), 2);
  ExpectViewsInsideRegions(**s);
  const std::vector<RandomCall> calls = {MakeCall(info_, info_.moe_layers[0], 5, 2, 3),
                                         MakeCall(info_, info_.moe_layers.back(), 1, 1, 4)};
  absl::Status st = Round(**s, calls, Want(calls));
  EXPECT_TRUE(st.ok()) << st;
  (*s)->Submit(0, info_.moe_layers[0], 6, 2);
  (*s)->Wait(0);
  EXPECT_EQ((*s)->TakeStatus().code(), absl::StatusCode::kFailedPrecondition);
}

// The service is killed with calls in flight: every Wait ends within the
// call timeout, UNAVAILABLE; a pass before Prepare is refused as quickly.
// Restarted, Prepare reconnects (shm: a new segment, a new generation, the
// old region released once) and the slots serve again.
TEST_P(ExpertSlotsTest, KilledServiceIsUnavailableThenPrepareReconnects) {
  constexpr int kSlots = 3;
  const absl::Duration timeout = absl::Milliseconds(1000);
  Releases releases;
  ExpertSlotsOptions o = Options(kSlots, timeout);
  o.before_release = releases.Hook();
  auto s = Make(o);
  ASSERT_NE(s, nullptr);
  auto gen = s->Prepare(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(gen.ok()) << gen.status();
  const HostRegion old_region = s->regions().at(0);
  const std::vector<RandomCall> calls = Calls(kSlots, 1);
  const std::vector<std::vector<float>> want = Want(calls);
  absl::Status st = Round(*s, calls, want);
  ASSERT_TRUE(st.ok()) << st;

  proc_.Signal(SIGSTOP);  // so that the calls are surely in flight when it dies
  for (int i = 0; i < kSlots; ++i) Fill(*s, i, calls[static_cast<size_t>(i)]);
  const auto submitted = std::chrono::steady_clock::now();
  for (int i = 0; i < kSlots; ++i)
    s->Submit(i, calls[static_cast<size_t>(i)].layer, calls[static_cast<size_t>(i)].tokens,
              calls[static_cast<size_t>(i)].top_k);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  proc_.Kill(SIGKILL);
  for (int i = 0; i < kSlots; ++i) s->Wait(i);
  const double waited = Secs(std::chrono::steady_clock::now() - submitted);
  EXPECT_LT(waited, absl::ToDoubleSeconds(timeout) + 0.5);
  st = s->TakeStatus();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(s->TakeStatus().ok());

  // A pass before Prepare: refused, not hung (shm: the segment's service is
  // gone, at Submit).
  Fill(*s, 0, calls[0]);
  const auto t0 = std::chrono::steady_clock::now();
  s->Submit(0, calls[0].layer, calls[0].tokens, calls[0].top_k);
  s->Wait(0);
  EXPECT_LT(Secs(std::chrono::steady_clock::now() - t0), absl::ToDoubleSeconds(timeout) + 0.5);
  st = s->TakeStatus();
  if (shm()) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  } else {
    EXPECT_TRUE(absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st)) << st;
  }
  EXPECT_TRUE(releases.Get().empty()) << "released from Submit or Wait";

  if (shm()) {
    // Prepare while the service is down: fails by its deadline; the old
    // segment is given up (released once) and no view points into it.
    const auto p0 = std::chrono::steady_clock::now();
    auto down = s->Prepare(absl::Now() + absl::Milliseconds(500));
    EXPECT_FALSE(down.ok());
    EXPECT_TRUE(absl::IsUnavailable(down.status()) || absl::IsDeadlineExceeded(down.status()))
        << down.status();
    EXPECT_LT(Secs(std::chrono::steady_clock::now() - p0), 2.0);
    ASSERT_EQ(releases.Get().size(), 1u);
    for (int i = 0; i < kSlots; ++i) {
      EXPECT_EQ(s->view(i).hidden, nullptr) << i;
      EXPECT_EQ(s->view(i).out, nullptr) << i;
    }
    for (const HostRegion& r : s->regions()) EXPECT_EQ(r.base, nullptr);
    // and a pass anyway is refused, not written into released memory
    s->Submit(1, calls[1].layer, calls[1].tokens, calls[1].top_k);
    s->Wait(1);
    EXPECT_FALSE(s->TakeStatus().ok());
  }

  ASSERT_TRUE(proc_.Restart());
  absl::StatusOr<uint64_t> back;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  do {
    back = s->Prepare(absl::Now() + absl::Seconds(2));
    if (!back.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (!back.ok() && std::chrono::steady_clock::now() < until);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(s->regions().size(), 1u);
  ExpectViewsInsideRegions(*s);
  if (shm()) {
    EXPECT_NE(*back, *gen) << "a new segment, a new generation";
    const std::vector<HostRegion> released = releases.Get();
    ASSERT_EQ(released.size(), 1u);
    EXPECT_EQ(released[0].base, old_region.base);
    EXPECT_EQ(released[0].bytes, old_region.bytes);
    EXPECT_TRUE(MapsShmSegmentAt(s->regions()[0].base));
    // Its views are the new segment's: served at the first try.
    st = Round(*s, calls, want);
    EXPECT_TRUE(st.ok()) << st;
  } else {
    EXPECT_EQ(*back, *gen);  // staged: the slots never move
    EXPECT_EQ(s->regions()[0].base, old_region.base);
    EXPECT_TRUE(releases.Get().empty());
    st = RoundUntilServed(*s, calls, want);
    EXPECT_TRUE(st.ok()) << st;
  }
  for (int r = 0; r < 3; ++r) {
    const std::vector<RandomCall> more = Calls(kSlots, 5 + r);
    st = Round(*s, more, Want(more));
    EXPECT_TRUE(st.ok()) << "round " << r << ": " << st;
  }
  auto same = s->Prepare(absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, *back);
  const HostRegion last = s->regions().at(0);
  const size_t before = releases.Get().size();
  s.reset();
  const std::vector<HostRegion> released = releases.Get();
  ASSERT_EQ(released.size(), before + 1) << "the last region released at destruction";
  EXPECT_EQ(released.back().base, last.base);
}

// The service hangs (SIGSTOP) mid-call: Wait ends by the call's deadline;
// the next Submit on that slot is an error, not a call into a slot the
// service may still be reading (shm: DEADLINE_EXCEEDED "abandoned" at
// once); once continued, the slot serves again.
TEST_P(ExpertSlotsTest, HungServiceEndsByTheDeadlineThenTheSlotServesAgain) {
  constexpr int kSlots = 3;
  const absl::Duration timeout = absl::Milliseconds(500);
  auto s = Make(Options(kSlots, timeout));
  ASSERT_NE(s, nullptr);
  auto gen = s->Prepare(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(gen.ok()) << gen.status();
  const std::vector<RandomCall> calls = Calls(kSlots, 2);
  const std::vector<std::vector<float>> want = Want(calls);
  absl::Status st = Round(*s, calls, want);
  ASSERT_TRUE(st.ok()) << st;
  const std::vector<RandomCall> next = Calls(kSlots, 4);
  const std::vector<std::vector<float>> next_want = Want(next);

  proc_.Signal(SIGSTOP);
  for (int i = 0; i < 2; ++i) Fill(*s, i, calls[static_cast<size_t>(i)]);
  const auto submitted = std::chrono::steady_clock::now();
  for (int i = 0; i < 2; ++i)
    s->Submit(i, calls[static_cast<size_t>(i)].layer, calls[static_cast<size_t>(i)].tokens,
              calls[static_cast<size_t>(i)].top_k);
  for (int i = 0; i < 2; ++i) s->Wait(i);
  const double waited = Secs(std::chrono::steady_clock::now() - submitted);
  EXPECT_GE(waited, absl::ToDoubleSeconds(timeout) - 0.05);
  EXPECT_LT(waited, absl::ToDoubleSeconds(timeout) + 0.5);
  st = s->TakeStatus();
  EXPECT_TRUE(absl::IsDeadlineExceeded(st) || absl::IsUnavailable(st)) << st;
  if (shm()) {
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    // A stopped service is not a gone one: nothing moves.
    auto g = s->Prepare(absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, *gen);
  }

  // The same slot again while the service is still stopped.
  Fill(*s, 0, next[0]);
  const auto t0 = std::chrono::steady_clock::now();
  s->Submit(0, next[0].layer, next[0].tokens, next[0].top_k);
  s->Wait(0);
  const double again = Secs(std::chrono::steady_clock::now() - t0);
  st = s->TakeStatus();
  EXPECT_FALSE(st.ok());
  if (shm()) {
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("abandoned"));
    EXPECT_LT(again, 0.2) << "refused at Submit, not waited out";
  } else {
    EXPECT_TRUE(absl::IsDeadlineExceeded(st) || absl::IsUnavailable(st)) << st;
    EXPECT_LT(again, absl::ToDoubleSeconds(timeout) + 0.5);
  }

  proc_.Signal(SIGCONT);
  // Served again (shm: once the service has finished the abandoned calls),
  // with the answers of the new requests, not of the abandoned ones.
  st = RoundUntilServed(*s, next, next_want);
  EXPECT_TRUE(st.ok()) << st;
  st = Round(*s, calls, want);
  EXPECT_TRUE(st.ok()) << st;
  auto g = s->Prepare(absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, *gen);
}

INSTANTIATE_TEST_SUITE_P(Transports, ExpertSlotsTest,
                         ::testing::Values(TransportKind::kShm, TransportKind::kUcx,
                                           TransportKind::kGrpc),
                         [](const auto& p) { return std::string(TransportKindName(p.param)); });

// Two shm shards: no one segment holds a call, so the slots are staged
// through the pool (which sums the shards' partials).
TEST(ExpertSlotsShards, TwoShmShardsAreStagedAndMatchThePool) {
  TempDir dir;
  std::vector<std::unique_ptr<ServiceProcess>> procs;
  ExpertPoolOptions po;
  po.transport = TransportKind::kShm;
  for (int i = 0; i < 2; ++i) {
    procs.push_back(std::make_unique<ServiceProcess>());
    ASSERT_TRUE(procs.back()->Start({"--model-dir=" + ModelDir(), absl::StrCat("--shard=", i, "/2"),
                                     absl::StrCat("--max-tokens=", kMaxTokens)},
                                    dir.file(absl::StrCat("port", i))));
    po.targets.push_back(procs.back()->target());
  }
  auto pool = ExpertPool::Connect(po);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const ShardInfo info = (*pool)->model();
  ExpertSlotsOptions o;
  o.hidden = info.hidden;
  o.num_slots = 3;
  o.max_tokens = kMaxTokens;
  o.top_k = static_cast<int32_t>(info.top_k);
  auto s = (*pool)->MakeSlots(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_STREQ((*s)->kind(), "staged");
  ASSERT_TRUE((*s)->Prepare(absl::Now() + absl::Seconds(5)).ok());
  ExpectViewsInsideRegions(**s);
  for (int r = 0; r < 4; ++r) {
    std::vector<RandomCall> calls;
    std::vector<std::vector<float>> want;
    for (int i = 0; i < 3; ++i) {
      const int32_t tokens = (i + r) % 3 == 0 ? kMaxTokens : 1 + 2 * ((i + r) % 3);
      const int32_t k = static_cast<int32_t>((i + r) % 2 == 0 ? info.top_k : info.top_k / 2);
      calls.push_back(MakeCall(info,
                               info.moe_layers[static_cast<size_t>(i) % info.moe_layers.size()],
                               tokens, k, static_cast<uint64_t>(10 * r + i)));
      want.emplace_back(static_cast<size_t>(tokens * info.hidden));
      ASSERT_TRUE(
          (*pool)
              ->Run(calls.back().call(), want.back().data(), absl::Now() + absl::Seconds(10))
              .ok());
    }
    absl::Status st = Round(**s, calls, want);
    EXPECT_TRUE(st.ok()) << "round " << r << ": " << st;
  }
}

}  // namespace
}  // namespace hmoe
