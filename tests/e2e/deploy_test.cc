// Both systemd units (the worker and an instance of the expert-service
// template it requires) pass systemd-analyze verify, where available.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void ReplaceAll(std::string& s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
}

TEST(Deploy, SystemdUnitsVerify) {
  if (std::system("command -v systemd-analyze >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "systemd-analyze not available";
  testing::TempDir dir;
  // Absolute: the units' paths must be (the dirs are relative under Bazel).
  const std::string src = std::filesystem::absolute(HMOE_SOURCE_DIR "/deploy/systemd").string();
  const std::string bin = std::filesystem::absolute(HMOE_BINARY_DIR "/bin").string();
  for (const char* name : {"hmoe-gpu-worker.service", "hmoe-expert-service@.service"}) {
    std::string unit = Slurp(src + "/" + name);
    ASSERT_FALSE(unit.empty()) << name;
    ReplaceAll(unit, "/usr/local/bin/", bin + "/");
    ReplaceAll(unit, "/etc/hmoe/", src + "/");
    std::ofstream(dir.file(name)) << unit;
  }
  const std::string out = dir.file("out");
  const int st =
      std::system(absl::StrCat("cd ", dir.path(), " && systemd-analyze verify --man=no ",
                               dir.file("hmoe-gpu-worker.service"), " ",
                               dir.file("hmoe-expert-service@0.service"), " > ", out, " 2>&1")
                      .c_str());
  const std::string text = Slurp(out);
  EXPECT_EQ(st, 0) << text;
  EXPECT_EQ(text.find("hmoe-gpu-worker"), std::string::npos)
      << text;  // no complaints about our unit
}

}  // namespace
}  // namespace hmoe
