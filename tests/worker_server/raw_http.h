// A raw TCP HTTP/1.1 client for the HTTP server's tests: sends exactly the
// bytes a test gives (pipelined requests, odd framing, slow heads) and reads
// responses one at a time from one connection.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace hmoe::testing {

struct RawResponse {
  int status = 0;  // 0: no response (closed, or timed out)
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercase
  std::string body;
  std::string Header(const std::string& name) const {
    for (const auto& [k, v] : headers)
      if (k == name) return v;
    return "";
  }
};

class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval send_timeout{10, 0};  // a server that stopped reading fails Send, not hangs it
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConnection() { Close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool Send(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }

  // Reads until `pred` holds on what was read, EOF, or the timeout.
  // true when pred held.
  template <typename Pred>
  bool ReadUntil(Pred pred, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!pred(buf_)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      char tmp[65536];
      const ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
      if (n <= 0) {
        eof_ = true;
        return pred(buf_);
      }
      buf_.append(tmp, static_cast<size_t>(n));
    }
    return true;
  }

  // Whether the server closed the connection within the timeout (what it
  // sent before stays readable through Read()).
  bool ClosedWithin(std::chrono::milliseconds timeout) {
    ReadUntil([this](const std::string&) { return eof_; }, timeout);
    return eof_;
  }

  // One response (Content-Length or chunked body); status 0 when none
  // arrived whole within the timeout.
  RawResponse Read(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    RawResponse r;
    size_t head_end = 0;
    if (!ReadUntil(
            [&](const std::string& b) {
              head_end = b.find("\r\n\r\n");
              return head_end != std::string::npos;
            },
            timeout))
      return r;
    const std::string head = buf_.substr(0, head_end);
    std::vector<std::string> lines = absl::StrSplit(head, "\r\n");
    std::vector<std::string> first = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
    int status = 0;
    if (first.size() < 2 || !absl::SimpleAtoi(first[1], &status)) return r;
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t c = lines[i].find(':');
      if (c == std::string::npos) continue;
      r.headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, c)),
                             std::string(absl::StripAsciiWhitespace(lines[i].substr(c + 1))));
    }
    size_t pos = head_end + 4;
    if (status == 100) {  // interim: no body
      buf_.erase(0, pos);
      r.status = status;
      return r;
    }
    if (absl::EqualsIgnoreCase(r.Header("transfer-encoding"), "chunked")) {
      for (;;) {
        size_t line_end = 0;
        if (!ReadUntil(
                [&](const std::string& b) {
                  line_end = b.find("\r\n", pos);
                  return line_end != std::string::npos;
                },
                timeout))
          return RawResponse{};
        const size_t size = std::strtoul(buf_.substr(pos, line_end - pos).c_str(), nullptr, 16);
        const size_t data = line_end + 2;
        if (!ReadUntil([&](const std::string& b) { return b.size() >= data + size + 2; }, timeout))
          return RawResponse{};
        if (size == 0) {
          pos = data + 2;
          break;
        }
        r.body += buf_.substr(data, size);
        pos = data + size + 2;
      }
    } else {
      size_t len = 0;
      if (!absl::SimpleAtoi(r.Header("content-length"), &len)) len = 0;
      if (!ReadUntil([&](const std::string& b) { return b.size() >= pos + len; }, timeout))
        return RawResponse{};
      r.body = buf_.substr(pos, len);
      pos += len;
    }
    buf_.erase(0, pos);
    r.status = status;
    return r;
  }

 private:
  int fd_ = -1;
  std::string buf_;
  bool eof_ = false;
};

}  // namespace hmoe::testing
