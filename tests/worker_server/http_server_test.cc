// HttpServer (the worker's HTTP/1.1 server) against a raw TCP client: the
// framing, keep-alive, pipelining, limits and timeouts a hostile or merely
// unusual client meets.
#include "gpu_worker/server/http_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/worker_server/raw_http.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::RawConnection;
using testing::RawResponse;
using namespace std::chrono_literals;

// /echo answers the method, path and body; /nodelay whether the
// connection's socket has TCP_NODELAY; /stream three chunks.
struct EchoServer {
  std::unique_ptr<HttpServer> server;
  std::atomic<int> handled{0};
  int port() const { return server->port(); }

  bool Start(HttpServerOptions o = {}) {
    auto s = HttpServer::Start(
        std::move(o), {"GET /echo", "POST /echo", "GET /nodelay", "POST /stream"},
        [this](const HttpRequest& q, HttpResponse& r) {
          ++handled;
          r.content_type = "text/plain";
          if (q.path == "/nodelay") {
            int on = 0;
            socklen_t len = sizeof(on);
            ::getsockopt(q.fd, IPPROTO_TCP, TCP_NODELAY, &on, &len);
            r.body = on ? "on" : "off";
          } else if (q.path == "/stream") {
            auto n = std::make_shared<int>(0);
            r.stream = [n](std::string* out, bool* done) {
              *out = absl::StrCat("part", (*n)++, ";");
              *done = *n == 3;
              return true;
            };
          } else {
            r.body = absl::StrCat(q.method, " ", q.path, " ", q.body);
          }
        },
        [](const HttpRequest&, const std::string& message, HttpResponse& r) {
          r.content_type = "text/plain";
          r.body = "error: " + message;
        });
    if (!s.ok()) {
      ADD_FAILURE() << s.status();
      return false;
    }
    server = std::move(*s);
    return true;
  }
};

std::string Post(const std::string& path, const std::string& body, const std::string& extra = "") {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                      "\r\n", extra, "\r\n", body);
}

TEST(HttpServer, PipelinedRequestsAreAnsweredInOrder) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  RawConnection c(s.port());
  ASSERT_TRUE(c.ok());
  // Three requests in one write: each must get its answer, in order.
  ASSERT_TRUE(c.Send(absl::StrCat("GET /echo?a HTTP/1.1\r\nHost: x\r\n\r\n", Post("/echo", "two"),
                                  "GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")));
  RawResponse r1 = c.Read(), r2 = c.Read(), r3 = c.Read();
  EXPECT_EQ(r1.status, 200);
  EXPECT_EQ(r1.body, "GET /echo ");
  EXPECT_EQ(r2.status, 200);
  EXPECT_EQ(r2.body, "POST /echo two");
  EXPECT_EQ(r3.status, 200);
  EXPECT_EQ(r3.body, "GET /echo ");
}

TEST(HttpServer, KeepAliveConnectionsSetTcpNoDelayAndServeManyRequests) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  RawConnection c(s.port());
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(c.Send("GET /nodelay HTTP/1.1\r\nHost: x\r\n\r\n"));
    RawResponse r = c.Read();
    ASSERT_EQ(r.status, 200) << i;
    // Without TCP_NODELAY a response written after the previous one waits
    // for the client's delayed ACK (~40 ms per request).
    EXPECT_EQ(r.body, "on");
  }
  // A streamed response, then another request on the same connection.
  ASSERT_TRUE(c.Send(Post("/stream", "")));
  RawResponse st = c.Read();
  EXPECT_EQ(st.status, 200);
  EXPECT_EQ(st.body, "part0;part1;part2;");
  ASSERT_TRUE(c.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(c.Read().status, 200);
}

TEST(HttpServer, AChunkedBodyIsDecodedAndHeldToTheBodyLimit) {
  EchoServer s;
  HttpServerOptions o;
  o.max_body_bytes = 1000;
  ASSERT_TRUE(s.Start(o));
  {
    RawConnection c(s.port());
    ASSERT_TRUE(
        c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               "3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nX-Trailer: 1\r\n\r\n"));
    RawResponse r = c.Read();
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "POST /echo abcdefg");
  }
  {
    // 3 x 400 bytes: over 1000 once decoded, although each chunk is under.
    RawConnection c(s.port());
    std::string req = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 3; ++i) req += absl::StrCat("190\r\n", std::string(400, 'x'), "\r\n");
    req += "0\r\n\r\n";
    ASSERT_TRUE(c.Send(req));
    RawResponse r = c.Read();
    EXPECT_EQ(r.status, 413);
    EXPECT_THAT(r.body, HasSubstr("over 1000 bytes"));
    EXPECT_TRUE(c.ClosedWithin(5s));
  }
  {
    // A chunk size that would overflow, and one that is not hex.
    for (const char* size : {"fffffffffffffffffffff", "zz", ""}) {
      RawConnection c(s.port());
      ASSERT_TRUE(c.Send(absl::StrCat(
          "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", size, "\r\n")));
      RawResponse r = c.Read();
      EXPECT_EQ(r.status, 400) << size;
    }
  }
  EXPECT_EQ(s.handled.load(), 1);
}

TEST(HttpServer, Expect100ContinueIsAnsweredThenTheBodyServed) {
  EchoServer s;
  HttpServerOptions o;
  o.max_body_bytes = 100000;
  ASSERT_TRUE(s.Start(o));
  const std::string body(9000, 'b');  // curl sends Expect: 100-continue for bodies this size
  RawConnection c(s.port());
  ASSERT_TRUE(c.Send(absl::StrCat("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(),
                                  "\r\nExpect: 100-continue\r\n\r\n")));
  RawResponse cont = c.Read(5s);
  ASSERT_EQ(cont.status, 100);
  ASSERT_TRUE(c.Send(body));
  RawResponse r = c.Read();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "POST /echo " + body);

  // Over the limit: 413 at once, no 100 and the body not waited for.
  RawConnection big(s.port());
  ASSERT_TRUE(
      big.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\nExpect: "
               "100-continue\r\n\r\n"));
  RawResponse refused = big.Read(5s);
  EXPECT_EQ(refused.status, 413);
  EXPECT_THAT(refused.body, HasSubstr("over 100000 bytes"));
}

TEST(HttpServer, AmbiguousFramingIs400) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  const std::vector<std::string> bad = {
      "Content-Length: 3\r\nContent-Length: 4\r\n",
      "Content-Length: 3, 4\r\n",
      "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
      "Content-Length: -3\r\n",
      "Content-Length: 3x\r\n",
      " folded: line\r\n",
      "Bad Name: 1\r\n",
  };
  for (const std::string& h : bad) {
    RawConnection c(s.port());
    ASSERT_TRUE(c.Send(absl::StrCat("POST /echo HTTP/1.1\r\nHost: x\r\n", h, "\r\nabcd")));
    RawResponse r = c.Read();
    EXPECT_EQ(r.status, 400) << h;
    EXPECT_TRUE(c.ClosedWithin(5s)) << h;
  }
  // The same length twice is one length.
  RawConnection c(s.port());
  ASSERT_TRUE(c.Send(
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc"));
  RawResponse r = c.Read();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "POST /echo abc");
  // Another encoding than chunked is not guessed at.
  RawConnection gz(s.port());
  ASSERT_TRUE(gz.Send("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"));
  EXPECT_EQ(gz.Read().status, 501);
  EXPECT_EQ(s.handled.load(), 1);
}

TEST(HttpServer, UnknownPathsAndMethods) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  RawConnection c(s.port());
  ASSERT_TRUE(
      c.Send("GET /nope HTTP/1.1\r\nHost: x\r\n\r\nDELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  RawResponse r1 = c.Read();
  EXPECT_EQ(r1.status, 404);
  EXPECT_EQ(r1.body, "error: no route GET /nope");
  RawResponse r2 = c.Read();
  EXPECT_EQ(r2.status, 405);
  EXPECT_EQ(r2.Header("allow"), "GET, POST");
  RawConnection v(s.port());
  ASSERT_TRUE(v.Send("GET /echo HTTP/2.0\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(v.Read().status, 505);
}

TEST(HttpServer, ASlowHeadIsCutOffAtTheHeaderTimeout) {
  EchoServer s;
  HttpServerOptions o;
  o.header_timeout = absl::Milliseconds(500);
  ASSERT_TRUE(s.Start(o));
  RawConnection c(s.port());
  const std::string head =
      "GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: abcdefghijklmnopqrstuvwxyz\r\n";
  // One byte every 100 ms: each byte is in time, the head as a whole is not.
  bool closed = false;
  for (size_t i = 0; i < head.size() && !closed; ++i) {
    if (!c.Send(head.substr(i, 1))) break;
    closed = c.ClosedWithin(100ms);
  }
  if (!closed) closed = c.ClosedWithin(3s);
  EXPECT_TRUE(closed);
  EXPECT_EQ(s.handled.load(), 0);
  // A connection that sends nothing is closed too.
  RawConnection silent(s.port());
  EXPECT_TRUE(silent.ClosedWithin(5s));
}

// The first request's head is due header_timeout after the connection,
// not after its first byte.
TEST(HttpServer, TheFirstHeadIsDueFromTheConnection) {
  EchoServer s;
  HttpServerOptions o;
  o.header_timeout = absl::Seconds(1);
  ASSERT_TRUE(s.Start(o));
  RawConnection c(s.port());
  std::this_thread::sleep_for(900ms);
  // A byte every 100 ms from 0.9 s: closed at 1 s, well before 1.9 s.
  int sent = 0;
  bool closed = false;
  for (; sent < 30 && !closed; ++sent) {
    c.Send("G");
    closed = c.ClosedWithin(100ms);
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(sent, 8);
}

TEST(HttpServer, SlowClientsDoNotHoldUpOthers) {
  EchoServer s;
  ASSERT_TRUE(s.Start());  // the defaults: 10 s for a head, 512 connections
  std::vector<std::unique_ptr<RawConnection>> slow;
  for (int i = 0; i < 150; ++i) {
    slow.push_back(std::make_unique<RawConnection>(s.port()));
    ASSERT_TRUE(slow.back()->Send("GET /echo HTTP/1.1\r\nHo"));
  }
  RawConnection c(s.port());
  ASSERT_TRUE(c.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  // Answered while the slow heads are still within their timeout.
  RawResponse r = c.Read(5s);
  EXPECT_EQ(r.status, 200);
}

TEST(HttpServer, ConnectionsOverTheCapAre503) {
  EchoServer s;
  HttpServerOptions o;
  o.max_connections = 3;
  ASSERT_TRUE(s.Start(o));
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawConnection>(s.port()));
    // Served: the connection is the server's now.
    ASSERT_TRUE(held.back()->Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
    ASSERT_EQ(held.back()->Read().status, 200);
  }
  RawConnection over(s.port());
  RawResponse r = over.Read(5s);
  EXPECT_EQ(r.status, 503);
  EXPECT_THAT(r.body, HasSubstr("3 connections"));
  EXPECT_TRUE(over.ClosedWithin(5s));
  // One closes: a new connection is served again.
  held.pop_back();
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served; ++attempt) {
    RawConnection c(s.port());
    c.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n");
    served = c.Read(5s).status == 200;
    if (!served) std::this_thread::sleep_for(100ms);
  }
  EXPECT_TRUE(served);
}

TEST(HttpServer, Http10ClosesUnlessKeepAliveAndStreamsUntilClose) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  RawConnection c(s.port());
  ASSERT_TRUE(c.Send("GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  RawResponse r = c.Read();
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.Header("connection"), "keep-alive");
  ASSERT_TRUE(c.Send("POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n"));
  // No chunked encoding in HTTP/1.0: the body is what comes until the close.
  ASSERT_TRUE(c.ClosedWithin(5s));
  RawConnection once(s.port());
  ASSERT_TRUE(once.Send("GET /echo HTTP/1.0\r\n\r\n"));
  EXPECT_EQ(once.Read().status, 200);
  EXPECT_TRUE(once.ClosedWithin(5s));
}

// HTTPS: a client that connects and never completes the handshake is
// closed at the header timeout, and does not hold up a real client.
TEST(HttpServer, TlsHandshakesAreBoundedByTheHeaderTimeout) {
  const std::string tls = testing::FixturesDir() + "/tls";
  EchoServer s;
  HttpServerOptions o;
  o.tls.cert_file = tls + "/server.pem";
  o.tls.key_file = tls + "/server.key";
  o.header_timeout = absl::Seconds(1);
  ASSERT_TRUE(s.Start(o));
  std::vector<std::unique_ptr<RawConnection>> stalled;
  for (int i = 0; i < 100; ++i) {
    stalled.push_back(std::make_unique<RawConnection>(s.port()));
    ASSERT_TRUE(stalled.back()->Send(std::string(1, '\x16')));  // a TLS record's first byte
  }
  // A real TLS client meanwhile.
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  ASSERT_NE(ctx, nullptr);
  RawConnection c(s.port());
  ASSERT_TRUE(c.ok());
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, c.fd());
  EXPECT_EQ(SSL_connect(ssl), 1);
  const std::string req = "GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  EXPECT_EQ(SSL_write(ssl, req.data(), static_cast<int>(req.size())), static_cast<int>(req.size()));
  std::string got;
  char buf[4096];
  for (int n; (n = SSL_read(ssl, buf, sizeof(buf))) > 0;) got.append(buf, static_cast<size_t>(n));
  EXPECT_THAT(got, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(got, HasSubstr("GET /echo"));
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  for (auto& st : stalled) EXPECT_TRUE(st->ClosedWithin(5s));
}

TEST(HttpServer, StopEndsIdleAndSlowConnections) {
  EchoServer s;
  ASSERT_TRUE(s.Start());
  RawConnection idle(s.port()), slow(s.port());
  ASSERT_TRUE(idle.Send("GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_EQ(idle.Read().status, 200);
  ASSERT_TRUE(slow.Send("GET /ec"));
  s.server->Stop();
  EXPECT_TRUE(idle.ClosedWithin(5s));
  EXPECT_TRUE(slow.ClosedWithin(5s));
}

}  // namespace
}  // namespace hmoe
