// A fresh directory under the test temp root, removed when it goes out of scope.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace hmoe::testing {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "hmoe";
    for (char& c : name)
      if (c == '/') c = '_';
    path_ = std::filesystem::path(::testing::TempDir()) /
            (name + "." + std::to_string(::getpid()) + "." + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Directory of the committed fixtures (tests/fixtures), absolute: symlinks
// made to fixture files must resolve from anywhere (HMOE_SOURCE_DIR is "."
// under Bazel, whose tests run in their runfiles tree).
inline std::string FixturesDir() {
  const char* env = std::getenv("HMOE_SOURCE_DIR");
  return std::filesystem::absolute(std::string(env ? env : HMOE_SOURCE_DIR) + "/tests/fixtures")
      .lexically_normal()
      .string();
}

}  // namespace hmoe::testing
