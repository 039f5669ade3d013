// A small HTTP/1.1 server (plain or TLS over OpenSSL) for the worker's
// OpenAI-compatible API: one thread per connection, up to max_connections.
//
// What it promises a client (and refuses a hostile one):
//   * keep-alive and pipelining: requests on one connection are answered in
//     order, each response written with one send (TCP_NODELAY is set);
//   * the request head (and a TLS handshake) must arrive within
//     header_timeout, at most max_header_bytes (else 408 / 431, closed);
//   * a body, Content-Length or chunked, is at most max_body_bytes after
//     decoding (else 413 naming the limit; the rest is discarded, up to
//     twice the limit, so that a client still sending reads the 413, and the
//     connection is closed);
//     `Expect: 100-continue` gets "100 Continue" before the body is read;
//   * ambiguous framing is 400 and closes the connection: Content-Length
//     values that differ, Content-Length with Transfer-Encoding, a
//     Transfer-Encoding other than chunked, a malformed chunk;
//   * a connection over max_connections gets 503 and is closed;
//   * a body that stalls, or a client that stops reading a response, for
//     io_timeout ends the connection.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/grpc_tls.h"

namespace hmoe {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // an address (names are not resolved); "::" / "0.0.0.0": any
  int port = 0;                    // 0: any free port (HttpServer::port())
  TlsServerFiles tls;              // cert + key: HTTPS
  size_t max_body_bytes = 16 << 20;
  size_t max_header_bytes = 64 << 10;
  int max_connections = 512;
  absl::Duration header_timeout = absl::Seconds(10);  // a request head, or a TLS handshake
  absl::Duration idle_timeout = absl::Seconds(5);     // between requests of a connection
  absl::Duration io_timeout = absl::Seconds(30);      // a body read or response write stalled
};

struct HttpRequest {
  std::string method;
  std::string path;                                          // the target without its query
  std::string query;                                         // after '?', undecoded
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercase, in order
  std::string body;
  int fd = -1;  // the connection's socket: to peek whether the client left

  // The first value of a header (name in lowercase); empty when absent.
  std::string Header(std::string_view name) const;
  size_t HeaderCount(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // Set: the body is streamed (chunked) instead: called until it returns
  // false (then the connection is closed) or sets *done; what it appends to
  // *out is sent after each call.
  std::function<bool(std::string* out, bool* done)> stream;
  // With `stream`: called once at its end, true when the stream completed.
  std::function<void(bool completed)> on_stream_end;
};

class HttpServer {
 public:
  using Handler = std::function<void(const HttpRequest&, HttpResponse&)>;
  // Framing and routing errors (400, 404, 405, 408, 413, 431, 503) are given
  // to this, with the message, to write the response body.
  using ErrorBody =
      std::function<void(const HttpRequest&, const std::string& message, HttpResponse&)>;

  // Binds (an error names the address); serves from Start on.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           std::vector<std::string> methods_paths,
                                                           Handler handler, ErrorBody error_body);
  ~HttpServer();  // Stop()
  int port() const;
  // Closes the listener and every connection; waits for the handlers.
  void Stop();

  struct Impl;

 private:
  HttpServer() = default;
  std::unique_ptr<Impl> impl_;
};

const char* HttpReason(int status);

}  // namespace hmoe
