// RunMoe vs the scalar reference for every format x ISA this CPU has.
//
// Error bounds (max |out - ref| / max |ref| over the output; NaN or inf
// anywhere fails, see RelErr):
//  * BF16 weights, and INT4 in the "many" regime: the only difference from
//    the reference is fp32 (kernel) vs double (reference) accumulation of
//    gate/up, which flips the bf16 rounding of h = SiLU(g)*u by one ulp
//    (2^-8 relative) on rare elements; one flip moves the output by about
//    2^-8 |h||w| against an output of ~sqrt(I)|h||w|: <5e-4 at I = 75. Plus
//    fp32 accumulation of down (~1e-6). Bound: 3e-3.
//  * INT8, and INT4 "few": activations quantize identically and integer sums
//    are exact, but h differs from the reference in the last fp32 bits, so a
//    few h elements round to the neighbouring int8 level; one such step moves
//    the output by s_h |w| = max|h|/127 |w|, about 3e-3 of the output at
//    I = 75 (max|h| ~ 3 rms). Bound: 1.5e-2 (a few steps).
//  * One INT4 call mixes the regimes (an expert with few tokens runs "few"),
//    so INT4 gets the INT8 bound, except where the test makes every expert
//    call "many" (RunOptions::many_threshold_int4 = 0): then the BF16 one.
//  * Virtual NUMA (2 nodes) vs 1 node: per-column arithmetic is identical;
//    only the fp32 sum of the two down partials differs. Bound: 1e-5.
#include "expert_service/kernels/moe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/isa.h"
#include "tests/kernels/moe_test_util.h"
#include "tests/testing/scoped_env.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

using testing::Batch;
using testing::RandomBatch;
using testing::RandomSource;
using testing::RelErr;
using testing::ScopedEnv;
using testing::SharedPool;

struct FormatCase {
  WeightFormat f;
  int group;
};

double Bound(WeightFormat f, const RunOptions& ro = {}) {
  if (f == WeightFormat::kBf16) return 3e-3;
  if (f == WeightFormat::kInt4 && ro.many_threshold_int4 == 0) return 3e-3;  // all "many"
  return 1.5e-2;
}

// The ISA a test asked for, or a skip reason when this CPU or HMOE_ISA caps it
// lower (the case would silently run a lower ISA under the wrong name). The
// test binary is the edge that reads HMOE_ISA, here.
std::optional<std::string> IsaUnavailable(Isa isa) {
  if (isa > DetectedIsa())
    return absl::StrCat("this CPU supports up to ", std::string(IsaName(DetectedIsa())), ", not ",
                        std::string(IsaName(isa)));
  const char* env = std::getenv("HMOE_ISA");
  auto cap = ParseIsaCap(env != nullptr ? env : "", "HMOE_ISA");
  if (!cap.ok()) return absl::StrCat("HMOE_ISA: ", cap.status().ToString());
  auto eff = ResolveIsa(MinIsa(isa, *cap));
  if (!eff.ok()) return absl::StrCat("HMOE_ISA: ", eff.status().ToString());
  if (*eff != isa) return absl::StrCat("HMOE_ISA caps the ISA at ", std::string(IsaName(*eff)));
  return std::nullopt;
}

// The kernel paths a test can run here: every ISA this CPU has (and HMOE_ISA
// allows), plus the AMX software model where AVX-512 is available.
struct IsaVariant {
  Isa isa;
  bool emulate_amx;
};
std::vector<IsaVariant> AvailableVariants() {
  std::vector<IsaVariant> out;
  for (IsaVariant v : {IsaVariant{Isa::kScalar, false}, IsaVariant{Isa::kAvx2, false},
                       IsaVariant{Isa::kAvx512, false}, IsaVariant{Isa::kAvx512, true},
                       IsaVariant{Isa::kAmx, false}})
    if (!IsaUnavailable(v.isa)) out.push_back(v);
  return out;
}

std::vector<QuantExpert> QuantizeAll(const MoeWeightsSource& src, const PackOptions& o) {
  std::vector<QuantExpert> out;
  const int64_t e1 = o.expert_end < 0 ? src.num_experts : o.expert_end;
  for (int64_t e = o.expert_begin; e < e1; ++e)
    out.push_back(QuantizeExpert(*src.expert(e), src, o).value());
  return out;
}

std::string FmtName(FormatCase c) { return WeightFormatName(c.f, c.group); }

std::vector<float> RunLayer(const PackedMoeLayer& L, const testing::Batch& b, ThreadPool& pool,
                            RunOptions ro) {
  auto ws = MoeWorkspace::Create(L, std::max<int64_t>(b.T, 1), b.K, pool);
  EXPECT_TRUE(ws.ok()) << ws.status();
  std::vector<float> out(static_cast<size_t>(b.T * L.hidden()), -1.0f);
  absl::Status s = RunMoe(L, b.input(), out.data(), pool, **ws, ro);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// ---- pack -------------------------------------------------------------------------

TEST(PackTest, UnpackInvertsPackForEveryFormat) {
  for (bool fp8 : {false, true}) {
    auto src = RandomSource(197, 75, 3, 1, fp8);
    for (FormatCase fc :
         {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
          FormatCase{WeightFormat::kInt4, 32}, FormatCase{WeightFormat::kInt4, 128}}) {
      PackOptions o;
      o.format = fc.f;
      o.group = fc.group;
      o.i_begin = 64;  // a TP slice that ends inside an int4 group (I = 75)
      o.i_end = 75;
      auto L = Pack(src, o, SharedPool());
      ASSERT_TRUE(L.ok()) << L.status();
      for (int64_t e = 0; e < 3; ++e) {
        auto q = QuantizeExpert(*src.expert(e), src, o).value();
        auto u = UnpackExpert(*L, e).value();
        for (auto [a, b] :
             {std::pair{&q.gate, &u.gate}, std::pair{&q.up, &u.up}, std::pair{&q.down, &u.down}}) {
          EXPECT_EQ(a->rows, b->rows);
          EXPECT_EQ(a->bf16, b->bf16) << FmtName(fc);
          EXPECT_EQ(a->q, b->q) << FmtName(fc);
          EXPECT_EQ(a->scale, b->scale) << FmtName(fc);
        }
      }
    }
  }
}

// PackExpert takes only an expert quantized as the layer is: another int4
// group would pair weights with the wrong scales, short vectors would be read
// past their ends.
TEST(PackTest, PackExpertRefusesAnExpertQuantizedOtherwise) {
  auto src = RandomSource(192, 64, 2, 1);
  PackOptions o64;
  o64.format = WeightFormat::kInt4;
  o64.group = 64;
  PackOptions o128 = o64;
  o128.group = 128;
  auto L = PackedMoeLayer::Allocate(192, 64, 2, o128, SharedPool()).value();
  auto q = QuantizeExpert(*src.expert(0), src, o64).value();
  auto expect = [&](const QuantExpert& bad, const std::string& says) {
    absl::Status st = PackExpert(bad, 0, L);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << says << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(says));
  };
  expect(q, "gate: group 64; the layer is int4 group 128");
  auto good = QuantizeExpert(*src.expert(0), src, o128).value();
  EXPECT_TRUE(PackExpert(good, 0, L).ok());
  QuantExpert shorter = good;
  shorter.down.scale.pop_back();
  expect(shorter, "down: ");
  shorter = good;
  shorter.up.q.resize(10);
  expect(shorter, "up: ");
  QuantExpert int8 = QuantizeExpert(*src.expert(0), src, PackOptions{}).value();
  expect(int8, "gate: bf16");
  EXPECT_TRUE(PackExpert(good, 1, L).ok());
}

TEST(PackTest, Fp8SourceWithoutBlockSizeIsInvalidArgument) {
  auto src = RandomSource(130, 40, 1, 2, /*fp8=*/true);
  for (int64_t block : {0, -128}) {
    src.fp8_block = block;
    const absl::Status s = Pack(src, {}, SharedPool()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("fp8 block size must be > 0"), std::string_view::npos) << s;
  }
}

TEST(PackTest, RejectsBadOptions) {
  auto src = RandomSource(64, 32, 2, 3);
  // Each bad option: INVALID_ARGUMENT with a message naming it.
  auto expect_bad = [&](const PackOptions& o, std::string_view what) {
    const absl::Status s = Pack(src, o, SharedPool()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(std::string(s.message()).find(what), std::string::npos) << s;
  };
  for (const auto& [bad, what] : testing::BadQuantOptionsForI32()) {
    PackOptions o;
    static_cast<QuantOptions&>(o) = bad;
    expect_bad(o, what);
  }
  PackOptions o;
  o.format = WeightFormat::kInt4;
  o.group = 32;
  o.expert_begin = 2;  // empty range of 2 experts
  expect_bad(o, "bad expert range [2, 2) of 2");
  o.expert_begin = 0;
  o.expert_end = 3;
  expect_bad(o, "bad expert range [0, 3) of 2");
}

// ---- kernels vs reference --------------------------------------------------------

using Param = std::tuple<Isa, FormatCase, int /*T*/, int /*shape*/>;

class MoeKernelTest : public ::testing::TestWithParam<Param> {};

// Packs a random layer, runs it with `ro` and compares with the reference.
// shape 0: H 197, I 75, E 6, top-3; shape 1: H 520, I 136, E 9, top-4;
// shape 2: H 2100, I 150, E 4, top-2 (rows longer than the AMX K chunk, so
// partial C is carried between chunks in bf16 and int8); shape 3: H 528,
// I 1100, E 3, top-2 (H a multiple of 16; the down GEMM's K also spans two
// chunks).
void CheckAgainstReference(FormatCase fc, int T, int shape, const RunOptions& ro) {
  struct Shape {
    int64_t H, I, E;
    int K;
  };
  const Shape sh = shape == 0   ? Shape{197, 75, 6, 3}
                   : shape == 1 ? Shape{520, 136, 9, 4}
                   : shape == 2 ? Shape{2100, 150, 4, 2}
                                : Shape{528, 1100, 3, 2};
  auto src = RandomSource(sh.H, sh.I, sh.E, 10 + static_cast<uint64_t>(shape));
  PackOptions o;
  o.format = fc.f;
  o.group = fc.group;
  auto L = Pack(src, o, SharedPool());
  ASSERT_TRUE(L.ok()) << L.status();
  // The expert with no tokens: the last one for odd T, a middle one (its
  // successors' row offsets must skip it) for even T.
  const int64_t empty = T % 2 == 1 ? sh.E - 1 : sh.E / 2;
  auto b =
      RandomBatch(T, sh.K, sh.H, sh.E, 100 + static_cast<uint64_t>(T), /*repeats=*/true, empty);
  if (T >= 17) {  // the routing must exercise what the test claims
    int repeats = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int j = 1; j < sh.K; ++j)
        for (int jj = 0; jj < j; ++jj)
          repeats +=
              b.ids[static_cast<size_t>(t * sh.K + j)] == b.ids[static_cast<size_t>(t * sh.K + jj)];
    ASSERT_GT(repeats, 0) << "T=" << T << ": no token routed to one expert twice";
  }
  for (int32_t id : b.ids) ASSERT_NE(id, empty);
  auto out = RunLayer(*L, b, SharedPool(), ro);
  std::vector<float> ref(out.size());
  ASSERT_TRUE(RunMoeReference(QuantizeAll(src, o), sh.H, 0, b.input(), ref.data(), ro).ok());
  EXPECT_LE(RelErr(out, ref), Bound(fc.f, ro))
      << IsaName(*ro.isa) << (ro.emulate_amx ? " (AMX model) " : " ") << FmtName(fc) << " T=" << T;
}

TEST_P(MoeKernelTest, MatchesReference) {
  const auto [isa, fc, T, shape] = GetParam();
  if (auto why = IsaUnavailable(isa)) GTEST_SKIP() << *why;
  RunOptions ro;
  ro.isa = isa;
  CheckAgainstReference(fc, T, shape, ro);
}

INSTANTIATE_TEST_SUITE_P(
    All, MoeKernelTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx),
                       ::testing::Values(FormatCase{WeightFormat::kBf16, 0},
                                         FormatCase{WeightFormat::kInt8, 0},
                                         FormatCase{WeightFormat::kInt4, 32},
                                         FormatCase{WeightFormat::kInt4, 64},
                                         FormatCase{WeightFormat::kInt4, 128}),
                       ::testing::Values(1, 3, 17, 300), ::testing::Values(0, 1)),
    [](const ::testing::TestParamInfo<Param>& p) {
      return absl::StrCat(std::string(IsaName(std::get<0>(p.param))), "_",
                          FmtName(std::get<1>(p.param)), "_T", std::get<2>(p.param), "_S",
                          std::get<3>(p.param));
    });

// Rows longer than the K chunk on the AMX hardware (the software model runs
// these shapes below): int8's 1 KiB chunk holds 1024 k, so only shapes 2
// and 3 carry partial C across chunks in int8 and make down span chunks.
INSTANTIATE_TEST_SUITE_P(LongK, MoeKernelTest,
                         ::testing::Combine(::testing::Values(Isa::kAmx),
                                            ::testing::Values(FormatCase{WeightFormat::kBf16, 0},
                                                              FormatCase{WeightFormat::kInt8, 0},
                                                              FormatCase{WeightFormat::kInt4, 64}),
                                            ::testing::Values(17, 120), ::testing::Values(2, 3)),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return absl::StrCat(FmtName(std::get<1>(p.param)), "_T",
                                               std::get<2>(p.param), "_S", std::get<3>(p.param));
                         });

// INT4 with every expert call "many" (weights dequantized to bf16): held to
// the BF16 bound, on every available kernel path.
TEST(MoeInt4ManyTest, MatchesReferenceAtTheBf16Bound) {
  for (IsaVariant v : AvailableVariants())
    for (int group : {32, 128})
      for (auto [T, shape] : {std::pair{3, 0}, std::pair{40, 1}, std::pair{24, 2}}) {
        if (v.emulate_amx && shape == 2) continue;  // the model is slow; shape 2 runs on hardware
        RunOptions ro;
        ro.isa = v.isa;
        ro.emulate_amx = v.emulate_amx;
        ro.many_threshold_int4 = 0;
        CheckAgainstReference({WeightFormat::kInt4, group}, T, shape, ro);
      }
}

// The staged int4 AMX path (AmxTuning::i4_stage) on single GEMMs: it issues
// the same tile products in the same k order as the unstaged path (only the
// K chunking differs, and partial C is stored exactly), so it must equal that
// path bit for bit, and the scalar kernel within float rounding. K spans
// chunks with a short last one (one group at G = 128); tasks start past
// panel 0, one with an odd count; m covers a lone 16-row block, one row pair
// and a tail (order0_rows = 0 stages them all). 128 KiB of scratch cannot
// stage 6 or more panels: that call must fall back to the unstaged path.
TEST(AmxInt4StageTest, MatchesUnstagedBitForBitAndScalar) {
  std::vector<std::pair<std::string, const kern::KernelSet*>> sets;
  if (!IsaUnavailable(Isa::kAvx512)) sets.emplace_back("AMX model", &kern::AmxEmulatedKernels());
  if (!IsaUnavailable(Isa::kAmx)) sets.emplace_back("AMX", &kern::AmxKernels());
  if (sets.empty()) GTEST_SKIP() << "needs AVX-512 (the AMX model's epilogues) or AMX";
  KernelTuning staged;
  staged.amx.order0_rows = 0;
  KernelTuning unstaged = staged;
  unstaged.amx.i4_stage = false;
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int group : {32, 64, 128}) {
    PackOptions o;
    o.format = WeightFormat::kInt4;
    o.group = group;
    // gate_up: K 1100 -> kp 1152: chunks of 512, 512, 128 k. down: K 600 ->
    // kp 640: 512, 128.
    auto L = PackRandom(1100, 600, 1, o, SharedPool(), 100 + group);
    ASSERT_TRUE(L.ok()) << L.status();
    const auto& part = L->parts()[0];
    struct Mat {
      const char* name;
      const PackedGeom* g;
      const uint8_t* w;
      int64_t nb0, nb1;
    };
    for (const Mat& mt : {Mat{"gate_up", &part.gu, part.gate_up(0), 10, 32},
                          Mat{"down", &part.down, part.down_w(0), 5, 26}}) {
      const PackedGeom& g = *mt.g;
      for (int m : {9, 17, 32, 100}) {
        const int mp = (m + 31) / 32 * 32;
        std::vector<uint16_t> A(static_cast<size_t>(mp * g.kp), 0);
        for (int r = 0; r < m; ++r)
          for (int64_t k = 0; k < g.k; ++k)
            A[static_cast<size_t>(r * g.kp + k)] = F32ToBf16(u(rng));
        const int64_t ldc = (mt.nb1 - mt.nb0) * 16;
        auto run = [&](const kern::KernelSet& ks, const KernelTuning& t, int64_t scratch_bytes) {
          auto scratch = NumaBuffer::Allocate(static_cast<size_t>(scratch_bytes), -1);
          EXPECT_TRUE(scratch.ok()) << scratch.status();
          std::vector<float> c(static_cast<size_t>(mp * ldc), 0.0f);
          kern::GemmArgs a;
          a.g = &g;
          a.w = mt.w;
          a.nb0 = mt.nb0;
          a.nb1 = mt.nb1;
          a.a = A.data();
          a.lda = g.kp * 2;
          a.m = m;
          a.c = c.data();
          a.ldc = ldc;
          a.scratch = scratch->data();
          a.scratch_bytes = scratch_bytes;
          a.tuning = &t;
          ks.i4_bf16(a);
          c.resize(static_cast<size_t>(m * ldc));  // rows >= m may be left unwritten
          return c;
        };
        const std::vector<float> ref = run(kern::ScalarKernels(), unstaged, 1 << 20);
        for (const auto& [name, ks] : sets) {
          const std::string where = absl::StrCat(name, " G=", group, " ", mt.name, " panels [",
                                                 mt.nb0, ", ", mt.nb1, ") m=", m);
          const std::vector<float> plain = run(*ks, unstaged, 1 << 20);
          EXPECT_LE(RelErr(plain, ref), 1e-5) << where;
          EXPECT_EQ(run(*ks, staged, 1 << 20), plain) << where << " staged";
          EXPECT_EQ(run(*ks, staged, 128 << 10), plain) << where << " staged, 128 KiB scratch";
        }
      }
    }
  }
}

// The AMX kernels on the software tile model (kernels_amx.cc EmuTiles): the
// AMX code path (tile layouts, K chunks, row chunks, prefetch bookkeeping)
// checked on CPUs without AMX. T = 1100 on shape 0 gives ~550 rows per
// expert: two row chunks per expert; T >= 32 quantizes int8 tokens once.
using EmuParam = std::tuple<FormatCase, int /*T*/, int /*shape*/>;
class AmxEmulationTest : public ::testing::TestWithParam<EmuParam> {};

TEST_P(AmxEmulationTest, MatchesReference) {
  if (auto why = IsaUnavailable(Isa::kAvx512))
    GTEST_SKIP() << "the AMX model's epilogues need AVX-512: " << *why;
  const auto [fc, T, shape] = GetParam();
  RunOptions ro;
  ro.isa = Isa::kAvx512;
  ro.emulate_amx = true;
  CheckAgainstReference(fc, T, shape, ro);
}

INSTANTIATE_TEST_SUITE_P(All, AmxEmulationTest,
                         ::testing::Values(EmuParam{{WeightFormat::kBf16, 0}, 17, 0},
                                           EmuParam{{WeightFormat::kBf16, 0}, 300, 1},
                                           EmuParam{{WeightFormat::kBf16, 0}, 1100, 0},
                                           EmuParam{{WeightFormat::kInt8, 0}, 17, 0},
                                           EmuParam{{WeightFormat::kInt8, 0}, 300, 1},
                                           EmuParam{{WeightFormat::kInt8, 0}, 1100, 0},
                                           EmuParam{{WeightFormat::kInt4, 32}, 300, 1},
                                           EmuParam{{WeightFormat::kInt4, 64}, 1100, 0},
                                           EmuParam{{WeightFormat::kInt4, 128}, 300, 0},
                                           EmuParam{{WeightFormat::kBf16, 0}, 200, 2},
                                           EmuParam{{WeightFormat::kInt8, 0}, 200, 2}),
                         [](const ::testing::TestParamInfo<EmuParam>& p) {
                           return absl::StrCat(FmtName(std::get<0>(p.param)), "_T",
                                               std::get<1>(p.param), "_S", std::get<2>(p.param));
                         });

// The tuning knobs (tuning.h) change loop orders, K-chunk sizes, task
// sizes, prefetch and streaming: every setting must give the same numerics.
// Settings are spelled as the environment variables the benchmark reads.
using TuningSetting = std::vector<std::pair<std::string, std::string>>;
KernelTuning TuningOf(const TuningSetting& setting) {
  auto t = KernelTuningFromEnv([&](const char* name) -> const char* {
    for (const auto& [k, v] : setting)
      if (k == name) return v.c_str();
    return nullptr;
  });
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : KernelTuning();
}

// Every benchmark knob setting of kernels_amx.cc / moe.cc that changes the
// code path, on the AMX software model, against the reference: one test per
// setting (each with its own ctest time limit; CI also runs them under ASan).
const std::vector<TuningSetting>& TuningSettings() {
  static const std::vector<TuningSetting> settings = {
      {{"HMOE_AMX_ORDER", "0"}, {"HMOE_AMX_KC_BYTES", "512"}},
      {{"HMOE_AMX_KC_BYTES", "512"}},
      {{"HMOE_AMX_PREFETCH", "0"}, {"HMOE_AMX_STREAM", "0"}, {"HMOE_AMX_KC_BYTES", "4096"}},
      {{"HMOE_MOE_TASK_PANELS", "32"}, {"HMOE_AMX_KC_BYTES", "512"}},
      {{"HMOE_AMX_KC_BYTES", "256"}},
      {{"HMOE_MOE_TASK_PANELS", "4"}},
      {{"HMOE_MOE_TASK_PANELS", "32"}},
      {{"HMOE_MOE_LOOKAHEAD", "0"}, {"HMOE_MOE_TASK_PANELS", "2"}},
      // Session 7's loads and K chunks.
      {{"HMOE_AMX_STREAM", "0"}, {"HMOE_AMX_KC_BYTES", "2048"}},
      {{"HMOE_MOE_GATHER_STREAM", "0"}},
      {{"HMOE_FEW_PF_I4", "0"}, {"HMOE_FEW_PF_I8", "4096"}, {"HMOE_FEW_PF_BF16", "0"}},
      // Order 0 for every call, with 256-byte K chunks and with 4-panel tasks.
      {{"HMOE_AMX_ORDER", "0"}, {"HMOE_AMX_KC_BYTES", "256"}},
      {{"HMOE_AMX_ORDER", "0"}, {"HMOE_MOE_TASK_PANELS", "4"}},
      // Two-panel tasks.
      {{"HMOE_MOE_TASK_PANELS", "2"}},
      // Tasks claimed one at a time (no look-ahead).
      {{"HMOE_MOE_LOOKAHEAD", "0"}},
      // Padding row blocks computed (before tail16); with order 0.
      {{"HMOE_AMX_TAIL16", "0"}},
      {{"HMOE_AMX_TAIL16", "0"}, {"HMOE_AMX_ORDER", "0"}},
      // Order 1 for every call size, and order 0 for every call of <= 512
      // rows (the defaults switch at 32 rows).
      {{"HMOE_AMX_ORDER0_ROWS", "0"}},
      {{"HMOE_AMX_ORDER0_ROWS", "512"}},
      // int4 unstaged (order 0, 2 KiB chunks); staged with 128-k chunks (the
      // next chunk dequantized between k steps) and tasks of up to 32 panels.
      {{"HMOE_AMX_I4_STAGE", "0"}},
      {{"HMOE_AMX_KC_BYTES", "256"}, {"HMOE_MOE_TASK_PANELS", "32"}},
  };
  return settings;
}

// One tuning setting against the reference on the "many" kernels `ro`
// selects: calls of 7-28 rows (one row pair: the small-call loop order, a
// lone 16-row block), 45-509 rows (row pairs outer, tails of 1-16 rows), K
// across chunks.
void CheckTuningSetting(RunOptions ro) {
  CheckAgainstReference({WeightFormat::kInt8, 0}, 17, 0, ro);
  CheckAgainstReference({WeightFormat::kBf16, 0}, 17, 0, ro);
  CheckAgainstReference({WeightFormat::kBf16, 0}, 200, 2, ro);
  CheckAgainstReference({WeightFormat::kInt8, 0}, 300, 1, ro);
  CheckAgainstReference({WeightFormat::kInt4, 64}, 300, 0, ro);
}

class AmxEmulationTuningTest : public ::testing::TestWithParam<size_t> {};

TEST_P(AmxEmulationTuningTest, MatchesReference) {
  const TuningSetting& setting = TuningSettings()[GetParam()];
  RunOptions ro;
  ro.tuning = TuningOf(setting);
  // Every variable of the setting moves its knob off the default.
  const std::string changed = " " + KernelTuningToString(ro.tuning);
  for (const auto& [k, v] : setting)
    ASSERT_NE(changed.find(" " + k + "="), std::string::npos) << k << "=" << v << " is the default";
  if (auto why = IsaUnavailable(Isa::kAvx512))
    GTEST_SKIP() << "the AMX model's epilogues need AVX-512: " << *why;
  ro.isa = Isa::kAvx512;
  ro.emulate_amx = true;
  CheckTuningSetting(ro);
}

// Test names: the setting spelled out, e.g. AMX_ORDER_0__AMX_KC_BYTES_512.
std::string TuningSettingName(const ::testing::TestParamInfo<size_t>& info) {
  std::string name;
  for (const auto& [k, v] : TuningSettings()[info.param]) {
    if (!name.empty()) name += "__";
    absl::StrAppend(&name, absl::StripPrefix(k, "HMOE_"), "_", v);
  }
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return absl::StrCat(info.param, "_", name);
}
INSTANTIATE_TEST_SUITE_P(Settings, AmxEmulationTuningTest,
                         ::testing::Range<size_t>(0, TuningSettings().size()), TuningSettingName);

// The same settings on the AMX hardware (real tile configurations, loads
// with tileloaddt1, prefetches), where the CPU has it.
class AmxTuningTest : public ::testing::TestWithParam<size_t> {};

TEST_P(AmxTuningTest, MatchesReference) {
  RunOptions ro;
  ro.tuning = TuningOf(TuningSettings()[GetParam()]);
  if (auto why = IsaUnavailable(Isa::kAmx)) GTEST_SKIP() << *why;
  ro.isa = Isa::kAmx;
  CheckTuningSetting(ro);
  CheckAgainstReference({WeightFormat::kInt8, 0}, 120, 3, ro);  // down's K spans two chunks
}
INSTANTIATE_TEST_SUITE_P(Settings, AmxTuningTest,
                         ::testing::Range<size_t>(0, TuningSettings().size()), TuningSettingName);

// Shard: experts [2, 5) of 7 and intermediate slice [32, 75); foreign ids,
// ids of other shards and tokens with no owned expert. Every available
// kernel path.
TEST(MoeShardTest, ExpertRangeAndTensorParallelSlice) {
  auto src = RandomSource(200, 75, 7, 21);
  for (IsaVariant v : AvailableVariants()) {
    for (FormatCase fc : {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
                          FormatCase{WeightFormat::kInt4, 32}, FormatCase{WeightFormat::kInt4, 64},
                          FormatCase{WeightFormat::kInt4, 128}}) {
      PackOptions o;
      o.format = fc.f;
      o.group = fc.group;
      o.expert_begin = 2;
      o.expert_end = 5;
      o.i_begin = 32;
      o.i_end = 75;
      auto L = Pack(src, o, SharedPool()).value();
      for (int T : {1, 17, 64}) {
        auto b =
            RandomBatch(T, 4, 200, 7, 7 + static_cast<uint64_t>(T), true, -1, /*foreign=*/true);
        RunOptions ro;
        ro.isa = v.isa;
        ro.emulate_amx = v.emulate_amx;
        auto out = RunLayer(L, b, SharedPool(), ro);
        std::vector<float> ref(out.size());
        ASSERT_TRUE(RunMoeReference(QuantizeAll(src, o), 200, 2, b.input(), ref.data(), ro).ok());
        EXPECT_LE(RelErr(out, ref), Bound(fc.f, ro))
            << IsaName(v.isa) << (v.emulate_amx ? " (AMX model) " : " ") << FmtName(fc)
            << " T=" << T;
      }
    }
  }
}

// BF16 partials of two TP shards add up to the unsharded result.
TEST(MoeShardTest, TensorParallelPartialsSum) {
  auto src = RandomSource(130, 150, 4, 5);
  auto b = RandomBatch(9, 2, 130, 4, 77);
  PackOptions o;
  auto full = RunLayer(Pack(src, o, SharedPool()).value(), b, SharedPool(), {});
  o.i_end = 64;
  auto a = RunLayer(Pack(src, o, SharedPool()).value(), b, SharedPool(), {});
  o.i_begin = 64;
  o.i_end = -1;
  auto c = RunLayer(Pack(src, o, SharedPool()).value(), b, SharedPool(), {});
  for (size_t i = 0; i < a.size(); ++i) a[i] += c[i];
  EXPECT_LE(RelErr(a, full), 3e-3);
}

TEST(MoeEdgeTest, NoOwnedExpertsGivesZerosAndRepeatsCount) {
  auto src = RandomSource(96, 48, 3, 8);
  auto L = Pack(src, {}, SharedPool()).value();
  testing::Batch b = RandomBatch(3, 2, 96, 3, 9);
  b.ids = {7, -1, 1, 1, 2, 0};  // token 0: nothing owned; token 1: expert 1 twice
  b.w = {1, 1, 0.25f, 0.75f, 0.5f, 0.5f};
  auto out = RunLayer(L, b, SharedPool(), {});
  for (int64_t c = 0; c < 96; ++c) EXPECT_EQ(out[static_cast<size_t>(c)], 0.0f);
  testing::Batch one = b;
  one.ids = {7, -1, 1, -1, 2, 0};
  one.w = {1, 1, 1.0f, 0, 0.5f, 0.5f};
  auto out1 = RunLayer(L, one, SharedPool(), {});
  std::vector<float> t1(out.begin() + 96, out.begin() + 192),
      u1(out1.begin() + 96, out1.begin() + 192);
  EXPECT_LE(RelErr(t1, u1), 1e-6);
}

// A token whose hidden state is all zeros and subnormals (amax / 127 below
// FLT_MIN) through the whole operator, every path, both regimes: its output
// stays finite and ~0, the other tokens match the reference. (QuantTest
// checks that such a row quantizes to zeros.)
TEST(MoeEdgeTest, SubnormalActivationsQuantizeToZeros) {
  constexpr int64_t H = 96;
  auto src = RandomSource(H, 40, 3, 5);
  for (FormatCase fc : {FormatCase{WeightFormat::kInt8, 0}, FormatCase{WeightFormat::kInt4, 32}}) {
    PackOptions o;
    o.format = fc.f;
    o.group = fc.group;
    auto L = Pack(src, o, SharedPool()).value();
    auto q = QuantizeAll(src, o);
    auto b = RandomBatch(3, 2, H, 3, 8);
    for (int64_t c = 0; c < H; ++c) b.x[static_cast<size_t>(H + c)] = c % 3 == 0 ? 0x0001 : 0;
    for (int many : {1 << 30, 0}) {  // all "few", all "many"
      RunOptions ro;
      ro.many_threshold = many;
      ro.many_threshold_int4 = many;
      std::vector<float> ref(static_cast<size_t>(3 * H));
      ASSERT_TRUE(RunMoeReference(q, H, 0, b.input(), ref.data(), ro).ok());
      for (IsaVariant v : AvailableVariants()) {
        ro.isa = v.isa;
        ro.emulate_amx = v.emulate_amx;
        const std::string what = absl::StrCat(FmtName(fc), " ", std::string(IsaName(v.isa)),
                                              v.emulate_amx ? "(model)" : "", " many>", many);
        auto out = RunLayer(L, b, SharedPool(), ro);
        for (int64_t c = 0; c < H; ++c) {
          const float y = out[static_cast<size_t>(H + c)];
          ASSERT_TRUE(std::isfinite(y) && std::fabs(y) < 1e-30f)
              << what << " col " << c << ": " << y;
        }
        for (float y : out) ASSERT_TRUE(std::isfinite(y)) << what;
        EXPECT_LE(RelErr(out, ref), Bound(fc.f, ro)) << what;
      }
    }
  }
}

// A NaN activation makes its token's output NaN on every format, regime and
// ISA, as bf16 weights always did; int8 activations used to drop it (a
// finite, wrong row whose value depended on the ISA). Other tokens unharmed.
TEST(MoeEdgeTest, NanActivationMakesOnlyItsTokenNonFinite) {
  constexpr int64_t H = 96, T = 3;
  auto src = RandomSource(H, 40, 3, 6);
  for (FormatCase fc : {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
                        FormatCase{WeightFormat::kInt4, 32}}) {
    PackOptions o;
    o.format = fc.f;
    o.group = fc.group;
    auto L = Pack(src, o, SharedPool()).value();
    auto q = QuantizeAll(src, o);
    auto b = RandomBatch(T, 2, H, 3, 9);
    b.x[static_cast<size_t>(H + 5)] = 0x7fc0;  // token 1, column 5: NaN
    auto rows = [&](const std::vector<float>& v, int64_t t) {
      return std::vector<float>(v.begin() + t * H, v.begin() + (t + 1) * H);
    };
    for (int many : {1 << 30, 0}) {  // all "few", all "many"
      RunOptions ro;
      ro.many_threshold = many;
      ro.many_threshold_int4 = many;
      std::vector<float> ref(static_cast<size_t>(T * H));
      ASSERT_TRUE(RunMoeReference(q, H, 0, b.input(), ref.data(), ro).ok());
      for (float y : rows(ref, 1)) ASSERT_TRUE(std::isnan(y)) << FmtName(fc) << " reference";
      for (IsaVariant v : AvailableVariants()) {
        ro.isa = v.isa;
        ro.emulate_amx = v.emulate_amx;
        const std::string what = absl::StrCat(FmtName(fc), " ", std::string(IsaName(v.isa)),
                                              v.emulate_amx ? "(model)" : "", " many>", many);
        auto out = RunLayer(L, b, SharedPool(), ro);
        for (float y : rows(out, 1)) ASSERT_TRUE(std::isnan(y)) << what << ": " << y;
        for (int64_t t : {0, 2})
          EXPECT_LE(RelErr(rows(out, t), rows(ref, t)), Bound(fc.f, ro)) << what << " token " << t;
      }
    }
  }
}

TEST(MoeEdgeTest, WorkspaceTooSmallIsInvalidArgument) {
  auto src = RandomSource(64, 32, 2, 3);
  auto L = Pack(src, {}, SharedPool()).value();
  auto ws = MoeWorkspace::Create(L, 4, 2, SharedPool()).value();
  auto b = RandomBatch(5, 2, 64, 2, 1);
  std::vector<float> out(5 * 64);
  EXPECT_EQ(RunMoe(L, b.input(), out.data(), SharedPool(), *ws).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- virtual NUMA: tensor parallel across nodes equals one node ---------------------

// Two threads split into two virtual nodes.
std::unique_ptr<ThreadPool> TwoNodePool() {
  ThreadPoolOptions po;
  po.max_threads = 2;
  po.virtual_nodes = 2;
  auto pool = ThreadPool::Create(po);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

// `src` packed for the shared one-node pool and for `pool2` (two parts).
std::pair<PackedMoeLayer, PackedMoeLayer> PackOneAndTwoNodes(const MoeWeightsSource& src,
                                                             FormatCase fc, ThreadPool& pool2) {
  PackOptions o;
  o.format = fc.f;
  o.group = fc.group;
  auto one = Pack(src, o, SharedPool()).value();
  auto two = Pack(src, o, pool2).value();
  EXPECT_EQ(two.parts().size(), 2u);
  return {std::move(one), std::move(two)};
}

// A workspace's buffers are sized and strided for one layer shape and pool
// layout: any other layer or pool is INVALID_ARGUMENT naming what differs,
// never an overrun or a wait for tasks no worker runs.
TEST(MoeNumaTest, WorkspaceMustFitLayerAndPool) {
  auto pool2 = TwoNodePool();
  ASSERT_NE(pool2, nullptr);
  auto L = Pack(RandomSource(64, 64, 2, 3), {}, SharedPool()).value();
  auto wider = Pack(RandomSource(64, 2048, 2, 3), {}, SharedPool()).value();
  auto taller = Pack(RandomSource(128, 64, 2, 3), {}, SharedPool()).value();
  auto L2 = Pack(RandomSource(64, 64, 2, 3), {}, *pool2).value();
  auto ws = MoeWorkspace::Create(L, 4, 2, SharedPool()).value();
  auto ws2 = MoeWorkspace::Create(L2, 4, 2, *pool2).value();
  auto b = RandomBatch(2, 2, 128, 2, 1);  // x rows wide enough for every layer here
  std::vector<float> out(2 * 128);
  auto expect = [&](absl::Status s, std::string_view what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
    EXPECT_NE(std::string(s.message()).find(what), std::string_view::npos) << s;
  };
  expect(RunMoe(wider, b.input(), out.data(), SharedPool(), *ws), "intermediate");
  expect(RunMoe(taller, b.input(), out.data(), SharedPool(), *ws), "hidden");
  expect(RunMoe(L2, b.input(), out.data(), SharedPool(), *ws), "node parts");
  expect(RunMoe(L, b.input(), out.data(), *pool2, *ws), "pool (nodes)");
  expect(RunMoe(L2, b.input(), out.data(), SharedPool(), *ws2), "pool (nodes)");
  EXPECT_TRUE(RunMoe(L, b.input(), out.data(), SharedPool(), *ws).ok());
  EXPECT_TRUE(RunMoe(L2, b.input(), out.data(), *pool2, *ws2).ok());
}

// What the memory check counts is what Create allocates, for every format,
// odd sizes and both pool layouts; Plan's node bytes are Allocate's.
TEST(MoeNumaTest, WorkspaceAndLayerBytesArePredicted) {
  auto pool2 = TwoNodePool();
  ASSERT_NE(pool2, nullptr);
  for (FormatCase fc : {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
                        FormatCase{WeightFormat::kInt4, 32}, FormatCase{WeightFormat::kMxfp4, 32},
                        FormatCase{WeightFormat::kInt4Bf16, 32},
                        FormatCase{WeightFormat::kFp8, 128}, FormatCase{WeightFormat::kMxfp8, 32}})
    for (ThreadPool* pool : {&SharedPool(), pool2.get()}) {
      PackOptions o;
      o.format = fc.f;
      o.group = fc.group;
      const auto L = PackedMoeLayer::Allocate(96, 200, 5, o, *pool).value();
      const auto plan = PackedMoeLayer::Plan(96, 200, 5, o, *pool).value();
      std::map<int, int64_t> allocated;
      for (size_t p = 0; p < L.parts().size(); ++p)
        if (L.parts()[p].mem.size() > 0)
          allocated[pool->mem_node(static_cast<int>(p))] +=
              static_cast<int64_t>(L.parts()[p].mem.size());
      std::map<int, int64_t> planned = plan.NodeBytes(*pool);
      std::erase_if(planned, [](const auto& kv) { return kv.second == 0; });
      EXPECT_EQ(planned, allocated) << WeightFormatName(fc.f) << " nodes " << pool->num_nodes();
      for (int64_t T : {1, 7, 300}) {
        auto ws = MoeWorkspace::Create(L, T, 3, *pool).value();
        EXPECT_EQ(MoeWorkspace::NodeBytes(plan, T, 3, *pool), ws->node_bytes())
            << WeightFormatName(fc.f) << " T " << T << " nodes " << pool->num_nodes();
      }
    }
}

// Only int8 and int4 calls take int8 activations: a native-format layer's
// workspace holds none of their buffers (per-token int8 rows, int8 h), so it
// is bf16's for the same padded dims, and int4's is larger by exactly them.
TEST(MoeNumaTest, NativeFormatWorkspacesHoldNoInt8Activations) {
  const int64_t H = 256, I = 256, T = 300;
  const int K = 3;
  auto layer = [&](WeightFormat f, int group) {
    PackOptions o;
    o.format = f;
    o.group = group;
    return PackedMoeLayer::Plan(H, I, 5, o, SharedPool()).value();
  };
  auto total = [](const std::map<int, int64_t>& m) {
    int64_t n = 0;
    for (const auto& [node, bytes] : m) n += bytes;
    return n;
  };
  const auto bf16 = layer(WeightFormat::kBf16, 0);
  const int64_t bf16_bytes = total(MoeWorkspace::NodeBytes(bf16, T, K, SharedPool()));
  for (FormatCase fc :
       {FormatCase{WeightFormat::kMxfp4, 32}, FormatCase{WeightFormat::kInt4Bf16, 32},
        FormatCase{WeightFormat::kFp8, 128}, FormatCase{WeightFormat::kMxfp8, 32}}) {
    SCOPED_TRACE(WeightFormatName(fc.f));
    const auto L = layer(fc.f, fc.group);
    ASSERT_EQ(L.parts()[0].gu.kp, bf16.parts()[0].gu.kp);
    ASSERT_EQ(L.parts()[0].down.kp, bf16.parts()[0].down.kp);
    EXPECT_EQ(total(MoeWorkspace::NodeBytes(L, T, K, SharedPool())), bf16_bytes);
  }
  const auto i4 = layer(WeightFormat::kInt4, 32);
  ASSERT_EQ(i4.parts()[0].gu.kp, bf16.parts()[0].gu.kp);
  ASSERT_EQ(i4.parts()[0].down.kp, bf16.parts()[0].down.kp);
  const int64_t slots = T * K, rows = slots + 32 * std::min<int64_t>(5, slots);
  auto page = [](int64_t b) { return (b + 4095) / 4096 * 4096; };
  EXPECT_EQ(total(MoeWorkspace::NodeBytes(i4, T, K, SharedPool())),
            bf16_bytes + page(T * bf16.parts()[0].gu.kp) +
                static_cast<int64_t>(bf16.parts().size()) * page(rows * bf16.parts()[0].down.kp));
}

TEST(MoeNumaTest, VirtualNodesMatchOneNode) {
  auto pool2 = TwoNodePool();
  ASSERT_NE(pool2, nullptr);
  ASSERT_EQ(pool2->num_nodes(), 2);
  auto src = RandomSource(200, 300, 5, 31);
  for (FormatCase fc :
       {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
        FormatCase{WeightFormat::kInt4, 64}, FormatCase{WeightFormat::kInt4, 128}}) {
    auto [L1, L2] = PackOneAndTwoNodes(src, fc, *pool2);
    ASSERT_EQ(L2.parts().size(), 2u);
    EXPECT_GT(L2.parts()[0].i1, L2.parts()[0].i0);
    EXPECT_EQ(L2.parts()[0].i1, L2.parts()[1].i0);
    EXPECT_EQ(L1.expert_bytes() > 0, true);
    // Default dispatch, and (with AVX-512) the AMX code path on the tile model.
    std::vector<RunOptions> variants(1);
    if (DetectedIsa() >= Isa::kAvx512) {
      variants.emplace_back();
      variants.back().isa = Isa::kAvx512;
      variants.back().emulate_amx = true;
    }
    for (const RunOptions& ro : variants)
      for (int T : {1, 3, 40}) {
        auto b = RandomBatch(T, 3, 200, 5, 50 + static_cast<uint64_t>(T));
        auto a1 = RunLayer(L1, b, SharedPool(), ro);
        auto a2 = RunLayer(L2, b, *pool2, ro);
        EXPECT_LE(RelErr(a2, a1), 1e-5)
            << FmtName(fc) << " T=" << T << (ro.emulate_amx ? " (AMX model)" : "");
      }
  }
}

// The stage runs its items in whatever order the workers reach them, but
// every item does the same arithmetic: bit-identical outputs call after call
// on one workspace, as on a fresh one, on one node and on two virtual nodes
// (where an expert's hquant waits for both parts' gate_up).
TEST(MoePipelineTest, SameBitsCallAfterCall) {
  auto pool2 = TwoNodePool();
  ASSERT_NE(pool2, nullptr);
  auto src = RandomSource(200, 300, 7, 41);
  std::vector<RunOptions> variants(1);
  if (DetectedIsa() >= Isa::kAvx512) {
    variants.emplace_back();
    variants.back().isa = Isa::kAvx512;
    variants.back().emulate_amx = true;
  }
  for (FormatCase fc : {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0},
                        FormatCase{WeightFormat::kInt4, 64}}) {
    auto [L1, L2] = PackOneAndTwoNodes(src, fc, *pool2);
    for (const RunOptions& ro : variants)
      for (int T : {1, 5, 120}) {
        SCOPED_TRACE(absl::StrCat(FmtName(fc), " T=", T, ro.emulate_amx ? " (AMX model)" : ""));
        auto b = RandomBatch(T, 3, 200, 7, 90 + static_cast<uint64_t>(T), /*repeats=*/true,
                             /*empty_expert=*/6);
        for (auto [L, pool] : {std::pair<const PackedMoeLayer*, ThreadPool*>{&L1, &SharedPool()},
                               std::pair<const PackedMoeLayer*, ThreadPool*>{&L2, pool2.get()}}) {
          const std::vector<float> fresh = RunLayer(*L, b, *pool, ro);
          auto ws = MoeWorkspace::Create(*L, T, 3, *pool);
          ASSERT_TRUE(ws.ok()) << ws.status();
          for (int call = 0; call < 4; ++call) {
            std::vector<float> out(fresh.size(), -1.0f);
            ASSERT_TRUE(RunMoe(*L, b.input(), out.data(), *pool, **ws, ro).ok());
            ASSERT_EQ(out, fresh) << "call " << call << ", " << L->parts().size() << " part(s)";
          }
        }
      }
  }
}

// The same on every core of the machine (16 workers on the GPU machine, 2 in
// CI), one and two virtual nodes, many experts with small tasks, so workers
// race through the per-expert counters; the CPU's own "many" kernels (AMX
// where present).
TEST(MoePipelineTest, SameBitsCallAfterCallOnAllCores) {
  auto src = RandomSource(208, 320, 32, 43);
  for (int nodes : {1, 2}) {
    ThreadPoolOptions po;
    po.virtual_nodes = nodes;
    auto pool = ThreadPool::Create(po);
    ASSERT_TRUE(pool.ok()) << pool.status();
    for (FormatCase fc : {FormatCase{WeightFormat::kBf16, 0}, FormatCase{WeightFormat::kInt8, 0}}) {
      PackOptions o;
      o.format = fc.f;
      auto L = Pack(src, o, **pool);
      ASSERT_TRUE(L.ok()) << L.status();
      // Two batches, alternated: what a call leaves in the workspace (y, h,
      // gathered rows) is wrong for the next, so a read that runs ahead of
      // its writer shows.
      const Batch batches[2] = {
          RandomBatch(400, 4, 208, 32, 123, /*repeats=*/true, /*empty_expert=*/31),
          RandomBatch(400, 4, 208, 32, 321, /*repeats=*/true, /*empty_expert=*/30)};
      std::vector<float> fresh[2];
      for (int i = 0; i < 2; ++i) fresh[i] = RunLayer(*L, batches[i], **pool, {});
      ASSERT_NE(fresh[0], fresh[1]);
      auto ws = MoeWorkspace::Create(*L, 400, 4, **pool);
      ASSERT_TRUE(ws.ok()) << ws.status();
      for (int call = 0; call < 8; ++call) {
        const int i = call % 2;
        std::vector<float> out(fresh[i].size(), -1.0f);
        ASSERT_TRUE(RunMoe(*L, batches[i].input(), out.data(), **pool, **ws, {}).ok());
        ASSERT_EQ(out, fresh[i]) << FmtName(fc) << ", " << (*pool)->num_threads() << " workers, "
                                 << nodes << " node(s), call " << call;
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------------

// HMOE_ISA's value is read by the binaries (ParseIsaCap) and passed down as
// the requested cap; ResolveIsa reads no environment.
TEST(DispatchTest, EnvCapsAndFallback) {
  auto cap = [](const char* v) { return ParseIsaCap(v, "HMOE_ISA").value(); };
  {
    EXPECT_EQ(ResolveIsa(cap("scalar")).value(), Isa::kScalar);
    EXPECT_EQ(ResolveIsa(MinIsa(cap("scalar"), Isa::kAmx)).value(), Isa::kScalar);
  }
  { EXPECT_EQ(ResolveIsa(cap("AVX2")).value(), std::min(Isa::kAvx2, DetectedIsa())); }
  {
    EXPECT_EQ(ParseIsaCap("sse9", "HMOE_ISA").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ParseIsaCap("sse9", "HMOE_ISA").status().message(),
              "HMOE_ISA='sse9' is not one of amx|avx512|avx2|scalar");
    EXPECT_EQ(cap(""), std::nullopt);
    ScopedEnv e("HMOE_ISA", "scalar");  // no longer read below the binaries
    EXPECT_EQ(ResolveIsa(std::nullopt).value(), DetectedIsa());
  }
  EXPECT_EQ(ResolveIsa(Isa::kAmx).value(), DetectedIsa());  // falls back, never SIGILLs
  if (DetectedIsa() < Isa::kAmx) {
    EXPECT_EQ(ResolveIsa(Isa::kAmx, /*strict=*/true).status().code(),
              absl::StatusCode::kFailedPrecondition);
    // RunMoe asked for AMX on a CPU without it: runs on the best ISA available.
    auto src = RandomSource(64, 32, 2, 3);
    auto L = Pack(src, {}, SharedPool()).value();
    auto b = RandomBatch(40, 2, 64, 2, 4);
    RunOptions ro;
    ro.isa = Isa::kAmx;
    auto out = RunLayer(L, b, SharedPool(), ro);
    std::vector<float> ref(out.size());
    ASSERT_TRUE(RunMoeReference(QuantizeAll(src, {}), 64, 0, b.input(), ref.data(), ro).ok());
    EXPECT_LE(RelErr(out, ref), Bound(WeightFormat::kBf16));
    ro.strict_isa = true;
    auto ws = MoeWorkspace::Create(L, 40, 2, SharedPool()).value();
    EXPECT_EQ(RunMoe(L, b.input(), out.data(), SharedPool(), *ws, ro).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(ParseIsa("AMX"), Isa::kAmx);
  EXPECT_EQ(ParseIsa("avx512"), Isa::kAvx512);
  EXPECT_FALSE(ParseIsa("neon").has_value());
}

// DetectedIsa against the flags the kernel reports in /proc/cpuinfo: never
// above them; AVX2 and AVX-512 exactly as listed (AMX also needs the OS to
// grant XTILEDATA, so with the AMX flags it may stay at AVX-512).
TEST(DispatchTest, DetectedIsaAgreesWithCpuinfo) {
  std::printf("detected ISA: %s\n", std::string(IsaName(DetectedIsa())).c_str());
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) GTEST_SKIP() << "no /proc/cpuinfo";
  std::string flags;
  char line[8192];
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "flags", 5) == 0) {
      flags = absl::StrCat(" ", line);
      break;
    }
  std::fclose(f);
  if (flags.empty()) GTEST_SKIP() << "/proc/cpuinfo lists no flags";
  for (char& c : flags)
    if (c == '\t' || c == '\n' || c == ':') c = ' ';
  flags += ' ';
  auto has = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (flags.find(absl::StrCat(" ", n, " ")) == std::string::npos) return false;
    return true;
  };
  Isa listed = Isa::kScalar;
  if (has({"avx2", "fma", "f16c"})) listed = Isa::kAvx2;
  if (listed == Isa::kAvx2 &&
      has({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}))
    listed = Isa::kAvx512;
  const bool amx_listed = listed == Isa::kAvx512 && has({"amx_tile", "amx_bf16", "amx_int8"});
  if (amx_listed) {
    EXPECT_GE(DetectedIsa(), Isa::kAvx512);
  } else {
    EXPECT_EQ(DetectedIsa(), listed);
  }
}

TEST(TestUtilTest, RelErrFailsOnNonFiniteOrSizeMismatch) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(RelErr({1.0f, 2.0f}, {1.0f, 2.0f}), 0.0);
  EXPECT_NEAR(RelErr({1.0f, 2.5f}, {1.0f, 2.0f}), 0.25, 1e-12);
  EXPECT_TRUE(std::isinf(RelErr({nan, 2.0f}, {1.0f, 2.0f})));
  EXPECT_TRUE(std::isinf(RelErr({nan, nan}, {1.0f, 2.0f})));
  EXPECT_TRUE(std::isinf(RelErr({1.0f, 2.0f}, {1.0f, nan})));
  EXPECT_TRUE(std::isinf(RelErr({1.0f}, {1.0f, 2.0f})));
}

}  // namespace
}  // namespace hmoe
