// Backend names: "cpu", "cuda" and "auto" resolve (cuda only where it runs),
// anything else is refused at resolution and at load.
#include <string>

#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/model/model_test_util.h"

namespace hmoe {
namespace {

using testing::ModelFixturesRoot;

TEST(ModelBackend, NamesAreResolved) {
  EXPECT_EQ(*ResolveBackend("cpu"), "cpu");
  auto a = ResolveBackend("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(*a == "cpu" || *a == "cuda");
  EXPECT_EQ(ResolveBackend("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  auto c = ResolveBackend("cuda");
  if (!c.ok()) {
    EXPECT_TRUE(c.status().code() == absl::StatusCode::kUnimplemented ||
                c.status().code() == absl::StatusCode::kFailedPrecondition)
        << c.status();
  }
  ModelOptions o;
  o.backend = "tpu";
  EXPECT_EQ(Model::Load(ModelFixturesRoot() + "/qwen3_moe_tiny", o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
