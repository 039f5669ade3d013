#include "common/auth_token.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

std::string WriteFile(const testing::TempDir& dir, const std::string& name,
                      const std::string& bytes, mode_t mode = 0600) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary) << bytes;
  ::chmod(path.c_str(), mode);
  return path;
}

TEST(AuthToken, ReadsTheTokenWithoutItsNewline) {
  testing::TempDir dir;
  const std::string token = "hm0e-Secret+Token/0123456789==";
  auto t = ReadAuthTokenFile(WriteFile(dir, "t", token + "\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, token);
  t = ReadAuthTokenFile(WriteFile(dir, "crlf", token + "\r\n", 0400));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, token);
}

TEST(AuthToken, RefusesWhatIsNotAPrivateTokenFileNamingIt) {
  testing::TempDir dir;
  const std::string good = "0123456789abcdef0123";
  struct Case {
    std::string path;
    absl::StatusCode code;
    std::string says;
  };
  ASSERT_EQ(::symlink(WriteFile(dir, "target", good).c_str(), dir.file("link").c_str()), 0);
  const Case cases[] = {
      {dir.file("missing"), absl::StatusCode::kNotFound, "No such file"},
      {WriteFile(dir, "shared", good, 0644), absl::StatusCode::kFailedPrecondition,
       "mode 0644 lets other users at the token; chmod 600"},
      {WriteFile(dir, "group", good, 0640), absl::StatusCode::kFailedPrecondition, "mode 0640"},
      {dir.path(), absl::StatusCode::kFailedPrecondition, "not a regular file"},
      {WriteFile(dir, "short", "0123456789abcde\n"), absl::StatusCode::kInvalidArgument,
       "token of 15 bytes; at least 16"},
      {WriteFile(dir, "empty", ""), absl::StatusCode::kInvalidArgument, "token of 0 bytes"},
      {WriteFile(dir, "space", "0123 456789abcdef0"), absl::StatusCode::kInvalidArgument,
       "byte 4 is 0x20"},
      {WriteFile(dir, "nul", std::string("0123456789\0abcdef", 17)),
       absl::StatusCode::kInvalidArgument, "byte 10 is 0x00"},
      {WriteFile(dir, "long", std::string(kMaxAuthTokenBytes + 1, 'x')),
       absl::StatusCode::kInvalidArgument, "over the 4096"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path);
    auto t = ReadAuthTokenFile(c.path);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), c.code) << t.status();
    EXPECT_THAT(t.status().message(), HasSubstr(c.says));
    EXPECT_THAT(t.status().message(), HasSubstr("auth token file " + c.path));
  }
  // A symlink to a private token file is followed; to a shared one, refused.
  auto via_link = ReadAuthTokenFile(dir.file("link"));
  ASSERT_TRUE(via_link.ok()) << via_link.status();
  EXPECT_EQ(*via_link, good);
  ASSERT_EQ(::symlink(dir.file("shared").c_str(), dir.file("link2").c_str()), 0);
  EXPECT_EQ(ReadAuthTokenFile(dir.file("link2")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A FIFO is refused without blocking.
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  EXPECT_EQ(ReadAuthTokenFile(dir.file("fifo")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The longest token is taken.
  auto t = ReadAuthTokenFile(WriteFile(dir, "max", std::string(kMaxAuthTokenBytes, 'x') + "\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), kMaxAuthTokenBytes);
}

TEST(AuthToken, AFileListsTokensOnePerLineAndClientsSendTheFirst) {
  testing::TempDir dir;
  const std::string a = "new-token-0123456789", b = "old-token-0123456789";
  const std::string path = WriteFile(dir, "two", a + "\r\n\n  \n" + b + " \n");
  auto all = ReadAuthTokensFile(path);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, (std::vector<std::string>{a, b}));
  auto first = ReadAuthTokenFile(path);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, a);
  std::string eight;
  for (int i = 0; i < 8; ++i) eight += "token-number-" + std::to_string(i) + "-abcdef\n";
  auto many = ReadAuthTokensFile(WriteFile(dir, "eight", eight));
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ(many->size(), kMaxAuthTokensPerFile);
  struct Case {
    std::string bytes, says;
  };
  const Case bad[] = {
      {eight + "token-number-8-abcdef\n", ": 9 tokens, over the 8"},
      {a + "\nshort\n", ": line 2: token of 5 bytes; at least 16"},
      {a + "\n\n" + "bad token-0123456789", ": line 3: byte 3 is 0x20"},
      {"\n\n\n", ": token of 0 bytes"},
  };
  for (const Case& c : bad) {
    SCOPED_TRACE(c.bytes);
    auto t = ReadAuthTokensFile(WriteFile(dir, "bad", c.bytes));
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_THAT(t.status().message(), HasSubstr("auth token file " + dir.file("bad") + c.says));
  }
}

TEST(AuthToken, TokensInForceFollowAReloadAndSurviveABadFile) {
  testing::TempDir dir;
  const std::string a = "token-a-0123456789", b = "token-b-0123456789";
  const std::string path = WriteFile(dir, "t", a + "\n");
  auto tokens = AuthTokens::FromFile(path);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  AuthTokens& t = **tokens;
  EXPECT_TRUE(t.enabled());
  EXPECT_TRUE(t.Accepts(a));
  EXPECT_FALSE(t.Accepts(b));
  EXPECT_FALSE(t.Accepts(""));
  EXPECT_EQ(t.first(), a);
  // Rotation: the new token first, both accepted; then the old one dropped.
  WriteFile(dir, "t", b + "\n" + a + "\n");
  auto n = t.Reload(path);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 2u);
  EXPECT_TRUE(t.Accepts(a));
  EXPECT_TRUE(t.Accepts(b));
  EXPECT_EQ(t.first(), b);
  WriteFile(dir, "t", b + "\n");
  ASSERT_TRUE(t.Reload(path).ok());
  EXPECT_FALSE(t.Accepts(a));
  EXPECT_TRUE(t.Accepts(b));
  // A file that fails its checks (or is gone) leaves the tokens in force.
  WriteFile(dir, "t", b + "\n", 0644);
  EXPECT_EQ(t.Reload(path).status().code(), absl::StatusCode::kFailedPrecondition);
  std::filesystem::remove(path);
  EXPECT_EQ(t.Reload(path).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(t.Accepts(b));
  EXPECT_EQ(t.first(), b);
  // Auth off stays off: nothing accepted, nothing sent, no reload.
  AuthTokens off;
  EXPECT_FALSE(off.enabled());
  EXPECT_FALSE(off.Accepts(a));
  EXPECT_EQ(off.first(), "");
  WriteFile(dir, "t2", a + "\n");
  EXPECT_EQ(off.Reload(dir.file("t2")).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(off.Accepts(a));
}

TEST(AuthToken, EqualityAndLoopbackAddresses) {
  EXPECT_TRUE(AuthTokensEqual("abcdefghijklmnop", "abcdefghijklmnop"));
  EXPECT_FALSE(AuthTokensEqual("abcdefghijklmnop", "abcdefghijklmnoq"));
  EXPECT_FALSE(AuthTokensEqual("abcdefghijklmnop", "abcdefghijklmno"));
  EXPECT_FALSE(AuthTokensEqual("", "a"));
  for (const char* a : {"127.0.0.1:50061", "127.1.2.3:0", "localhost:1", "[::1]:50051",
                        "unix:/run/hmoe.sock", "unix-abstract:hmoe", "[::ffff:127.0.0.1]:5"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(a)) << a;
  }
  for (const char* a :
       {"0.0.0.0:50061", "[::]:50051", "10.0.0.7:1", "host.example:50061", "localhost.example:1",
        "128.0.0.1:2", "127.foo.example:1", "[::ffff:10.0.0.1]:5"}) {
    EXPECT_FALSE(IsLoopbackListenAddress(a)) << a;
  }
}

}  // namespace
}  // namespace hmoe
