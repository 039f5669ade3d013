// QuantizeExpert (common/experts/quantize.h): fp8 sources dequantized with
// their block scales, non-finite weights refused naming the element, bad
// options refused naming the value, and the quantized values each format's
// traits describe (scales per row, the group kept).
#include "common/experts/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "tests/testing/random_experts.h"

namespace hmoe {
namespace {

using testing::RandomSource;

TEST(QuantizeTest, Fp8SourceDequantizesWithBlockScales) {
  auto src = RandomSource(130, 40, 1, 2, /*fp8=*/true);
  auto w = src.expert(0).value();
  QuantOptions o;  // bf16
  auto q = QuantizeExpert(w, src, o).value();
  const float* si = w.gate_scale_inv.data<float>();
  const int64_t bc = 2;
  for (int64_t r : {0, 17, 39})
    for (int64_t c : {0, 127, 128, 129}) {
      const float v =
          Fp8E4M3ToF32(w.gate.data<uint8_t>()[r * 130 + c]) * si[(r / 128) * bc + c / 128];
      EXPECT_EQ(q.gate.At(r, c), Bf16ToF32(F32ToBf16(v)));
    }
}

// A NaN or infinite weight (bf16 NaN / inf, the fp8 NaN code) is refused,
// located, in every format: it would poison its row's or group's scale.
TEST(QuantizeTest, NonFiniteWeightsAreRefusedNamingTheElement) {
  for (bool fp8 : {false, true}) {
    auto src = RandomSource(130, 40, 1, 4, fp8);
    auto w = src.expert(0).value();
    if (fp8) {
      w.up.data<uint8_t>()[3 * 130 + 7] = 0x7f;  // e4m3 NaN
    } else {
      w.up.data<uint16_t>()[3 * 130 + 7] = 0x7f80;  // bf16 +inf
    }
    for (const WeightFormatTraits& t : kWeightFormatTraits) {
      QuantOptions o;
      o.format = t.format;
      o.group = t.default_group;
      const absl::Status st = QuantizeExpert(w, src, o).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find("up: element [3, 7] is"), std::string_view::npos) << st;
      EXPECT_NE(st.message().find("weights must be finite"), std::string_view::npos) << st;
    }
  }
}

TEST(QuantizeTest, BadOptionsAreInvalidArgumentNamingTheValue) {
  const MoeWeightsSource src = RandomSource(64, 32, 2, 3);
  const ExpertWeights w = src.expert(0).value();
  auto expect_bad = [&](const QuantOptions& o, std::string_view what) {
    const absl::Status s = QuantizeExpert(w, src, o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(std::string(s.message()).find(what), std::string::npos) << s;
  };
  for (const auto& [bad, what] : testing::BadQuantOptionsForI32()) expect_bad(bad, what);
  QuantOptions o;
  o.format = WeightFormat::kInt8;
  o.group = 48;  // formats without groups ignore it
  EXPECT_TRUE(QuantizeExpert(w, src, o).ok());
}

// Every format's matrices hold the values and scales its traits describe,
// over the slice asked for.
TEST(QuantizeTest, MatricesFollowTheTraits) {
  const MoeWeightsSource src = RandomSource(100, 40, 1, 5);
  const ExpertWeights w = src.expert(0).value();
  for (const WeightFormatTraits& t : kWeightFormatTraits) {
    std::vector<int> groups = {128};
    if (IsGrouped(t.format)) {
      groups.clear();
      for (int g : t.groups)
        if (g != 0) groups.push_back(g);
    }
    for (int group : groups) {
      SCOPED_TRACE(WeightFormatName(t.format, group));
      QuantOptions o;
      o.format = t.format;
      o.group = group;
      o.i_begin = 8;
      o.i_end = 30;
      const QuantExpert q = QuantizeExpert(w, src, o).value();
      for (const QuantMatrix* m : {&q.gate, &q.up, &q.down}) {
        const bool gate_up = m != &q.down;
        EXPECT_EQ(m->format, t.format);
        EXPECT_EQ(m->group, IsGrouped(t.format) ? group : 0);
        EXPECT_EQ(m->rows, gate_up ? 22 : 100);
        EXPECT_EQ(m->cols, gate_up ? 100 : 22);
        const size_t n = static_cast<size_t>(m->rows * m->cols);
        const size_t scales = static_cast<size_t>(ScaleCount(t.format, group, m->rows, m->cols));
        EXPECT_EQ(m->scale.size(), t.scale_type == ScaleType::kF32 ? scales : 0);
        EXPECT_EQ(m->scale_bf16.size(), t.scale_type == ScaleType::kBf16 ? scales : 0);
        EXPECT_EQ(m->scale_e8m0.size(), t.scale_type == ScaleType::kE8M0 ? scales : 0);
        if (t.value == ValueCode::kE2M1 || t.value == ValueCode::kE4M3 ||
            t.format == WeightFormat::kInt4Bf16) {
          EXPECT_EQ(m->packed.size(), static_cast<size_t>(m->rows * RowBytes(t.format, m->cols)));
          EXPECT_EQ(m->bf16.size() + m->q.size(), 0u);
        } else {
          EXPECT_EQ(m->bf16.size() + m->q.size(), n);
          EXPECT_TRUE(m->packed.empty());
        }
        for (int64_t r = 0; r < m->rows; ++r) {
          std::vector<float> row(static_cast<size_t>(m->cols));
          m->DequantizeRow(r, row.data());
          for (int64_t c = 0; c < m->cols; ++c) ASSERT_EQ(row[static_cast<size_t>(c)], m->At(r, c));
        }
      }
      // The slice: gate row r of the quantized form is row 8 + r of the source.
      const std::vector<float> gate = w.gate.ToF32();
      for (int64_t r : {0, 21})
        for (int64_t c : {0, 57, 99}) {
          const float want = gate[static_cast<size_t>((8 + r) * 100 + c)];
          const float got = q.gate.At(r, c);
          // Half a step of the value grid at the largest value, in scales:
          // int 0.5 (clamped 7.5 -> 7 too), e2m1 1 (between 4 and 6), e4m3 16
          // (between 416 and 448); with slack for the bf16 rounding of scales.
          const float tol = t.value == ValueCode::kE2M1   ? 1.01f
                            : t.value == ValueCode::kE4M3 ? 16.1f
                                                          : 0.6f;
          if (t.format == WeightFormat::kBf16) {
            EXPECT_EQ(got, Bf16ToF32(F32ToBf16(want)));
          } else {
            const float s = q.gate.ScaleAt(r, c);
            EXPECT_LE(std::abs(got - want), tol * s + 1e-7f) << r << "," << c;
          }
        }
    }
  }
}

}  // namespace
}  // namespace hmoe
