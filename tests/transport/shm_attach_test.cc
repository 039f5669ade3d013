// ShmServer::Attach accepts only the client's own memfd, sealed against
// shrinking: a segment the client could truncate under the service's mapping
// would SIGBUS the service on its next access.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "absl/strings/str_cat.h"
#include "expert_service/transport/shm_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

ShmGeometry Geometry(const ShardInfo& info) {
  ShmGeometry g;
  g.slots = 1;
  g.hidden = info.hidden;
  g.max_tokens = info.max_tokens;
  g.max_top_k = info.top_k;
  return g;
}

// A memfd of the geometry's size with a valid header; sealed with `seals`
// (0: none). Returns the fd (the mapping is dropped again).
constexpr uint64_t kNonce = 0x5eedf00d12345679ull;

int MakeSegment(const ShmGeometry& g, unsigned int memfd_flags, int seals, mode_t mode = 0600) {
  const int fd = memfd_create("hmoe-shm-attach-test", MFD_CLOEXEC | memfd_flags);
  if (fd < 0) return -1;
  if (fchmod(fd, mode) != 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(g.total_bytes())) != 0) return -1;
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return -1;
  g.WriteHeader(static_cast<ShmHeader*>(p));
  static_cast<ShmHeader*>(p)->nonce = kNonce;
  munmap(p, 4096);
  if (seals != 0 && fcntl(fd, F_ADD_SEALS, seals) != 0) return -1;
  return fd;
}

std::string FdPath(int fd) { return absl::StrCat("/proc/", getpid(), "/fd/", fd); }

TEST(ShmAttach, SealedMemfdOfTheClientIsServedAndCannotShrink) {
  testing::RowHandler handler;
  ShmServer server(&handler);
  const ShmGeometry g = Geometry(handler.info());
  const int fd = MakeSegment(g, MFD_ALLOW_SEALING, F_SEAL_SHRINK | F_SEAL_GROW);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  auto epoch = server.Attach(FdPath(fd), getpid(), kNonce);
  ASSERT_TRUE(epoch.ok()) << epoch.status();
  EXPECT_EQ(server.sessions(), 1u);
  // The attack the seal closes: shrinking the file under the service's map.
  EXPECT_NE(ftruncate(fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
  // The same segment again, by its fd or a dup of it: one serving thread per
  // segment (two would claim its slots and rewrite its epoch).
  const int dup_fd = dup(fd);
  ASSERT_GE(dup_fd, 0);
  for (int f : {fd, dup_fd}) {
    auto again = server.Attach(FdPath(f), getpid(), kNonce);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
    EXPECT_THAT(std::string(again.status().message()), HasSubstr("already attached"));
    // Neither the segment's nonce nor its epoch is told to the caller.
    EXPECT_THAT(std::string(again.status().message()),
                Not(HasSubstr(absl::StrCat(absl::Hex(kNonce)))));
    EXPECT_THAT(std::string(again.status().message()), Not(HasSubstr(absl::StrCat(*epoch))));
  }
  EXPECT_EQ(server.sessions(), 1u);
  ::close(dup_fd);
  ::close(fd);
}

TEST(ShmAttach, RefusesUnsealedSegments) {
  testing::RowHandler handler;
  ShmServer server(&handler);
  const ShmGeometry g = Geometry(handler.info());
  for (const auto& [flags, seals] :
       {std::pair<unsigned, int>{0u, 0},                              // no sealing possible at all
        std::pair<unsigned, int>{MFD_ALLOW_SEALING, 0},               // could be sealed, is not
        std::pair<unsigned, int>{MFD_ALLOW_SEALING, F_SEAL_GROW}}) {  // sealed, but not shrink
    const int fd = MakeSegment(g, flags, seals);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    auto epoch = server.Attach(FdPath(fd), getpid(), kNonce);
    EXPECT_EQ(epoch.status().code(), absl::StatusCode::kInvalidArgument) << flags << " " << seals;
    EXPECT_THAT(std::string(epoch.status().message()), HasSubstr("F_SEAL_SHRINK"));
    EXPECT_THAT(std::string(epoch.status().message()), HasSubstr(FdPath(fd)));
    ::close(fd);
  }
  EXPECT_EQ(server.sessions(), 0u);
}

TEST(ShmAttach, RefusesPathsOutsideTheClientsFdTable) {
  testing::RowHandler handler;
  ShmServer server(&handler);
  const ShmGeometry g = Geometry(handler.info());
  const int fd = MakeSegment(g, MFD_ALLOW_SEALING, F_SEAL_SHRINK);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const std::string self = absl::StrCat("/proc/", getpid(), "/fd/");
  for (const std::string& path :
       {std::string("/dev/shm/hmoe-x"), absl::StrCat("/proc/self/fd/", fd),
        absl::StrCat("/proc/1/fd/", fd), absl::StrCat(self, fd, "x"), absl::StrCat(self, "../", fd),
        absl::StrCat(self, "-", fd), self, absl::StrCat(self, "99999999999")}) {
    auto epoch = server.Attach(path, getpid(), kNonce);
    EXPECT_EQ(epoch.status().code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(std::string(epoch.status().message()), HasSubstr("path")) << path;
  }
  // A well-formed path naming no open fd.
  EXPECT_EQ(server.Attach(absl::StrCat(self, 987654), getpid(), kNonce).status().code(),
            absl::StatusCode::kNotFound);
  // Not a regular file: a pipe end is refused (resolved with O_PATH, never
  // opened for real); so is whatever another process's fd 0 is (a device,
  // a pipe, /dev/null), named with that process's pid.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  auto piped = server.Attach(FdPath(pipe_fds[0]), getpid(), kNonce);
  EXPECT_EQ(piped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(piped.status().message()), HasSubstr("regular file"));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  const auto init = server.Attach("/proc/1/fd/0", 1, kNonce).status();
  EXPECT_TRUE(init.code() == absl::StatusCode::kInvalidArgument ||
              init.code() == absl::StatusCode::kNotFound)
      << init;
  // A regular file that is not on tmpfs (this test binary): not a memfd.
  const int exe = ::open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(exe, 0);
  auto on_disk = server.Attach(FdPath(exe), getpid(), kNonce);
  EXPECT_EQ(on_disk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(on_disk.status().message()), HasSubstr("not on tmpfs"));
  ::close(exe);
  EXPECT_EQ(server.sessions(), 0u);
  ::close(fd);
}

TEST(ShmAttach, RefusesHugetlbMemfds) {
  // hugetlbfs memfds can be sealed too, but a punched hole there can SIGBUS
  // the mapping when the huge page pool is empty: refused for their filesystem.
  testing::RowHandler handler;
  ShmServer server(&handler);
  const int fd = memfd_create("hmoe-shm-huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (fd < 0) GTEST_SKIP() << "no hugetlb memfd here: " << std::strerror(errno);
  if (ftruncate(fd, 2 << 20) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    ::close(fd);
    GTEST_SKIP() << "hugetlb memfd cannot be sized and sealed here: " << std::strerror(errno);
  }
  auto epoch = server.Attach(FdPath(fd), getpid(), kNonce);
  EXPECT_EQ(epoch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(epoch.status().message()), HasSubstr("not on tmpfs"));
  ::close(fd);
}

TEST(ShmAttach, RefusesAnotherSegmentUnderTheSameFdNumber) {
  // A stale attach (its client gave up, closed the fd and made a new segment
  // that got the same number) must not serve the new segment.
  testing::RowHandler handler;
  ShmServer server(&handler);
  const int fd = MakeSegment(Geometry(handler.info()), MFD_ALLOW_SEALING, F_SEAL_SHRINK);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  auto epoch = server.Attach(FdPath(fd), getpid(), kNonce + 2);
  EXPECT_EQ(epoch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(epoch.status().message()), HasSubstr("reused"));
  // The live segment's nonce is not told: it is what an attach needs.
  EXPECT_THAT(std::string(epoch.status().message()),
              Not(HasSubstr(absl::StrCat(absl::Hex(kNonce)))));
  EXPECT_EQ(server.sessions(), 0u);
  ::close(fd);
}

// A segment other users can reach (a memfd is created mode 0777) is not
// served: only the service's own user's private segments are.
TEST(ShmAttach, RefusesASegmentOpenToOtherUsers) {
  testing::RowHandler handler;
  ShmServer server(&handler);
  for (mode_t mode : {0777, 0660, 0604}) {
    const int fd = MakeSegment(Geometry(handler.info()), MFD_ALLOW_SEALING, F_SEAL_SHRINK, mode);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    auto epoch = server.Attach(FdPath(fd), getpid(), kNonce);
    EXPECT_EQ(epoch.status().code(), absl::StatusCode::kPermissionDenied) << mode;
    EXPECT_THAT(std::string(epoch.status().message()), HasSubstr("0600"));
    ::close(fd);
  }
  EXPECT_EQ(server.sessions(), 0u);
}

}  // namespace
}  // namespace hmoe
