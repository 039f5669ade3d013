#include "common/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t max_bytes,
                                          absl::string_view what, uint32_t* mode) {
  const std::string name = what.empty() ? path : std::string(what);
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused
  // below as not a regular file).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat(name, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    if (err == ELOOP || err == ENOTDIR || err == ENXIO || err == ENAMETOOLONG)
      return absl::FailedPreconditionError(msg);
    return absl::InternalError(msg);
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return absl::InternalError(absl::StrCat(name, ": fstat: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    return absl::FailedPreconditionError(absl::StrCat(name, ": not a regular file"));
  if (st.st_size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", st.st_size, " bytes, over the limit of ", max_bytes));
  }
  if (mode != nullptr) *mode = static_cast<uint32_t>(st.st_mode & 07777);
  // Sized by fstat, grown if the file grows while read, never past the cap
  // (+1 byte to see that it was passed).
  std::string bytes(static_cast<size_t>(st.st_size) + 1, '\0');
  size_t n = 0;
  const size_t cap = static_cast<size_t>(max_bytes) + 1;
  while (true) {
    if (n == bytes.size()) {
      if (bytes.size() >= cap) break;
      bytes.resize(std::min(cap, std::max<size_t>(bytes.size() * 2, 4096)));
    }
    const ssize_t r = ::read(fd, bytes.data() + n, bytes.size() - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrCat(name, ": read: ", std::strerror(errno)));
    if (r == 0) break;
    n += static_cast<size_t>(r);
  }
  if (n > static_cast<size_t>(max_bytes))
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": grew past the limit of ", max_bytes, " bytes"));
  bytes.resize(n);
  return bytes;
}

}  // namespace hmoe
