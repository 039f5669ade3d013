// The worker's request front ends in process, on the fortunes fixture (its
// tokenizer and chat template) with the in-process experts: what hostile
// input gets over HTTP (HttpService, through a raw TCP client) and over gRPC
// (GenerationService's request building).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <csignal>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "gmock/gmock.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/model.h"
#include "gpu_worker/server/generation_service.h"
#include "gpu_worker/server/http_service.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "tests/worker_server/raw_http.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RawConnection;
using testing::RawResponse;
using Json = nlohmann::ordered_json;
using namespace std::chrono_literals;

std::string FortunesDir() { return testing::FixturesDir() + "/ds3_fortunes"; }

// Opens, closes: `depth` levels of arrays.
std::string Deep(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

class HttpApiInProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::signal(SIGPIPE, SIG_IGN);
    ModelOptions mo;
    mo.max_seq_len = 512;
    mo.backend = "cpu";
    auto m = Model::Load(FortunesDir(), mo);
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
    auto t = Tokenizer::FromFile(FortunesDir() + "/tokenizer.json");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
    auto c = ChatTemplate::FromModelDir(FortunesDir());
    ASSERT_TRUE(c.ok()) << c.status();
    chat_ = new ChatTemplate(std::move(*c));
  }
  static void TearDownTestSuite() {
    delete chat_;
    delete tokenizer_;
    delete model_;
  }
  void SetUp() override {
    ASSERT_NE(model_, nullptr);
    auto e = Engine::Create(model_, tokenizer_, {});
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
  }
  void StartHttp(const ChatTemplate* chat = nullptr) {
    HttpServiceOptions o;
    o.listen = "127.0.0.1:0";
    o.model_name = "ds3_fortunes";
    auto h = HttpService::Start(engine_.get(), tokenizer_, chat ? chat : chat_, "", o);
    ASSERT_TRUE(h.ok()) << h.status();
    http_ = std::move(*h);
  }
  RawResponse Post(const std::string& path, const std::string& body,
                   const std::string& extra_headers = "") {
    RawConnection c(http_->port());
    EXPECT_TRUE(c.Send(absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Length: ",
                                    body.size(), "\r\n", extra_headers, "\r\n", body)));
    return c.Read(60s);
  }

  static Model* model_;
  static Tokenizer* tokenizer_;
  static ChatTemplate* chat_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<HttpService> http_;
};
Model* HttpApiInProcess::model_ = nullptr;
Tokenizer* HttpApiInProcess::tokenizer_ = nullptr;
ChatTemplate* HttpApiInProcess::chat_ = nullptr;

// ~120 KB bodies nested 60,000 deep where the request is copied and walked
// recursively (a message's key, tools, chat_template_kwargs): 400 naming the
// depth, and the worker goes on serving.
TEST_F(HttpApiInProcess, DeeplyNestedJsonIs400NotACrash) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  const std::string deep = Deep(60000);
  const std::vector<std::string> bodies = {
      R"({"messages": [{"role": "user", "content": "hi", "extra": )" + deep + "}]}",
      R"({"messages": [{"role": "user", "content": "hi"}], "tools": [)" + deep + "]}",
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": )" + deep +
          "}}",
      deep,
  };
  for (const std::string& body : bodies) {
    RawResponse r = Post("/v1/chat/completions", body);
    EXPECT_EQ(r.status, 400) << body.substr(0, 80);
    EXPECT_THAT(r.body, HasSubstr("nested deeper than 128 levels"));
  }
  RawResponse ok = Post("/v1/chat/completions",
                        R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "tools": [{"type": "function", "function": {"name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type":
                            "array", "items": {"type": "object"}}}}}}]})");
  EXPECT_EQ(ok.status, 200) << ok.body;
}

// A chat template hitting its limits on a request's input fails the same
// way on a retry: 400, not 429.
TEST_F(HttpApiInProcess, AChatTemplateLimitIs400NotRetry) {
  ChatTemplateOptions co;
  co.limits.max_output_bytes = 256;
  auto small =
      ChatTemplate::FromString("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                               std::nullopt, std::nullopt, co);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_NO_FATAL_FAILURE(StartHttp(&*small));
  Json body = {{"messages", {{{"role", "user"}, {"content", std::string(1000, 'a')}}}},
               {"max_tokens", 2}};
  RawResponse r = Post("/v1/chat/completions", body.dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_THAT(r.body, HasSubstr("exceeded 256 bytes"));
  EXPECT_THAT(r.body, Not(HasSubstr("rate_limit")));
}

// `curl -d` with a body over 8 KB (form-urlencoded, "Expect: 100-continue",
// waiting for the 100 before the body): the request is served.
TEST_F(HttpApiInProcess, ABodyAfterExpect100ContinueIsServed) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  Json body = {{"prompt", "The fortune of"}, {"max_tokens", 2}, {"temperature", 0}};
  const std::string text = std::string(9000, ' ') + body.dump();  // JSON whitespace
  RawConnection c(http_->port());
  // curl -d's content type (form-urlencoded), which the API reads as JSON too.
  ASSERT_TRUE(
      c.Send(absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          "application/x-www-form-urlencoded\r\nContent-Length: ",
                          text.size(), "\r\nExpect: 100-continue\r\n\r\n")));
  ASSERT_EQ(c.Read(5s).status, 100);
  ASSERT_TRUE(c.Send(text));
  RawResponse r = c.Read(60s);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Json::parse(r.body)["object"], "text_completion");
}

TEST_F(HttpApiInProcess, AChunkedBodyOverTheLimitIs413NamingIt) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  RawConnection c(http_->port());
  std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  ASSERT_TRUE(c.Send(head));
  // 16 MiB in 1 MiB chunks, then the size line of one more: refused there,
  // before its data (the limit is on the decoded body, whatever the framing).
  const std::string chunk = absl::StrCat("100000\r\n", std::string(1 << 20, ' '), "\r\n");
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(c.Send(chunk));
  ASSERT_TRUE(c.Send("100000\r\n"));
  RawResponse r = c.Read(10s);
  EXPECT_EQ(r.status, 413);
  EXPECT_THAT(r.body, HasSubstr(absl::StrCat("over ", 16 << 20, " bytes")));
  EXPECT_THAT(r.body, HasSubstr("request_too_large"));
}

// This process's end of a connection whose client end is `client_fd`
// (the server runs in process); -1 when not found.
int ServerSideFd(int client_fd) {
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  ::getsockname(client_fd, reinterpret_cast<sockaddr*>(&local), &len);
  for (int fd = 0; fd < 4096; ++fd) {
    if (fd == client_fd) continue;
    sockaddr_in peer{};
    socklen_t pl = sizeof(peer);
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
        peer.sin_family != AF_INET)
      continue;
    if (peer.sin_port == local.sin_port && peer.sin_addr.s_addr == local.sin_addr.s_addr) return fd;
  }
  return -1;
}

TEST_F(HttpApiInProcess, KeepAliveAndPipelinedRequestsAreAnsweredPromptly) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  RawConnection c(http_->port());
  const std::string completion =
      R"({"prompt": "The fortune of", "max_tokens": 2, "temperature": 0})";
  const std::string post = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ", completion.size(), "\r\n\r\n",
      completion);
  // Two requests in one write: both answered, in order.
  ASSERT_TRUE(c.Send(post + "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  RawResponse first = c.Read(60s);
  EXPECT_EQ(first.status, 200) << first.body;
  EXPECT_THAT(first.body, HasSubstr("text_completion"));
  RawResponse second = c.Read(10s);
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(second.body, R"({"status":"ok"})");
  // Responses after the first on the connection are not held back by
  // Nagle's algorithm waiting for the client's delayed ACK.
  const int server_fd = ServerSideFd(c.fd());
  ASSERT_GE(server_fd, 0);
  int on = 0;
  socklen_t len = sizeof(on);
  ASSERT_EQ(::getsockopt(server_fd, IPPROTO_TCP, TCP_NODELAY, &on, &len), 0);
  EXPECT_EQ(on, 1);
}

TEST_F(HttpApiInProcess, DifferingContentLengthsAre400) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  const std::string body = R"({"prompt": "The fortune of", "max_tokens": 2})";
  RawResponse r = Post("/v1/completions", body, "Content-Length: 5\r\n");
  EXPECT_EQ(r.status, 400) << r.body;
}

// Clients that send their request head a byte at a time do not make the
// API unavailable to others.
TEST_F(HttpApiInProcess, SlowHeadsDoNotHoldUpOtherClients) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  std::vector<std::unique_ptr<RawConnection>> slow;
  for (int i = 0; i < 120; ++i) {
    slow.push_back(std::make_unique<RawConnection>(http_->port()));
    ASSERT_TRUE(slow.back()->Send("GET /health HTTP/1.1\r\nX-Slow: "));
  }
  // A byte a second on each: every read is in time, the heads never end.
  for (int round = 0; round < 3; ++round) {
    std::this_thread::sleep_for(1s);
    for (auto& c : slow) c->Send("a");  // (a refusal to read is the server's, judged below)
  }
  RawConnection c(http_->port());
  ASSERT_TRUE(c.Send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(c.Read(3s).status, 200);
}

TEST(GrpcRequests, DeeplyNestedJsonFieldsAreInvalidArgument) {
  auto tok = Tokenizer::FromFile(FortunesDir() + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto chat = ChatTemplate::FromModelDir(FortunesDir());
  ASSERT_TRUE(chat.ok()) << chat.status();
  GenerationService service(nullptr, nullptr, tok->get(), FortunesDir(), "local");
  service.set_chat_template(&*chat, "");
  const std::string deep = Deep(60000);
  for (const char* field : {"template_kwargs_json", "tool_calls_json", "tools_json"}) {
    SCOPED_TRACE(field);
    api::v1::Chat c;
    auto* m = c.add_messages();
    m->set_role("user");
    m->set_content("hi");
    const std::string f = field;
    if (f == "template_kwargs_json") c.set_template_kwargs_json("{\"k\": " + deep + "}");
    if (f == "tool_calls_json") m->set_tool_calls_json("[" + deep + "]");
    if (f == "tools_json") c.set_tools_json("[" + deep + "]");
    auto ids = service.ChatPromptIds(c);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
    EXPECT_THAT(std::string(ids.status().message()), HasSubstr("nested deeper than 128 levels"));
  }
  api::v1::Chat fine;
  auto* m = fine.add_messages();
  m->set_role("user");
  m->set_content("hi");
  fine.set_template_kwargs_json(R"({"k": [[[1]]]})");
  EXPECT_TRUE(service.ChatPromptIds(fine).ok());
}

TEST(GrpcRequests, ModelInfoShowsTheModelDirectorysNameNotItsPath) {
  ModelOptions mo;
  mo.backend = "cpu";
  mo.max_seq_len = 256;
  auto model = Model::Load(FortunesDir(), mo);
  ASSERT_TRUE(model.ok()) << model.status();
  auto engine = Engine::Create(model->get(), nullptr, {});
  ASSERT_TRUE(engine.ok()) << engine.status();
  GenerationService service(engine->get(), model->get(), nullptr, FortunesDir() + "/", "local");
  grpc::ServerContext ctx;
  api::v1::ModelInfoRequest req;
  api::v1::ModelInfoResponse resp;
  ASSERT_TRUE(service.ModelInfo(&ctx, &req, &resp).ok());
  EXPECT_EQ(resp.model_dir(), "ds3_fortunes");
}

}  // namespace
}  // namespace hmoe
