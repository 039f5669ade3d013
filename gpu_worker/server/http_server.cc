#include "gpu_worker/server/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace hmoe {
namespace {

constexpr size_t kReadChunk = 16 << 10;
constexpr size_t kMaxChunkLine = 4096;  // a chunk's size line, with extensions

int PollMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

// Waits for `events` on fd until the deadline; false on timeout or error.
bool WaitFd(int fd, short events, absl::Time deadline) {
  for (;;) {
    const int ms = PollMs(deadline);
    if (ms == 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return true;  // ready, or an error the next read or write reports
    if (r < 0 && errno != EINTR) return false;
  }
}

// A header name's characters (RFC 9110 5.6.2 tchar).
bool IsTokenChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
         (c != '\0' && std::strchr("!#$%&'*+-.^_`|~", c) != nullptr);
}

// Why a request could not be read: the status to answer (0: none, just close).
struct Refusal {
  int status = 0;
  std::string message;
};

}  // namespace

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return v;
  return "";
}

size_t HttpRequest::HeaderCount(std::string_view name) const {
  size_t n = 0;
  for (const auto& kv : headers) n += kv.first == name;
  return n;
}

const char* HttpReason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 413:
      return "Content Too Large";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Status";
  }
}

struct HttpServer::Impl {
  HttpServerOptions o;
  std::vector<std::string> routes;  // "METHOD /path"
  Handler handler;
  ErrorBody error_body;
  SSL_CTX* ssl_ctx = nullptr;
  int listen_fd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::thread acceptor;

  std::mutex mu;
  uint64_t next_id = 0;
  std::map<uint64_t, std::thread> threads;
  std::map<uint64_t, int> fds;  // live connections' sockets
  std::vector<uint64_t> finished;

  ~Impl() {
    if (ssl_ctx != nullptr) SSL_CTX_free(ssl_ctx);
    if (listen_fd >= 0) ::close(listen_fd);
  }

  // One connection: its socket, TLS session and what has been read of it.
  struct Conn {
    int fd = -1;
    SSL* ssl = nullptr;
    std::string buf;  // read, not yet consumed
    bool eof = false;
  };

  // Reads what is there (at least one byte) into c.buf; false on EOF,
  // error or the deadline.
  static bool ReadSome(Conn& c, absl::Time deadline) {
    char tmp[kReadChunk];
    for (;;) {
      if (c.ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_read(c.ssl, tmp, sizeof(tmp));
        if (n > 0) {
          c.buf.append(tmp, static_cast<size_t>(n));
          return true;
        }
        const int e = SSL_get_error(c.ssl, n);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
          if (!WaitFd(c.fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline)) return false;
          continue;
        }
        c.eof = true;
        return false;
      }
      const ssize_t n = ::recv(c.fd, tmp, sizeof(tmp), 0);
      if (n > 0) {
        c.buf.append(tmp, static_cast<size_t>(n));
        return true;
      }
      if (n == 0) {
        c.eof = true;
        return false;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        c.eof = true;
        return false;
      }
      if (!WaitFd(c.fd, POLLIN, deadline)) return false;
    }
  }

  static bool WriteAll(Conn& c, std::string_view data, absl::Duration stall) {
    size_t off = 0;
    absl::Time deadline = absl::Now() + stall;
    while (off < data.size()) {
      if (c.ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_write(c.ssl, data.data() + off,
                                static_cast<int>(std::min<size_t>(data.size() - off, 1 << 30)));
        if (n > 0) {
          off += static_cast<size_t>(n);
          deadline = absl::Now() + stall;
          continue;
        }
        const int e = SSL_get_error(c.ssl, n);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) return false;
        if (!WaitFd(c.fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline)) return false;
        continue;
      }
      const ssize_t n = ::send(c.fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
        deadline = absl::Now() + stall;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
      if (!WaitFd(c.fd, POLLOUT, deadline)) return false;
    }
    return true;
  }

  // Ensures c.buf holds `n` bytes; false on EOF, error or a stall of
  // o.io_timeout.
  bool Fill(Conn& c, size_t n) const {
    while (c.buf.size() < n)
      if (!ReadSome(c, absl::Now() + o.io_timeout)) return false;
    return true;
  }

  // A CRLF-terminated line at the front of c.buf (consumed, CRLF stripped).
  // nullopt-like: false with refusal set when it is too long or never comes.
  bool ReadLine(Conn& c, size_t max, std::string* line, Refusal* r) const {
    size_t scanned = 0;
    for (;;) {
      const size_t at = c.buf.find("\r\n", scanned > 0 ? scanned - 1 : 0);
      if (at != std::string::npos) {
        if (at > max) break;
        line->assign(c.buf, 0, at);
        c.buf.erase(0, at + 2);
        return true;
      }
      if (c.buf.size() > max) break;
      scanned = c.buf.size();
      if (!ReadSome(c, absl::Now() + o.io_timeout)) {
        r->status = 0;
        return false;
      }
    }
    r->status = 400;
    r->message = "malformed chunked body: a line too long";
    return false;
  }

  // Reads the head of the next request into `head` (through the blank
  // line): its first byte by first_byte_deadline, the whole head by
  // head_deadline (InfiniteFuture: header_timeout from the first byte).
  // status 0: the client closed or went silent between requests.
  bool ReadHead(Conn& c, absl::Time first_byte_deadline, absl::Time head_deadline,
                std::string* head, Refusal* r) const {
    // Blank lines before a request line are allowed (RFC 9112 2.2).
    for (;;) {
      while (c.buf.empty())
        if (!ReadSome(c, first_byte_deadline)) return false;
      size_t i = 0;
      while (i + 1 < c.buf.size() && c.buf[i] == '\r' && c.buf[i + 1] == '\n') i += 2;
      c.buf.erase(0, i);
      if (!c.buf.empty() && !(c.buf.size() == 1 && c.buf[0] == '\r')) break;
      if (!ReadSome(c, first_byte_deadline)) return false;
    }
    const absl::Time deadline = std::min(head_deadline, absl::Now() + o.header_timeout);
    size_t scanned = 0;
    for (;;) {
      const size_t at = c.buf.find("\r\n\r\n", scanned > 3 ? scanned - 3 : 0);
      if (at != std::string::npos && at + 4 <= o.max_header_bytes) {
        head->assign(c.buf, 0, at + 2);  // the last header line keeps its CRLF
        c.buf.erase(0, at + 4);
        return true;
      }
      if (c.buf.size() > o.max_header_bytes) {
        r->status = 431;
        r->message = absl::StrCat("the request head is over ", o.max_header_bytes, " bytes");
        return false;
      }
      scanned = c.buf.size();
      if (!ReadSome(c, deadline)) {
        if (!c.eof && absl::Now() >= deadline) {
          r->status = 408;
          r->message = absl::StrCat("the request head did not arrive within ",
                                    absl::FormatDuration(o.header_timeout));
        }
        return false;
      }
    }
  }

  // Parses a head; fills method, path, query, headers and *keep_alive.
  static bool ParseHead(const std::string& head, HttpRequest* q, bool* http11, Refusal* r) {
    std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
    if (!lines.empty() && lines.back().empty()) lines.pop_back();
    r->status = 400;
    if (lines.empty()) return r->message = "an empty request line", false;
    std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
    if (parts.size() != 3 || parts[0].empty() || parts[1].empty())
      return r->message = "a malformed request line", false;
    if (parts[2] == "HTTP/1.1") {
      *http11 = true;
    } else if (parts[2] == "HTTP/1.0") {
      *http11 = false;
    } else if (absl::StartsWith(parts[2], "HTTP/")) {
      r->status = 505;
      return r->message = absl::StrCat(parts[2], " is not supported (HTTP/1.1 is)"), false;
    } else {
      return r->message = "a malformed request line", false;
    }
    q->method = std::string(parts[0]);
    const absl::string_view target = parts[1];
    const size_t qm = target.find('?');
    q->path = std::string(target.substr(0, qm));
    if (qm != absl::string_view::npos) q->query = std::string(target.substr(qm + 1));
    for (size_t i = 1; i < lines.size(); ++i) {
      const absl::string_view l = lines[i];
      const size_t colon = l.find(':');
      // A token before the colon: no folded lines, no space before the
      // colon (RFC 9112 5.1, 5.2).
      if (l.empty() || colon == absl::string_view::npos || colon == 0 ||
          !std::all_of(l.begin(), l.begin() + colon, IsTokenChar))
        return r->message = "a malformed header line", false;
      q->headers.emplace_back(absl::AsciiStrToLower(l.substr(0, colon)),
                              std::string(absl::StripAsciiWhitespace(l.substr(colon + 1))));
    }
    r->status = 0;
    return true;
  }

  // The body's framing from the headers: *chunked, or *length (0: none).
  bool BodyFraming(const HttpRequest& q, bool* chunked, uint64_t* length, Refusal* r) const {
    *chunked = false;
    *length = 0;
    bool has_length = false;
    for (const auto& [k, v] : q.headers) {
      if (k == "transfer-encoding") {
        if (*chunked || !absl::EqualsIgnoreCase(v, "chunked")) {
          r->status = 501;
          r->message = absl::StrCat("Transfer-Encoding \"", v, "\" is not supported (chunked is)");
          return false;
        }
        *chunked = true;
      } else if (k == "content-length") {
        for (absl::string_view part : absl::StrSplit(v, ',')) {
          part = absl::StripAsciiWhitespace(part);
          uint64_t n = 0;
          if (part.empty() || part.size() > 19 ||
              !std::all_of(part.begin(), part.end(), absl::ascii_isdigit) ||
              !absl::SimpleAtoi(part, &n)) {
            r->status = 400;
            r->message = absl::StrCat("Content-Length \"", v, "\" is not a number");
            return false;
          }
          if (has_length && n != *length) {
            r->status = 400;
            r->message = "Content-Length headers that differ";
            return false;
          }
          has_length = true;
          *length = n;
        }
      }
    }
    if (*chunked && has_length) {
      r->status = 400;
      r->message = "both Content-Length and Transfer-Encoding";
      return false;
    }
    return true;
  }

  Refusal TooLarge() const {
    return {413, absl::StrCat("the request body is over ", o.max_body_bytes, " bytes")};
  }

  bool ReadChunked(Conn& c, std::string* body, Refusal* r) const {
    for (;;) {
      std::string line;
      if (!ReadLine(c, kMaxChunkLine, &line, r)) return false;
      const absl::string_view size_hex =
          absl::StripAsciiWhitespace(absl::string_view(line).substr(0, line.find(';')));
      uint64_t size = 0;
      if (size_hex.empty() || size_hex.size() > 15 ||
          !std::all_of(size_hex.begin(), size_hex.end(), absl::ascii_isxdigit) ||
          !absl::SimpleHexAtoi(size_hex, &size)) {
        *r = {400, "malformed chunked body: a bad chunk size"};
        return false;
      }
      if (size == 0) break;
      if (size > o.max_body_bytes - body->size()) {
        *r = TooLarge();
        return false;
      }
      if (!Fill(c, static_cast<size_t>(size) + 2)) return r->status = 0, false;
      if (c.buf.compare(static_cast<size_t>(size), 2, "\r\n") != 0) {
        *r = {400, "malformed chunked body: a chunk not followed by CRLF"};
        return false;
      }
      body->append(c.buf, 0, static_cast<size_t>(size));
      c.buf.erase(0, static_cast<size_t>(size) + 2);
    }
    // Trailers (ignored) up to the blank line, bounded like a head.
    size_t trailer_bytes = 0;
    for (;;) {
      std::string line;
      if (!ReadLine(c, kMaxChunkLine, &line, r)) return false;
      if (line.empty()) return true;
      trailer_bytes += line.size() + 2;
      if (trailer_bytes > o.max_header_bytes) {
        *r = {431,
              absl::StrCat("the chunked body's trailers are over ", o.max_header_bytes, " bytes")};
        return false;
      }
    }
  }

  // How a response's body is delimited.
  enum class Framing { kLength, kChunked, kUntilClose };

  // The status line and headers. An HTTP/1.0 client is told "keep-alive"
  // when the connection stays open (1.0's default is to close).
  std::string Head(const HttpResponse& res, bool keep_alive, Framing framing,
                   bool http11 = true) const {
    std::string h = absl::StrCat("HTTP/1.1 ", res.status, " ", HttpReason(res.status), "\r\n");
    if (!res.content_type.empty()) absl::StrAppend(&h, "Content-Type: ", res.content_type, "\r\n");
    for (const auto& [k, v] : res.headers) absl::StrAppend(&h, k, ": ", v, "\r\n");
    if (framing == Framing::kChunked) {
      h += "Transfer-Encoding: chunked\r\n";
    } else if (framing == Framing::kLength) {
      absl::StrAppend(&h, "Content-Length: ", res.body.size(), "\r\n");
    }
    if (!keep_alive) {
      h += "Connection: close\r\n";
    } else if (!http11) {
      h += "Connection: keep-alive\r\n";
    }
    h += "\r\n";
    return h;
  }

  // An error response written whole; false when the write failed.
  bool SendError(Conn& c, const HttpRequest& q, int status, const std::string& message,
                 bool keep_alive) const {
    HttpResponse res;
    res.status = status;
    if (error_body) error_body(q, message, res);
    if (res.body.empty()) {
      res.content_type = "text/plain; charset=utf-8";
      res.body = message + "\n";
    }
    if (status == 405) {
      std::string allow;
      for (const std::string& r : routes) {
        const size_t sp = r.find(' ');
        if (r.compare(sp + 1, std::string::npos, q.path) == 0)
          absl::StrAppend(&allow, allow.empty() ? "" : ", ", r.substr(0, sp));
      }
      res.headers.emplace_back("Allow", allow);
    }
    return WriteAll(c, Head(res, keep_alive, Framing::kLength) + res.body, o.io_timeout);
  }

  void Serve(Conn& c, absl::Time accepted) {
    if (c.ssl != nullptr) {
      const absl::Time deadline = accepted + o.header_timeout;
      for (;;) {
        ERR_clear_error();
        const int n = SSL_accept(c.ssl);
        if (n == 1) break;
        const int e = SSL_get_error(c.ssl, n);
        if ((e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) ||
            !WaitFd(c.fd, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline))
          return;
      }
    }
    bool first = true;
    while (!stopping.load()) {
      // The first request's head must come within header_timeout of the
      // connection; a later one's first byte within idle_timeout.
      const absl::Time wait_until =
          first ? accepted + o.header_timeout : absl::Now() + o.idle_timeout;
      const absl::Time head_until = first ? accepted + o.header_timeout : absl::InfiniteFuture();
      first = false;
      HttpRequest q;
      q.fd = c.fd;
      std::string head;
      Refusal r;
      if (!ReadHead(c, wait_until, head_until, &head, &r)) {
        if (r.status != 0) SendError(c, q, r.status, r.message, false);
        return;
      }
      bool http11 = true;
      bool chunked = false;
      uint64_t length = 0;
      if (!ParseHead(head, &q, &http11, &r) || !BodyFraming(q, &chunked, &length, &r)) {
        SendError(c, q, r.status, r.message, false);
        return;
      }
      const std::string connection = absl::AsciiStrToLower(q.Header("connection"));
      bool keep_alive = http11 ? !absl::StrContains(connection, "close")
                               : absl::StrContains(connection, "keep-alive");
      // Routing before the body: a refused request's body is not read.
      bool path_known = false, routed = false;
      for (const std::string& route : routes) {
        const size_t sp = route.find(' ');
        if (route.compare(sp + 1, std::string::npos, q.path) != 0) continue;
        path_known = true;
        routed = routed || route.compare(0, sp, q.method) == 0;
      }
      const bool has_body = chunked || length > 0;
      if (!routed) {
        // The body is not read: the connection cannot be reused after it.
        SendError(c, q, path_known ? 405 : 404,
                  path_known ? absl::StrCat(q.method, " is not allowed on ", q.path)
                             : absl::StrCat("no route ", q.method, " ", q.path),
                  keep_alive && !has_body);
        if (!keep_alive || has_body) return;
        continue;
      }
      if (length > o.max_body_bytes) {
        r = TooLarge();
        SendError(c, q, r.status, r.message, false);
        return;
      }
      const std::string expect = q.Header("expect");
      if (!expect.empty()) {
        if (!absl::EqualsIgnoreCase(expect, "100-continue")) {
          SendError(c, q, 417, absl::StrCat("Expect \"", expect, "\" is not supported"), false);
          return;
        }
        if (has_body && c.buf.empty() &&
            !WriteAll(c, "HTTP/1.1 100 Continue\r\n\r\n", o.io_timeout))
          return;
      }
      if (chunked) {
        if (!ReadChunked(c, &q.body, &r)) {
          if (r.status != 0) SendError(c, q, r.status, r.message, false);
          return;
        }
      } else if (length > 0) {
        if (!Fill(c, static_cast<size_t>(length))) return;
        q.body.assign(c.buf, 0, static_cast<size_t>(length));
        c.buf.erase(0, static_cast<size_t>(length));
      }

      HttpResponse res;
      try {
        handler(q, res);
      } catch (const std::exception& e) {
        res = HttpResponse();
        res.status = 500;
        if (error_body) error_body(q, absl::StrCat("internal error: ", e.what()), res);
      }
      if (!res.stream) {
        if (!WriteAll(c, Head(res, keep_alive, Framing::kLength, http11) + res.body, o.io_timeout))
          return;
        if (!keep_alive) return;
        continue;
      }
      // HTTP/1.0 has no chunked encoding: the stream ends with the connection.
      if (!http11) keep_alive = false;
      const bool chunk = http11;
      bool completed = false;
      if (WriteAll(c, Head(res, keep_alive, chunk ? Framing::kChunked : Framing::kUntilClose),
                   o.io_timeout)) {
        for (;;) {
          std::string out;
          bool done = false;
          if (!res.stream(&out, &done)) break;
          std::string frame;
          if (!out.empty())
            frame = chunk ? absl::StrCat(absl::Hex(out.size()), "\r\n", out, "\r\n") : out;
          if (done && chunk) frame += "0\r\n\r\n";
          if (!frame.empty() && !WriteAll(c, frame, o.io_timeout)) break;
          if (done) {
            completed = true;
            break;
          }
        }
      }
      if (res.on_stream_end) res.on_stream_end(completed);
      if (!completed || !keep_alive) return;
    }
  }

  void RunConnection(uint64_t id, int fd, absl::Time accepted) {
    Conn c;
    c.fd = fd;
    if (ssl_ctx != nullptr) {
      c.ssl = SSL_new(ssl_ctx);
      if (c.ssl != nullptr) SSL_set_fd(c.ssl, fd);
    }
    if (ssl_ctx == nullptr || c.ssl != nullptr) Serve(c, accepted);
    if (c.ssl != nullptr) {
      if (!c.eof) SSL_shutdown(c.ssl);
      SSL_free(c.ssl);
    }
    if (!c.eof && !stopping.load()) {
      // Closing with unread input resets the connection, which loses the
      // response (a 413, say) when the client is still sending, as most
      // clients do before they read: stop sending and discard what still
      // comes, up to twice the body limit and 10 s.
      ::shutdown(fd, SHUT_WR);
      const absl::Time until = absl::Now() + absl::Seconds(10);
      const size_t most = 2 * o.max_body_bytes;
      char drain[16384];
      for (size_t total = 0; total < most && WaitFd(fd, POLLIN, until);) {
        const ssize_t n = ::recv(fd, drain, sizeof(drain), 0);
        if (n <= 0 && !(n < 0 && (errno == EINTR || errno == EAGAIN))) break;
        if (n > 0) total += static_cast<size_t>(n);
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    fds.erase(id);
    finished.push_back(id);
  }

  void ReapFinished() {
    std::vector<std::thread> done;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (uint64_t id : finished) {
        auto it = threads.find(id);
        if (it == threads.end()) continue;
        done.push_back(std::move(it->second));
        threads.erase(it);
      }
      finished.clear();
    }
    for (std::thread& t : done) t.join();
  }

  // Over the cap: a 503 (plain HTTP; a TLS client just sees the close).
  void Refuse(int fd) const {
    if (ssl_ctx == nullptr) {
      char drain[4096];
      while (::recv(fd, drain, sizeof(drain), MSG_DONTWAIT) > 0) {
      }
      HttpRequest q;
      HttpResponse res;
      res.status = 503;
      const std::string message = absl::StrCat("the server has ", o.max_connections,
                                               " connections open (its limit); try again later");
      if (error_body) error_body(q, message, res);
      if (res.body.empty()) res.body = message + "\n";
      const std::string out = Head(res, false, Framing::kLength) + res.body;
      (void)::send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(fd, SHUT_WR);
    }
    ::close(fd);
  }

  void AcceptLoop() {
    while (!stopping.load()) {
      pollfd p{listen_fd, POLLIN, 0};
      const int r = ::poll(&p, 1, 200);
      ReapFinished();
      if (r <= 0 || stopping.load()) continue;
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) absl::SleepFor(absl::Milliseconds(50));
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::lock_guard<std::mutex> lock(mu);
      if (fds.size() >= static_cast<size_t>(o.max_connections)) {
        Refuse(fd);
        continue;
      }
      const uint64_t id = next_id++;
      fds[id] = fd;
      const absl::Time now = absl::Now();
      try {
        threads.emplace(id, std::thread([this, id, fd, now] { RunConnection(id, fd, now); }));
      } catch (const std::system_error&) {  // no thread to be had: as over the cap
        fds.erase(id);
        Refuse(fd);
      }
    }
  }
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    HttpServerOptions options, std::vector<std::string> methods_paths, Handler handler,
    ErrorBody error_body) {
  if (options.max_connections < 1)
    return absl::InvalidArgumentError("HTTP server: max_connections must be at least 1");
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->impl_ = std::make_unique<Impl>();
  Impl& im = *s->impl_;
  im.o = std::move(options);
  im.routes = std::move(methods_paths);
  im.handler = std::move(handler);
  im.error_body = std::move(error_body);
  const TlsServerFiles& tls = im.o.tls;
  if (tls.enabled()) {
    if (tls.cert_file.empty() || tls.key_file.empty())
      return absl::InvalidArgumentError("HTTPS needs both --tls-cert-file and --tls-key-file");
    im.ssl_ctx = SSL_CTX_new(TLS_server_method());
    bool ok =
        im.ssl_ctx != nullptr && SSL_CTX_set_min_proto_version(im.ssl_ctx, TLS1_2_VERSION) == 1 &&
        SSL_CTX_use_certificate_chain_file(im.ssl_ctx, tls.cert_file.c_str()) == 1 &&
        SSL_CTX_use_PrivateKey_file(im.ssl_ctx, tls.key_file.c_str(), SSL_FILETYPE_PEM) == 1 &&
        SSL_CTX_check_private_key(im.ssl_ctx) == 1;
    if (ok && !tls.client_ca_file.empty()) {
      ok = SSL_CTX_load_verify_locations(im.ssl_ctx, tls.client_ca_file.c_str(), nullptr) == 1;
      if (ok) {
        SSL_CTX_set_client_CA_list(im.ssl_ctx, SSL_load_client_CA_file(tls.client_ca_file.c_str()));
        SSL_CTX_set_verify(im.ssl_ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
      }
    }
    if (ok) {
      SSL_CTX_set_mode(im.ssl_ctx,
                       SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    } else {
      ERR_clear_error();
      return absl::InvalidArgumentError(
          absl::StrCat("HTTPS: cannot use the certificate ", tls.cert_file, " / key ", tls.key_file,
                       tls.client_ca_file.empty() ? "" : " / client CA ", tls.client_ca_file));
    }
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(im.o.port);
  const std::string where = absl::StrCat(im.o.host, ":", im.o.port);
  if (::getaddrinfo(im.o.host.c_str(), port_str.c_str(), &hints, &res) != 0 || res == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("--http-listen: cannot resolve ", im.o.host));
  std::string why;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      im.listen_fd = fd;
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (im.listen_fd < 0)
    return absl::UnavailableError(
        absl::StrCat("--http-listen: cannot listen on ", where, why.empty() ? "" : ": ", why));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(im.listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  im.port = bound.ss_family == AF_INET6
                ? ntohs(reinterpret_cast<const sockaddr_in6&>(bound).sin6_port)
                : ntohs(reinterpret_cast<const sockaddr_in&>(bound).sin_port);
  Impl* impl = &im;
  im.acceptor = std::thread([impl] { impl->AcceptLoop(); });
  return s;
}

int HttpServer::port() const { return impl_->port; }

void HttpServer::Stop() {
  if (!impl_ || impl_->stopping.exchange(true)) return;
  if (impl_->acceptor.joinable()) impl_->acceptor.join();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (const auto& [id, fd] : impl_->fds) ::shutdown(fd, SHUT_RDWR);
  }
  std::map<uint64_t, std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    threads.swap(impl_->threads);
  }
  for (auto& [id, t] : threads) t.join();
  ::close(impl_->listen_fd);
  impl_->listen_fd = -1;
}

HttpServer::~HttpServer() { Stop(); }

}  // namespace hmoe
