// ReadSmallFile and the loaders that read a model directory through it:
// FIFOs, devices, oversized files and symlink loops are refused with an
// error naming the file, without blocking and without throwing.
#include "common/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;

// A FIFO at `path` with a writer held open for at most a few seconds: a
// reader that blocks on it (open, then read to EOF) is released by the
// writer's close instead of hanging the test binary.
class Fifo {
 public:
  explicit Fifo(const std::string& path) {
    EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0);
    fd_ = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    EXPECT_GE(fd_, 0);
    releaser_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(5), [this] { return done_; });
      ::close(fd_);
    });
  }
  ~Fifo() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    releaser_.join();
  }

 private:
  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread releaser_;
};

// A sparse file of `bytes` bytes (no disk space used).
void MakeSparse(const std::string& path, int64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, bytes), 0);
  ::close(fd);
}

void MakeLoop(const std::string& path) { ASSERT_EQ(::symlink(path.c_str(), path.c_str()), 0); }

TEST(ReadSmallFile, ReadsARegularFile) {
  testing::TempDir dir;
  std::ofstream(dir.file("a"), std::ios::binary) << "hello";
  auto r = ReadSmallFile(dir.file("a"), 5);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "hello");
}

TEST(ReadSmallFile, RefusesWhatIsNotASmallRegularFileNamingIt) {
  testing::TempDir dir;
  Fifo fifo(dir.file("fifo"));
  MakeSparse(dir.file("big"), 1 << 20);
  MakeLoop(dir.file("loop"));
  std::ofstream(dir.file("six"), std::ios::binary) << "123456";
  struct Case {
    std::string path;
    absl::StatusCode code;
    std::string says;
  };
  const Case cases[] = {
      {dir.file("missing"), absl::StatusCode::kNotFound, "No such file"},
      {dir.file("fifo"), absl::StatusCode::kFailedPrecondition, "not a regular file"},
      {dir.path(), absl::StatusCode::kFailedPrecondition, "not a regular file"},
      {"/dev/zero", absl::StatusCode::kFailedPrecondition, "not a regular file"},
      {dir.file("big"), absl::StatusCode::kInvalidArgument, "over the limit of 1000"},
      {dir.file("six"), absl::StatusCode::kInvalidArgument, "6 bytes, over the limit of 5"},
      {dir.file("loop"), absl::StatusCode::kFailedPrecondition, "symbolic links"},
  };
  for (const Case& c : cases) {
    auto r = ReadSmallFile(c.path, c.path == dir.file("six") ? 5 : 1000);
    ASSERT_FALSE(r.ok()) << c.path;
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.path)) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.says)) << r.status();
  }
}

TEST(ModelFiles, AFifoConfigJsonIsRefusedNotWaitedOn) {
  testing::TempDir dir;
  Fifo fifo(dir.file("config.json"));
  auto c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr(dir.file("config.json") + ": not a regular file"));
}

TEST(ModelFiles, AnOversizedConfigJsonIsRefusedUnread) {
  testing::TempDir dir;
  MakeSparse(dir.file("config.json"), kMaxConfigJsonBytes + 1);
  auto c = LoadModelConfig(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("over the limit"));
}

TEST(ModelFiles, TokenizerJsonFifoOversizeAndLoopAreRefused) {
  testing::TempDir dir;
  Fifo fifo(dir.file("fifo.json"));
  MakeSparse(dir.file("big.json"), kMaxTokenizerJsonBytes + 1);
  MakeLoop(dir.file("tokenizer.json"));
  auto t = Tokenizer::FromFile(dir.file("fifo.json"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  t = Tokenizer::FromFile(dir.file("big.json"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("over the limit"));
  t = Tokenizer::FromFile(dir.file("tokenizer.json"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(dir.file("tokenizer.json")));
}

TEST(ModelFiles, ChatTemplateFilesThatCannotBeReadAreErrorsNotSkipped) {
  testing::TempDir dir;
  Fifo fifo(dir.file("tokenizer_config.json"));
  auto t = ChatTemplate::FromModelDir(dir.path());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json: not a regular file"));

  testing::TempDir loop_dir;
  MakeLoop(loop_dir.file("chat_template.jinja"));
  t = ChatTemplate::FromModelDir(loop_dir.path());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("chat_template.jinja"));
}

TEST(ModelFiles, AFifoSafetensorsIsRefusedNotMapped) {
  testing::TempDir dir;
  Fifo fifo(dir.file("model.safetensors"));
  auto c = Checkpoint::Open(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("model.safetensors: not a regular file"));
}

TEST(ModelFiles, AFifoSafetensorsIndexIsRefused) {
  testing::TempDir dir;
  Fifo fifo(dir.file("model.safetensors.index.json"));
  auto c = Checkpoint::Open(dir.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("model.safetensors.index.json: not a regular file"));
}

}  // namespace
}  // namespace hmoe
