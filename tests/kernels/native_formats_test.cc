// The native formats (mxfp4, int4bf16, fp8, mxfp8; packed.h native layout):
// packing round trip and footprint, and RunMoe on every kernel path against
// the scalar reference.
//
// Error bounds (max |out - ref| / max |ref|, and NMSE <= bound^2; NaN or inf
// anywhere fails):
//  * "few" (GEMV): the kernels sum x * v per scale group in fp32 and scale
//    the group sum; the reference sums x * f32(v * s) in double. Both use the
//    exact element values, so besides fp32 vs double summation (~1e-6) the
//    only difference is h = bf16(SiLU(g) * u) flipping by one bf16 ulp on
//    rare elements, as for BF16 weights (moe_test.cc): 3e-3.
//  * "many": weights are bf16(v * s) on both sides: the BF16 bound, 3e-3.
// A call mixes the regimes; both have the same bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/kernels/moe.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe {
namespace {

using testing::RandomBatch;
using testing::RandomSource;
using testing::RelErr;
using testing::SharedPool;

constexpr double kBound = 3e-3;

struct Fmt {
  WeightFormat f;
  int group;
};
std::string FmtName(Fmt c) { return WeightFormatName(c.f, c.group); }

const Fmt kFormats[] = {{WeightFormat::kMxfp4, 32},
                        {WeightFormat::kInt4Bf16, 32},
                        {WeightFormat::kFp8, 128},
                        {WeightFormat::kMxfp8, 32}};

// Sum (a - b)^2 / sum b^2 (+inf on a non-finite value or a size mismatch).
double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den == 0 ? num : num / den;
}

// The ISA asked for, or why this CPU (or HMOE_ISA) cannot run it.
std::optional<std::string> Unavailable(Isa isa) {
  if (isa > DetectedIsa())
    return absl::StrCat("this CPU supports up to ", std::string(IsaName(DetectedIsa())), ", not ",
                        std::string(IsaName(isa)));
  const char* env = std::getenv("HMOE_ISA");
  auto cap = ParseIsaCap(env != nullptr ? env : "", "HMOE_ISA");
  if (!cap.ok()) return cap.status().ToString();
  auto eff = ResolveIsa(MinIsa(isa, *cap));
  if (!eff.ok() || *eff != isa) return std::string("HMOE_ISA caps the ISA lower");
  return std::nullopt;
}

std::vector<QuantExpert> QuantizeAll(const MoeWeightsSource& src, const PackOptions& o) {
  std::vector<QuantExpert> out;
  const int64_t e1 = o.expert_end < 0 ? src.num_experts : o.expert_end;
  for (int64_t e = o.expert_begin; e < e1; ++e)
    out.push_back(QuantizeExpert(*src.expert(e), src, o).value());
  return out;
}

bool SameMatrix(const QuantMatrix& a, const QuantMatrix& b) {
  return a.format == b.format && a.group == b.group && a.rows == b.rows && a.cols == b.cols &&
         a.packed == b.packed && a.scale == b.scale && a.scale_bf16 == b.scale_bf16 &&
         a.scale_e8m0 == b.scale_e8m0;
}

std::unique_ptr<ThreadPool> TwoNodes() {
  ThreadPoolOptions o;
  o.max_threads = 2;
  o.virtual_nodes = 2;
  return ThreadPool::Create(o).value();
}

// ---- packing ------------------------------------------------------------------------

// Pack then UnpackExpert gives back the codes and scales bit for bit, on odd
// shapes (group and super-block tails in K, partial panels in N), a
// tensor-parallel slice, and two virtual nodes (K of down split in parts).
// The code -> bf16 tables the vector kernels look 4-bit values up in (an
// AVX-512 table once held the e2m1 negatives at the wrong 16 entries: every
// negative weight read positive).
TEST(NativeTables, FourBitTablesMatchTheReferenceDecoders) {
  for (int c = 0; c < 16; ++c) {
    SCOPED_TRACE(c);
    EXPECT_EQ(Bf16ToF32(kern::kE2M1Bf16[c]), E2M1ToF32(static_cast<uint8_t>(c)));
    EXPECT_EQ(Bf16ToF32(kern::kInt4Bf16[c]), static_cast<float>(c < 8 ? c : c - 16));
    EXPECT_EQ(kern::FourBitBf16Table(WeightFormat::kMxfp4)[c], kern::kE2M1Bf16[c]);
    EXPECT_EQ(kern::FourBitBf16Table(WeightFormat::kInt4Bf16)[c], kern::kInt4Bf16[c]);
  }
}

TEST(NativePackTest, UnpackInvertsPack) {
  auto two = TwoNodes();
  for (Fmt fc : kFormats)
    for (auto [H, I] : {std::pair<int64_t, int64_t>{197, 75}, {520, 300}, {256, 384}})
      for (ThreadPool* pool : {&SharedPool(), two.get()})
        for (bool slice : {false, true}) {
          auto src = RandomSource(H, I, 3, 7);
          PackOptions o;
          o.format = fc.f;
          o.group = fc.group;
          if (slice) {
            o.i_begin = 128;
            o.i_end = I;
            if (o.i_begin >= I) continue;
          }
          auto L = Pack(src, o, *pool);
          ASSERT_TRUE(L.ok()) << L.status();
          const auto q = QuantizeAll(src, o);
          for (int64_t e = 0; e < 3; ++e) {
            auto u = UnpackExpert(*L, e);
            ASSERT_TRUE(u.ok()) << u.status();
            const std::string where = absl::StrCat(FmtName(fc), " H ", H, " I ", I, " nodes ",
                                                   pool->num_nodes(), " slice ", slice);
            EXPECT_TRUE(SameMatrix(u->gate, q[e].gate)) << where;
            EXPECT_TRUE(SameMatrix(u->up, q[e].up)) << where;
            EXPECT_TRUE(SameMatrix(u->down, q[e].down)) << where;
          }
        }
}

// The footprint rule: packed bytes <= 1.02x the checkpoint's own bytes (codes
// and scales) at the ds-v3 and qwen3-30b expert shapes.
TEST(NativePackTest, FootprintWithinTwoPercentOfNative) {
  for (Fmt fc : kFormats)
    for (auto [H, I] : {std::pair<int64_t, int64_t>{7168, 2048}, {2048, 768}}) {
      PackOptions o;
      o.format = fc.f;
      o.group = fc.group;
      auto L = PackedMoeLayer::Plan(H, I, 4, o, SharedPool());
      ASSERT_TRUE(L.ok()) << L.status();
      const int64_t native =
          2 * MatrixBytes(fc.f, fc.group, I, H) + MatrixBytes(fc.f, fc.group, H, I);
      EXPECT_LE(static_cast<double>(L->expert_bytes()), 1.02 * static_cast<double>(native))
          << FmtName(fc) << " H " << H << " I " << I << ": " << L->expert_bytes() << " vs "
          << native;
    }
}

// What the kernels cannot serve is refused at packing, naming the matrix: an
// e8m0 scale of 0xFF (NaN), an e4m3 NaN code, a scale vector of the wrong size.
TEST(NativePackTest, RefusesNanScalesCodesAndWrongSizes) {
  auto src = RandomSource(128, 64, 1, 3);
  for (Fmt fc : kFormats) {
    PackOptions o;
    o.format = fc.f;
    o.group = fc.group;
    auto L = PackedMoeLayer::Allocate(128, 64, 1, o, SharedPool());
    ASSERT_TRUE(L.ok()) << L.status();
    const QuantExpert good = QuantizeAll(src, o)[0];
    ASSERT_TRUE(PackExpert(good, 0, *L).ok());
    QuantExpert bad = good;
    if (fc.f == WeightFormat::kMxfp4 || fc.f == WeightFormat::kMxfp8) {
      bad.up.scale_e8m0[5] = kE8M0NaN;
      auto s = PackExpert(bad, 0, *L);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << FmtName(fc);
      EXPECT_NE(s.message().find("up: e8m0 scale 5 is 0xFF"), std::string::npos) << s;
    }
    if (Traits(fc.f).bits == 8) {
      bad = good;
      bad.down.packed[70] = 0xFF;
      auto s = PackExpert(bad, 0, *L);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << FmtName(fc);
      EXPECT_NE(s.message().find("down: e4m3 code at [1, 6] is NaN"), std::string::npos) << s;
    }
    bad = good;
    bad.gate.packed.pop_back();
    auto s = PackExpert(bad, 0, *L);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << FmtName(fc);
    EXPECT_NE(s.message().find("gate: "), std::string::npos) << s;
  }
}

// ---- kernels vs reference -----------------------------------------------------------

struct Shape {
  int64_t H, I, E;
  int K;
};
// 0: odd H and I (super-block tails, partial panels); 1: group tails; 2: K of
// gate/up over the AMX chunk (2100 > 1024); 3: down's K over a chunk; 4:
// small, for prefill token counts (the double reference is the slow part).
const Shape kShapes[] = {
    {197, 75, 6, 3}, {520, 136, 9, 4}, {2100, 150, 4, 2}, {528, 1100, 3, 2}, {272, 144, 8, 2}};

void Check(Fmt fc, int64_t T, int shape, const RunOptions& ro, ThreadPool& pool) {
  const Shape sh = kShapes[shape];
  auto src = RandomSource(sh.H, sh.I, sh.E, 20 + static_cast<uint64_t>(shape));
  PackOptions o;
  o.format = fc.f;
  o.group = fc.group;
  auto L = Pack(src, o, pool);
  ASSERT_TRUE(L.ok()) << L.status();
  auto b = RandomBatch(T, sh.K, sh.H, sh.E, 300 + static_cast<uint64_t>(T));
  auto ws = MoeWorkspace::Create(*L, T, sh.K, pool);
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::vector<float> out(static_cast<size_t>(T * sh.H), -1.0f), ref(out.size());
  ASSERT_TRUE(RunMoe(*L, b.input(), out.data(), pool, **ws, ro).ok());
  ASSERT_TRUE(RunMoeReference(QuantizeAll(src, o), sh.H, 0, b.input(), ref.data(), ro).ok());
  const std::string what = absl::StrCat(
      std::string(IsaName(*ro.isa)), ro.emulate_amx ? " (AMX model) " : " ", FmtName(fc), " T=", T,
      " shape ", shape, " many_threshold_int4 ", ro.many_threshold_int4);
  EXPECT_LE(RelErr(out, ref), kBound) << what;
  EXPECT_LE(Nmse(out, ref), kBound * kBound) << what;
}

using Param = std::tuple<Isa, int /*format*/, int /*T*/, int /*shape*/>;
class NativeKernelTest : public ::testing::TestWithParam<Param> {};

TEST_P(NativeKernelTest, MatchesReference) {
  const auto [isa, fi, T, shape] = GetParam();
  if (auto why = Unavailable(isa)) GTEST_SKIP() << *why;
  RunOptions ro;
  ro.isa = isa;
  Check(kFormats[fi], T, shape, ro, SharedPool());
}

std::string ParamName(const ::testing::TestParamInfo<Param>& p) {
  return absl::StrCat(std::string(IsaName(std::get<0>(p.param))), "_",
                      FmtName(kFormats[std::get<1>(p.param)]), "_T", std::get<2>(p.param), "_S",
                      std::get<3>(p.param));
}

// T = 1 and 3: every expert "few"; 17: some experts over the int4 threshold
// (16), so both regimes in one call; 300: mostly "many".
INSTANTIATE_TEST_SUITE_P(
    All, NativeKernelTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx),
                       ::testing::Range(0, 4), ::testing::Values(1, 3, 17, 300),
                       ::testing::Values(0, 1)),
    ParamName);

// K spanning AMX chunks (AVX-512 and AMX only).
INSTANTIATE_TEST_SUITE_P(LongK, NativeKernelTest,
                         ::testing::Combine(::testing::Values(Isa::kAvx512, Isa::kAmx),
                                            ::testing::Range(0, 4), ::testing::Values(17, 120),
                                            ::testing::Values(2, 3)),
                         ParamName);

// Prefill token counts up to 8192 on a small shape (AVX-512 and AMX only:
// the scalar path would take minutes there).
INSTANTIATE_TEST_SUITE_P(Prefill, NativeKernelTest,
                         ::testing::Combine(::testing::Values(Isa::kAvx512, Isa::kAmx),
                                            ::testing::Range(0, 4), ::testing::Values(1000, 8192),
                                            ::testing::Values(4)),
                         ParamName);

// Every expert call "many" (weights dequantized to bf16) and every call
// "few" (the GEMV kernels on up to hundreds of rows), on every path this CPU
// has, the AMX software model included, over two virtual nodes.
TEST(NativeRegimeTest, AllManyAndAllFewMatchReference) {
  auto two = TwoNodes();
  struct V {
    Isa isa;
    bool emu;
  };
  int ran = 0;
  for (V v : {V{Isa::kScalar, false}, V{Isa::kAvx2, false}, V{Isa::kAvx512, false},
              V{Isa::kAvx512, true}, V{Isa::kAmx, false}}) {
    if (Unavailable(v.isa)) continue;
    for (Fmt fc : kFormats)
      for (int threshold : {0, 1 << 20}) {
        RunOptions ro;
        ro.isa = v.isa;
        ro.emulate_amx = v.emu;
        ro.many_threshold_int4 = threshold;
        Check(fc, 40, 1, ro, *two);
        Check(fc, 5, 0, ro, SharedPool());
        ++ran;
      }
  }
  EXPECT_GT(ran, 0);
}

// The group sizes int4bf16 takes beside 32 (their super-blocks: 128 and 256).
TEST(NativeRegimeTest, Int4Bf16OtherGroups) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    if (Unavailable(isa)) continue;
    for (int group : {64, 128})
      for (int threshold : {0, 16}) {
        RunOptions ro;
        ro.isa = isa;
        ro.many_threshold_int4 = threshold;
        Check({WeightFormat::kInt4Bf16, group}, 9, 1, ro, SharedPool());
      }
  }
}

}  // namespace
}  // namespace hmoe
