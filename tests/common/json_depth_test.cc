// CheckJsonDepth / ParseClientJson (common/json_depth.h): nesting bounded on
// the bytes before a tree is built.
#include "common/json_depth.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

std::string Nested(int depth, const std::string& open = "[", const std::string& close = "]") {
  std::string s;
  for (int i = 0; i < depth; ++i) s += open;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

TEST(JsonDepth, CountsArraysAndObjectsUpToTheLimit) {
  EXPECT_TRUE(CheckJsonDepth("1", 0, "x").ok());
  EXPECT_TRUE(CheckJsonDepth(Nested(5), 5, "x").ok());
  const absl::Status s = CheckJsonDepth(Nested(6), 5, "body");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "body: JSON nested deeper than 5 levels");
  EXPECT_FALSE(CheckJsonDepth(R"({"a": [{"b": [1]}]})", 3, "x").ok());
  EXPECT_TRUE(CheckJsonDepth(R"({"a": [{"b": [1]}]})", 4, "x").ok());
  // Siblings do not add up.
  EXPECT_TRUE(CheckJsonDepth("[[1],[2],[3],{\"a\":2}]", 2, "x").ok());
}

TEST(JsonDepth, BracketsInStringsDoNotCount) {
  EXPECT_TRUE(CheckJsonDepth(R"(["[[[[{{{{", "\"[[[[", "\\"])", 1, "x").ok());
  // An escaped quote does not end the string; an escaped backslash does not escape the quote.
  EXPECT_TRUE(CheckJsonDepth(R"(["a\"[[[[["])", 1, "x").ok());
  EXPECT_FALSE(CheckJsonDepth(R"(["a\\", [[]]])", 2, "x").ok());
}

TEST(JsonDepth, ADeepBodyIsRefusedNotParsed) {
  // Deep enough to overflow a recursive copy or printer of the tree.
  const std::string deep = "{\"tools\": " + Nested(200000) + "}";
  auto j = ParseClientJson(deep, "the request body");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(j.status().message()), HasSubstr("nested deeper than 128 levels"));
  auto ok = ParseClientJson(
      Nested(kMaxClientJsonDepth, "{\"a\":", "}").replace(kMaxClientJsonDepth * 5, 0, "1"), "x");
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto bad = ParseClientJson("{", "field");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "field: not valid JSON");
}

}  // namespace
}  // namespace hmoe
