// The weight formats' traits table (common/experts/format_codes.h) and its
// names (weight_format.h): every row prints and parses back, with each group
// it takes; unknown names and groups are INVALID_ARGUMENT naming them; the
// sizes the traits give are the formats' layouts.
#include "common/experts/weight_format.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "absl/status/status.h"
#include "common/experts/format_codes.h"

namespace hmoe {
namespace {

TEST(WeightFormatTraits, RowsAreIndexedByTheirCodeAndNamedOnce) {
  std::set<std::string> names;
  for (int i = 0; i < kNumWeightFormats; ++i) {
    const WeightFormatTraits& t = kWeightFormatTraits[i];
    EXPECT_EQ(static_cast<int>(t.format), i) << t.name;
    EXPECT_TRUE(IsWeightFormat(t.format));
    EXPECT_EQ(&Traits(t.format), &t);
    EXPECT_TRUE(names.insert(t.name).second) << "two rows named " << t.name;
    EXPECT_GT(t.bits, 0) << t.name;
    EXPECT_EQ(t.scale_type == ScaleType::kNone, t.scale_block == ScaleBlock::kNone) << t.name;
    if (IsGrouped(t.format)) {
      EXPECT_TRUE(TakesGroup(t.format, t.default_group)) << t.name;
    } else {
      EXPECT_EQ(t.default_group, 0) << t.name;
      for (int g : t.groups) EXPECT_EQ(g, 0) << t.name;
    }
  }
  EXPECT_FALSE(IsWeightFormat(static_cast<WeightFormat>(kNumWeightFormats)));
}

TEST(WeightFormatTraits, EveryRowPrintsAndParsesBack) {
  for (const WeightFormatTraits& t : kWeightFormatTraits) {
    EXPECT_EQ(WeightFormatName(t.format), t.name);
    absl::StatusOr<WeightFormat> bare = ParseWeightFormat(t.name);
    ASSERT_TRUE(bare.ok()) << bare.status();
    EXPECT_EQ(*bare, t.format);
    int group = -1;
    absl::StatusOr<WeightFormat> with = ParseWeightFormat(t.name, &group);
    ASSERT_TRUE(with.ok()) << with.status();
    EXPECT_EQ(*with, t.format);
    if (!IsGrouped(t.format)) {
      EXPECT_EQ(group, -1) << t.name << ": no group to set";
      EXPECT_EQ(WeightFormatName(t.format, 64), t.name);
      continue;
    }
    EXPECT_EQ(group, t.default_group) << t.name;
    for (int g : t.groups) {
      if (g == 0) continue;
      const std::string name = WeightFormatName(t.format, g);
      // One group taken: the bare name says it all ("mxfp4"; "mxfp4g32" parses too).
      if (TakesOneGroup(t.format)) {
        EXPECT_EQ(name, t.name);
        const std::string with_group = std::string(t.name) + "g" + std::to_string(g);
        int back = -1;
        EXPECT_EQ(ParseWeightFormat(with_group, &back).value(), t.format);
        EXPECT_EQ(back, g);
        continue;
      }
      EXPECT_EQ(name, std::string(t.name) + "g" + std::to_string(g));
      int back = -1;
      absl::StatusOr<WeightFormat> f = ParseWeightFormat(name, &back);
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(*f, t.format);
      EXPECT_EQ(back, g);
      EXPECT_TRUE(CheckGroup(t.format, g).ok());
      // The bare parser takes no group: the caller would lose it.
      EXPECT_EQ(ParseWeightFormat(name).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(WeightFormatTraits, UnknownNamesAreInvalidArgumentNamingThem) {
  for (const char* bad : {"fp4", "", "BF16", "int", "int8g32", "bf16 "}) {
    int group = 7;
    const absl::Status s = ParseWeightFormat(bad, &group).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::string("\"") + bad + "\""), std::string::npos) << s;
    EXPECT_EQ(group, 7) << bad;
    const absl::Status b = ParseWeightFormat(bad).status();
    EXPECT_EQ(b.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.message().find(std::string("\"") + bad + "\""), std::string::npos) << b;
  }
  EXPECT_EQ(ParseWeightFormat("fp4", nullptr).status().message(),
            "format: \"fp4\" is not one of bf16, int8, int4g32, int4g64, int4g128, mxfp4, "
            "int4bf16g32, int4bf16g64, int4bf16g128, fp8, mxfp8");
  EXPECT_EQ(ParseWeightFormat("fp4").status().message(),
            "format: \"fp4\" is not one of bf16, int8, int4, mxfp4, int4bf16, fp8, mxfp8");
  // A name another row's extends is no group of it ("int4x" is not "int4" + a group).
  EXPECT_NE(ParseWeightFormat("int4x", nullptr).status().message().find("is not one of"),
            std::string::npos);
}

TEST(WeightFormatTraits, GroupsNotTakenAreInvalidArgumentNamingThem) {
  for (const char* bad : {"int4g48", "int4g", "int4g64x", "int4g0"}) {
    int group = 7;
    const absl::Status s = ParseWeightFormat(bad, &group).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::string("\"") + bad + "\""), std::string::npos) << s;
    EXPECT_NE(s.message().find("int4 groups are int4g32, int4g64, int4g128"), std::string::npos)
        << s;
    EXPECT_EQ(group, 7) << bad;
  }
  const absl::Status s = CheckGroup(WeightFormat::kInt4, 48);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "int4 group must be 32, 64 or 128, got 48");
  EXPECT_TRUE(CheckGroup(WeightFormat::kInt8, 48).ok()) << "no groups: nothing to check";
  EXPECT_EQ(ParseWeightFormat("mxfp4g64", nullptr).status().message(),
            "format: \"mxfp4g64\"; mxfp4 groups are mxfp4");
  EXPECT_EQ(CheckGroup(WeightFormat::kFp8, 64).message(), "fp8 group must be 128, got 64");
  int group = 0;
  EXPECT_EQ(ParseWeightFormat("int4bf16", &group).value(), WeightFormat::kInt4Bf16);
  EXPECT_EQ(group, 32);
  EXPECT_EQ(ParseWeightFormat("int4bf16g128", &group).value(), WeightFormat::kInt4Bf16);
  EXPECT_EQ(group, 128);
  EXPECT_EQ(ParseWeightFormat("int4g32", &group).value(), WeightFormat::kInt4);
}

// The sizes the traits give: what the GPU layouts and packed files hold.
TEST(WeightFormatTraits, SizesFollowBitsAndScaleBlocks) {
  EXPECT_EQ(RowBytes(WeightFormat::kBf16, 7), 14);
  EXPECT_EQ(RowBytes(WeightFormat::kInt8, 7), 7);
  EXPECT_EQ(RowBytes(WeightFormat::kInt4, 7), 4);  // the last byte holds one value
  EXPECT_EQ(RowBytes(WeightFormat::kInt4, 8), 4);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kBf16, 0, 100), 0);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kInt8, 0, 100), 1);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kInt4, 32, 100), 4);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kInt4, 64, 128), 2);
  EXPECT_EQ(ScaleBytes(WeightFormat::kBf16), 0);
  EXPECT_EQ(ScaleBytes(WeightFormat::kInt8), 4);
  EXPECT_EQ(ScaleBytes(WeightFormat::kInt4), 4);
  EXPECT_FALSE(HasScales(WeightFormat::kBf16));
  EXPECT_TRUE(IsGrouped(WeightFormat::kInt4));
  EXPECT_FALSE(IsGrouped(WeightFormat::kInt8));
  static_assert(RowBytes(WeightFormat::kInt4, 3) == 2, "usable in constant expressions");
}

// The native formats: MXFP4 4.25 bits per weight, int4bf16 g32 4.5, fp8 a
// 2-D block of scales, MXFP8 8.25.
TEST(WeightFormatTraits, NativeFormatsLayouts) {
  EXPECT_EQ(RowBytes(WeightFormat::kMxfp4, 64), 32);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kMxfp4, 32, 64), 2);
  EXPECT_EQ(ScaleBytes(WeightFormat::kMxfp4), 1);
  EXPECT_EQ(MatrixBytes(WeightFormat::kMxfp4, 32, 4, 64), 4 * 32 + 4 * 2);  // 4.25 bits
  EXPECT_EQ(ScaleBytes(WeightFormat::kInt4Bf16), 2);
  EXPECT_EQ(MatrixBytes(WeightFormat::kInt4Bf16, 32, 2, 64), 2 * 32 + 2 * 2 * 2);  // 4.5 bits
  EXPECT_EQ(MatrixBytes(WeightFormat::kMxfp8, 32, 1, 64), 64 + 2);
  EXPECT_EQ(RowBytes(WeightFormat::kFp8, 300), 300);
  EXPECT_EQ(ScaleRows(WeightFormat::kFp8, 128, 300), 3);
  EXPECT_EQ(ScalesPerRow(WeightFormat::kFp8, 128, 129), 2);
  EXPECT_EQ(ScaleCount(WeightFormat::kFp8, 128, 300, 129), 6);
  EXPECT_EQ(ScaleIndex(WeightFormat::kFp8, 128, 129, 257, 128), 2 * 2 + 1);
  EXPECT_EQ(ScaleIndex(WeightFormat::kInt4Bf16, 32, 100, 3, 95), 3 * 4 + 2);
  EXPECT_EQ(ScaleCount(WeightFormat::kInt8, 0, 7, 100), 7);
  EXPECT_EQ(ScaleCount(WeightFormat::kBf16, 0, 7, 100), 0);
  EXPECT_EQ(ScaleBytes(WeightFormat::kFp8), 4);
  EXPECT_TRUE(IsGrouped(WeightFormat::kFp8));
  EXPECT_TRUE(TakesOneGroup(WeightFormat::kMxfp8));
  EXPECT_FALSE(TakesOneGroup(WeightFormat::kInt4Bf16));
  EXPECT_EQ(Traits(WeightFormat::kMxfp4).value, ValueCode::kE2M1);
  EXPECT_EQ(Traits(WeightFormat::kMxfp8).value, ValueCode::kE4M3);
  EXPECT_EQ(Traits(WeightFormat::kInt4Bf16).value, ValueCode::kInt);
  EXPECT_EQ(Traits(WeightFormat::kFp8).scale_block, ScaleBlock::kBlock2D);
}

}  // namespace
}  // namespace hmoe
