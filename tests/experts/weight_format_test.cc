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
    if (t.scale_block == ScaleBlock::kGroup) {
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
    if (t.scale_block != ScaleBlock::kGroup) {
      EXPECT_EQ(group, -1) << t.name << ": no group to set";
      EXPECT_EQ(WeightFormatName(t.format, 64), t.name);
      continue;
    }
    EXPECT_EQ(group, t.default_group) << t.name;
    for (int g : t.groups) {
      if (g == 0) continue;
      const std::string name = WeightFormatName(t.format, g);
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
            "format: \"fp4\" is not one of bf16, int8, int4g32, int4g64, int4g128");
  EXPECT_EQ(ParseWeightFormat("fp4").status().message(),
            "format: \"fp4\" is not one of bf16, int8, int4");
}

TEST(WeightFormatTraits, GroupsNotTakenAreInvalidArgumentNamingThem) {
  for (const char* bad : {"int4g48", "int4g", "int4x", "int4g64x", "int4g0"}) {
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

}  // namespace
}  // namespace hmoe
