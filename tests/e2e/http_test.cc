// The worker's OpenAI-compatible HTTP API end to end: the real worker and
// expert service processes on the fortunes fixture (its tokenizer and chat
// template), driven by an HTTP client. The gRPC API on the same worker is
// the reference for what a request generates.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/serving_pair.h"
#include "tests/testing/prometheus_text.h"

namespace hmoe {
namespace {

using Json = nlohmann::json;

std::string FortunesModel() {
  return std::string(HMOE_SOURCE_DIR) + "/tests/fixtures/ds3_fortunes";
}

int ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

// The clients here write to servers that may hang up (a TLS handshake
// refused): that is an error on the write, not this process's end.
[[maybe_unused]] const bool kIgnoreSigpipe = [] {
  ::signal(SIGPIPE, SIG_IGN);
  return true;
}();

// A worker with --http-listen on the fortunes model and its HTTP client.
struct HttpPair {
  testing::Pair pair;
  int port = 0;
  std::string model = FortunesModel();
  bool Start(std::vector<std::string> extra = {}) {
    extra.push_back("--http-listen=127.0.0.1:0");
    extra.push_back("--http-port-file=" + pair.file("http.port"));
    if (!pair.Start(model, 1, "tp", "shm", extra)) return false;
    port = ReadPort(pair.file("http.port"));
    return port > 0;
  }
  httplib::Client Client(const std::string& token = "", int read_timeout_s = 30) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(read_timeout_s, 0);
    if (!token.empty()) c.set_bearer_token_auth(token.c_str());
    return c;
  }
};

// The data: payloads of an SSE body, in order.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (absl::StartsWith(line, "data: ")) out.emplace_back(line.substr(6));
  }
  return out;
}

api::v1::GenerateRequest GreedyGrpc(const std::string& prompt, int max_tokens) {
  api::v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_tokens(max_tokens);
  r.set_add_special_tokens(true);
  r.mutable_sampling()->set_temperature(0);
  return r;
}

TEST(HttpApi, CompletionsMatchTheGrpcApiWholeAndStreamed) {
  HttpPair h;
  ASSERT_TRUE(h.Start());
  auto grpc = h.pair.client().Generate(GreedyGrpc("The fortune of", 12));
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  auto c = h.Client();

  auto res = c.Post("/v1/completions",
                    R"({"model": "ds3_fortunes", "prompt": "The fortune of", "max_tokens": 12,
                        "temperature": 0, "some_unknown_field": [1, 2]})",
                    "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  Json j = Json::parse(res->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "ds3_fortunes");
  EXPECT_TRUE(absl::StartsWith(j["id"].get<std::string>(), "cmpl-"));
  EXPECT_EQ(j["choices"][0]["text"], grpc->text);
  EXPECT_EQ(j["choices"][0]["finish_reason"],
            grpc->finish_reason == api::v1::FINISH_REASON_LENGTH ? "length" : "stop");
  EXPECT_EQ(j["usage"]["prompt_tokens"], grpc->usage.prompt_tokens());
  EXPECT_EQ(j["usage"]["completion_tokens"], grpc->usage.completion_tokens());
  EXPECT_EQ(j["usage"]["total_tokens"],
            grpc->usage.prompt_tokens() + grpc->usage.completion_tokens());

  // Streamed: the deltas add up to the same text; usage only when asked.
  for (const bool usage : {false, true}) {
    SCOPED_TRACE(usage);
    Json req = {
        {"prompt", "The fortune of"}, {"max_tokens", 12}, {"temperature", 0}, {"stream", true}};
    if (usage) req["stream_options"] = {{"include_usage", true}};
    auto s = c.Post("/v1/completions", req.dump(), "application/json");
    ASSERT_TRUE(s);
    ASSERT_EQ(s->status, 200) << s->body;
    EXPECT_EQ(s->get_header_value("Content-Type"), "text/event-stream");
    const auto data = SseData(s->body);
    ASSERT_GE(data.size(), 3u) << s->body;
    EXPECT_EQ(data.back(), "[DONE]");
    std::string text;
    std::string finish;
    int usage_chunks = 0;
    for (size_t i = 0; i + 1 < data.size(); ++i) {
      Json ch = Json::parse(data[i]);
      EXPECT_EQ(ch["object"], "text_completion");
      if (ch.contains("usage")) {
        ++usage_chunks;
        EXPECT_TRUE(ch["choices"].empty());
        EXPECT_EQ(ch["usage"]["completion_tokens"], grpc->usage.completion_tokens());
        continue;
      }
      text += ch["choices"][0]["text"].get<std::string>();
      if (!ch["choices"][0]["finish_reason"].is_null())
        finish = ch["choices"][0]["finish_reason"].get<std::string>();
    }
    EXPECT_EQ(text, grpc->text);
    EXPECT_EQ(finish, j["choices"][0]["finish_reason"]);
    EXPECT_EQ(usage_chunks, usage ? 1 : 0);
  }

  // A prompt of token ids, and a batch of one.
  auto ids = h.pair.client().Tokenize("The fortune of", true);
  ASSERT_TRUE(ids.ok());
  for (const Json& prompt :
       {Json(*ids), Json::array({Json(*ids)}), Json::array({"The fortune of"})}) {
    auto r = c.Post("/v1/completions",
                    Json{{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}}.dump(),
                    "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(Json::parse(r->body)["choices"][0]["text"], grpc->text) << prompt;
  }

  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  Json m = Json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "ds3_fortunes");
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(HttpApi, ChatRendersTheTemplateWholeAndStreamed) {
  HttpPair h;
  ASSERT_TRUE(h.Start());
  // The fixture's template, rendered by hand for this conversation.
  const std::string rendered =
      "<|begin▁of▁sentence|>Be brief.\n\nUser: Tell me a fortune\nAssistant:";
  api::v1::GenerateRequest g;
  auto ids = h.pair.client().Tokenize(rendered, false);
  ASSERT_TRUE(ids.ok());
  for (int32_t t : *ids) g.mutable_prompt_ids()->add_ids(t);
  g.set_max_tokens(10);
  g.mutable_sampling()->set_temperature(0);
  auto grpc = h.pair.client().Generate(g);
  ASSERT_TRUE(grpc.ok()) << grpc.status();

  auto c = h.Client();
  const Json messages =
      Json::array({{{"role", "developer"}, {"content", "Be brief."}},
                   {{"role", "user"},
                    {"content", Json::array({{{"type", "text"}, {"text", "Tell me"}},
                                             {{"type", "text"}, {"text", "a fortune"}}})}}});
  // Text parts join with "\n": render that one too.
  const std::string rendered_parts =
      "<|begin▁of▁sentence|>Be brief.\n\nUser: Tell me\na fortune\nAssistant:";
  auto parts_ids = h.pair.client().Tokenize(rendered_parts, false);
  ASSERT_TRUE(parts_ids.ok());
  g.mutable_prompt_ids()->clear_ids();
  for (int32_t t : *parts_ids) g.mutable_prompt_ids()->add_ids(t);
  auto grpc_parts = h.pair.client().Generate(g);
  ASSERT_TRUE(grpc_parts.ok());

  auto res =
      c.Post("/v1/chat/completions",
             Json{{"messages", messages}, {"max_completion_tokens", 10}, {"temperature", 0}}.dump(),
             "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  Json j = Json::parse(res->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], grpc_parts->text);
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int64_t>(parts_ids->size()));

  const Json plain = Json::array({{{"role", "system"}, {"content", "Be brief."}},
                                  {{"role", "user"}, {"content", "Tell me a fortune"}}});
  auto s = c.Post("/v1/chat/completions",
                  Json{{"messages", plain},
                       {"max_tokens", 10},
                       {"temperature", 0},
                       {"stream", true},
                       {"stream_options", {{"include_usage", true}}}}
                      .dump(),
                  "application/json");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200) << s->body;
  const auto data = SseData(s->body);
  ASSERT_GE(data.size(), 4u);
  EXPECT_EQ(data.back(), "[DONE]");
  std::string text;
  Json first = Json::parse(data[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    Json ch = Json::parse(data[i]);
    if (ch["choices"].empty()) {
      EXPECT_EQ(ch["usage"]["prompt_tokens"], static_cast<int64_t>(ids->size()));
      EXPECT_EQ(i + 2, data.size()) << "usage comes last, before [DONE]";
      continue;
    }
    if (ch["choices"][0]["delta"].contains("content"))
      text += ch["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, grpc->text);

  // Past an eos (ignore_eos): the eos adds no text, and the stream must
  // still end properly with every delta (an empty write once cut it).
  const Json long_req = {
      {"messages", plain}, {"max_tokens", 64}, {"temperature", 0}, {"ignore_eos", true}};
  auto whole64 = c.Post("/v1/chat/completions", long_req.dump(), "application/json");
  ASSERT_TRUE(whole64);
  ASSERT_EQ(whole64->status, 200);
  Json streamed_req = long_req;
  streamed_req["stream"] = true;
  auto s64 = c.Post("/v1/chat/completions", streamed_req.dump(), "application/json");
  ASSERT_TRUE(s64);
  const auto d64 = SseData(s64->body);
  ASSERT_FALSE(d64.empty());
  EXPECT_EQ(d64.back(), "[DONE]");
  std::string text64;
  for (size_t i = 0; i + 1 < d64.size(); ++i) {
    Json ch = Json::parse(d64[i]);
    if (!ch["choices"].empty() && ch["choices"][0]["delta"].contains("content"))
      text64 += ch["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text64, Json::parse(whole64->body)["choices"][0]["message"]["content"]);
  EXPECT_EQ(Json::parse(whole64->body)["usage"]["completion_tokens"], 64);

  // The template's own error is the client's 400.
  auto bad = c.Post("/v1/chat/completions",
                    R"({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2})",
                    "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  EXPECT_NE(bad->body.find("chat template raised: Unknown role: tool"), std::string::npos)
      << bad->body;
}

// status, error.type, error.param of one request.
struct Refusal {
  int status;
  std::string type, param;
};
Refusal RefusalOf(const httplib::Result& r) {
  if (!r) return {-1, "", ""};
  Json j = Json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("error")) return {r->status, "(no error JSON)", r->body};
  return {r->status, j["error"]["type"].get<std::string>(),
          j["error"]["param"].is_null() ? "" : j["error"]["param"].get<std::string>()};
}

TEST(HttpApi, BadRequestsGetOpenAiErrorsNamingTheField) {
  HttpPair h;
  ASSERT_TRUE(h.Start());
  auto c = h.Client();
  struct Case {
    const char* path;
    const char* body;
    int status;
    const char* param;
  };
  const Case cases[] = {
      {"/v1/completions", R"({"prompt": "x", "max_tokens": "3"})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": "x", "temperature": 3})", 400, "temperature"},
      {"/v1/completions", R"({"prompt": "x", "top_p": 0})", 400, "top_p"},
      {"/v1/completions", R"({"prompt": "x", "n": 2})", 400, "n"},
      {"/v1/completions", R"({"prompt": "x", "stop": 7})", 400, "stop"},
      {"/v1/completions", R"({"prompt": "x", "stream": "yes"})", 400, "stream"},
      {"/v1/completions", R"({"prompt": "x", "logit_bias": {"5": 1}})", 400, "logit_bias"},
      {"/v1/completions", R"({"prompt": "x", "echo": true})", 400, "echo"},
      {"/v1/completions", R"({"prompt": ["a", "b"]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": ""})", 400, "prompt"},
      {"/v1/completions", R"({"max_tokens": 3})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [1, -2]})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": [999999]})", 400, ""},  // the engine: past the vocab
      {"/v1/completions", R"({"prompt": "x", "model": "gpt-4o"})", 404, "model"},
      {"/v1/completions", R"([1, 2])", 400, ""},
      {"/v1/completions", R"({"prompt": "x", )", 400, ""},
      {"/v1/chat/completions", R"({"messages": []})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages": [{"content": "x"}]})", 400, "messages[0].role"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400,
       "messages[0].content[0].type"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})",
       400, "logprobs"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", 400,
       "tool_choice"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(absl::StrCat(k.path, " ", k.body));
    const Refusal r = RefusalOf(c.Post(k.path, k.body, "application/json"));
    EXPECT_EQ(r.status, k.status);
    EXPECT_EQ(r.type, "invalid_request_error");
    EXPECT_EQ(r.param, k.param);
  }
  const Refusal route = RefusalOf(c.Get("/v1/engines"));
  EXPECT_EQ(route.status, 404);
  EXPECT_EQ(route.type, "invalid_request_error");
  // Over the 16 MiB body limit.
  const Refusal big =
      RefusalOf(c.Post("/v1/completions", std::string(17 << 20, ' ') + "{}", "application/json"));
  EXPECT_EQ(big.status, 413);
  EXPECT_EQ(big.type, "invalid_request_error");
  // Still serving.
  auto ok = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST(HttpApi, BearerTokensAsOnTheGrpcPort) {
  HttpPair h;
  { std::ofstream(h.pair.file("tokens")) << "s3cret-token-one\n"; }
  ASSERT_EQ(::chmod(h.pair.file("tokens").c_str(), 0600), 0);
  h.pair.set_client_token("s3cret-token-one");
  ASSERT_TRUE(h.Start({"--auth-token-file=" + h.pair.file("tokens")}));
  const std::string body = R"({"prompt": "x", "max_tokens": 2})";
  for (const std::string token : {"", "wrong"}) {
    const Refusal r = RefusalOf(h.Client(token).Post("/v1/completions", body, "application/json"));
    EXPECT_EQ(r.status, 401) << token;
    EXPECT_EQ(r.type, "authentication_error");
    EXPECT_EQ(RefusalOf(h.Client(token).Get("/v1/models")).status, 401);
  }
  auto ok = h.Client("s3cret-token-one").Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  auto health = h.Client().Get("/health");  // open, as gRPC health is
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

std::string Pem(const std::string& name) {
  return std::string(HMOE_SOURCE_DIR) + "/tests/fixtures/tls/" + name;
}

// --tls-cert-file / --tls-key-file make the HTTP port HTTPS too, and
// --tls-client-ca-file asks its clients for a certificate, as on gRPC.
TEST(HttpApi, HttpsWithTheWorkersCertificate) {
  for (const bool mutual : {false, true}) {
    SCOPED_TRACE(mutual);
    HttpPair h;
    TlsClientFiles tls;
    tls.ca_file = Pem("ca.pem");
    if (mutual) {
      tls.cert_file = Pem("client.pem");
      tls.key_file = Pem("client.key");
    }
    h.pair.set_client_tls(tls);
    std::vector<std::string> flags = {"--tls-cert-file=" + Pem("server.pem"),
                                      "--tls-key-file=" + Pem("server.key")};
    if (mutual) flags.push_back("--tls-client-ca-file=" + Pem("ca.pem"));
    ASSERT_TRUE(h.Start(flags));
    auto https = [&](bool with_cert) {
      auto c = with_cert ? std::make_unique<httplib::SSLClient>(
                               "127.0.0.1", h.port, Pem("client.pem"), Pem("client.key"))
                         : std::make_unique<httplib::SSLClient>("127.0.0.1", h.port);
      c->set_ca_cert_path(Pem("ca.pem").c_str());
      c->enable_server_certificate_verification(true);
      c->set_read_timeout(30, 0);
      return c;
    };
    auto ok = https(mutual)->Post("/v1/completions", R"({"prompt": "The", "max_tokens": 3})",
                                  "application/json");
    ASSERT_TRUE(ok) << httplib::to_string(ok.error());
    EXPECT_EQ(ok->status, 200) << ok->body;
    // Plain HTTP gets no answer from the HTTPS port.
    auto plain = h.Client().Get("/v1/models");
    EXPECT_TRUE(!plain || plain->status != 200);
    // A server certificate from another CA is refused by the client.
    auto other = std::make_unique<httplib::SSLClient>("127.0.0.1", h.port);
    other->set_ca_cert_path(Pem("other_ca.pem").c_str());
    other->enable_server_certificate_verification(true);
    EXPECT_FALSE(other->Get("/v1/models"));
    if (mutual) {
      EXPECT_FALSE(https(false)->Get("/v1/models")) << "no client certificate";
    }
    // A TLS client that hangs up mid-stream: the worker's next writes fail
    // (and must not end it: SIGPIPE), the request is cancelled, it serves on.
    {
      auto c = https(mutual);
      httplib::Request req;
      req.method = "POST";
      req.path = "/v1/completions";
      req.body = R"({"prompt": "The", "max_tokens": 900, "ignore_eos": true, "stream": true})";
      req.set_header("Content-Type", "application/json");
      int chunks = 0;
      req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
      c->send(req);
      EXPECT_GE(chunks, 1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto after = https(mutual)->Post("/v1/completions", R"({"prompt": "The", "max_tokens": 2})",
                                     "application/json");
    ASSERT_TRUE(after) << "the worker is gone: " << httplib::to_string(after.error());
    EXPECT_EQ(after->status, 200);
  }
}

int64_t KvBlocksUsed(testing::Pair& p) {
  auto s = p.client().Stats();
  return s.ok() ? s->kv_blocks_used() + s->running() + s->waiting() : -1;
}

// A raw connection that sends one request and hangs up after `wait`.
void PostAndHangUp(int port, const std::string& path, const std::string& body,
                   std::chrono::milliseconds wait) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const std::string req =
      absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
                   "Content-Length: ", body.size(), "\r\n\r\n", body);
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::this_thread::sleep_for(wait);
  ::close(fd);
}

TEST(HttpApi, AClientThatHangsUpFreesItsKvBlocks) {
  HttpPair h;
  ASSERT_TRUE(h.Start({"--max-batch=2"}));
  ASSERT_EQ(KvBlocksUsed(h.pair), 0);
  const std::string longer =
      R"({"prompt": "The fortune of", "max_tokens": 900, "ignore_eos": true)";
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream);
    const std::string body = longer + (stream ? R"(, "stream": true})" : "}");
    PostAndHangUp(h.port, "/v1/completions", body, std::chrono::milliseconds(300));
    // The request was running when the client left ...
    // ... and the engine let it go: no blocks held, nothing running.
    int64_t used = -1;
    for (int i = 0; i < 100; ++i) {
      used = KvBlocksUsed(h.pair);
      if (used == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(used, 0) << "KV blocks + running + waiting 5 s after the client hung up";
    auto st = h.pair.client().Stats();
    ASSERT_TRUE(st.ok());
    // 900 tokens were not generated for nobody.
    EXPECT_LT(st->tokens_generated(), stream ? 2 * 900 : 900);
  }
}

TEST(HttpApi, AFullQueueIs429AndADownExpertServiceIs503) {
  HttpPair h;
  ASSERT_TRUE(h.Start({"--max-batch=1", "--max-queue=1"}));
  // Four long requests at once: one runs, one waits, the rest are refused.
  // The two admitted ones run 600 decode steps one after the other: their
  // clients wait as long as that may take on a loaded machine (this checks
  // admission, not speed).
  std::vector<std::thread> threads;
  std::vector<Refusal> got(4);
  for (size_t i = 0; i < got.size(); ++i) {
    threads.emplace_back([&, i] {
      got[i] = RefusalOf(h.Client("", 180).Post(
          "/v1/completions", R"({"prompt": "The", "max_tokens": 300, "ignore_eos": true})",
          "application/json"));
    });
  }
  for (auto& t : threads) t.join();
  int ok = 0, limited = 0;
  for (const Refusal& r : got) {
    if (r.status == 200) ++ok;
    if (r.status == 429) {
      ++limited;
      EXPECT_EQ(r.type, "rate_limit_error");
    }
  }
  std::string statuses;  // -1: no answer within the client's timeout
  for (const Refusal& r : got) absl::StrAppend(&statuses, r.status, " ");
  EXPECT_GE(ok, 1) << statuses;
  EXPECT_GE(limited, 1) << statuses;
  EXPECT_EQ(ok + limited, 4) << statuses;

  // The expert service dies: health and new requests say 503 once the
  // worker's monitor has seen it (about a second).
  h.pair.expert().Kill(SIGKILL);
  Refusal r{};
  for (int i = 0; i < 50; ++i) {
    r = RefusalOf(h.Client().Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})",
                                  "application/json"));
    if (r.status == 503) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.type, "service_unavailable_error");
  // Health is the worker's monitor's view (a probe a second).
  int health = 0;
  for (int i = 0; i < 50 && health != 503; ++i) {
    auto res = h.Client().Get("/health");
    health = res ? res->status : -1;
    if (health != 503) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(health, 503);
  // Back: served again.
  ASSERT_TRUE(h.pair.expert().Restart());
  int status = 0;
  for (int i = 0; i < 100 && status != 200; ++i) {
    auto res = h.Client().Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})",
                               "application/json");
    status = res ? res->status : -1;
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(status, 200);
}

TEST(HttpApi, LogprobsForChatAndCompletions) {
  HttpPair h;
  ASSERT_TRUE(h.Start());
  auto c = h.Client();
  const Json msgs = Json::array({{{"role", "user"}, {"content", "Tell me a fortune"}}});
  const Json req = {{"messages", msgs}, {"max_tokens", 9},   {"temperature", 0},
                    {"logprobs", true}, {"top_logprobs", 3}, {"ignore_eos", true}};
  auto res = c.Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  Json j = Json::parse(res->body);
  const Json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 9u) << res->body;
  std::string joined;
  for (const Json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 3u);
    // Greedy: the chosen token is the most likely one.
    EXPECT_EQ(t["token"], t["top_logprobs"][0]["token"]);
    EXPECT_FLOAT_EQ(t["logprob"].get<float>(), t["top_logprobs"][0]["logprob"].get<float>());
    EXPECT_LE(t["logprob"].get<float>(), 0.f);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<float>(),
              t["top_logprobs"][1]["logprob"].get<float>());
    std::string bytes;
    for (const Json& b : t["bytes"]) bytes += static_cast<char>(b.get<int>());
    EXPECT_EQ(bytes, t["token"].get<std::string>());
  }
  // Streamed: the same entries, spread over the chunks.
  Json sreq = req;
  sreq["stream"] = true;
  auto s = c.Post("/v1/chat/completions", sreq.dump(), "application/json");
  ASSERT_TRUE(s);
  Json streamed = Json::array();
  for (const std::string& d : SseData(s->body)) {
    if (d == "[DONE]") continue;
    Json ch = Json::parse(d);
    if (!ch["choices"].empty() && !ch["choices"][0]["logprobs"].is_null())
      for (const Json& t : ch["choices"][0]["logprobs"]["content"]) streamed.push_back(t);
  }
  EXPECT_EQ(streamed, content);
  // Completions: the legacy shape.
  auto comp = c.Post("/v1/completions",
                     R"({"prompt": "The fortune", "max_tokens": 6, "temperature": 0,
                         "logprobs": 2, "ignore_eos": true})",
                     "application/json");
  ASSERT_TRUE(comp);
  ASSERT_EQ(comp->status, 200) << comp->body;
  Json cj = Json::parse(comp->body)["choices"][0]["logprobs"];
  ASSERT_EQ(cj["tokens"].size(), 6u) << comp->body;
  ASSERT_EQ(cj["token_logprobs"].size(), 6u);
  size_t offset = 0;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(cj["text_offset"][i], offset);
    offset += cj["tokens"][i].get<std::string>().size();
    EXPECT_GE(cj["top_logprobs"][i].size(), 2u);
    EXPECT_LE(cj["top_logprobs"][i].size(), 3u);
  }
  // Refusals name the field.
  EXPECT_EQ(
      RefusalOf(c.Post("/v1/chat/completions", Json{{"messages", msgs}, {"top_logprobs", 2}}.dump(),
                       "application/json"))
          .param,
      "top_logprobs");
  EXPECT_EQ(
      RefusalOf(c.Post("/v1/completions", R"({"prompt": "x", "logprobs": 21})", "application/json"))
          .param,
      "logprobs");
}

// The value of the sample `series` (name{labels} exactly) in Prometheus
// text, or -1.
double Sample(const std::string& text, const std::string& series) {
  return testing::PrometheusSample(text, series);
}

// The usage of a whole /v1/completions of "The fortune" with `max_tokens`;
// null when it failed (the calling test fails).
Json FortuneUsage(httplib::Client& c, int max_tokens) {
  auto r =
      c.Post("/v1/completions", Json{{"prompt", "The fortune"}, {"max_tokens", max_tokens}}.dump(),
             "application/json");
  EXPECT_TRUE(r);
  if (!r) return nullptr;
  EXPECT_EQ(r->status, 200) << r->body;
  return r->status == 200 ? Json::parse(r->body)["usage"] : Json(nullptr);
}

TEST(HttpApi, MetricsCountWhatWasServed) {
  HttpPair h;
  ASSERT_TRUE(h.Start());
  auto c = h.Client();
  int64_t generated = 0;
  for (int i = 0; i < 3; ++i) {
    const Json usage = FortuneUsage(c, 7);
    ASSERT_FALSE(usage.is_null());
    generated += usage["completion_tokens"].get<int64_t>();
  }
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  EXPECT_TRUE(absl::StartsWith(m->get_header_value("Content-Type"), "text/plain; version=0.0.4"));
  const std::string& t = m->body;
  EXPECT_EQ(Sample(t, "hmoe_requests_finished_total{outcome=\"length\"}") +
                Sample(t, "hmoe_requests_finished_total{outcome=\"stop\"}"),
            3);
  EXPECT_EQ(Sample(t, "hmoe_generation_tokens_total"), static_cast<double>(generated));
  EXPECT_EQ(Sample(t, "hmoe_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(Sample(t, "hmoe_requests_running"), 0);
  EXPECT_EQ(Sample(t, "hmoe_kv_blocks_used"), 0);
  EXPECT_GT(Sample(t, "hmoe_kv_blocks_capacity"), 0);
  const std::string shard = h.pair.expert().target();
  EXPECT_GT(Sample(t, absl::StrCat("hmoe_expert_calls_total{transport=\"shm\",shard=\"", shard,
                                   "\",outcome=\"ok\"}")),
            0)
      << t;
  EXPECT_EQ(Sample(t, absl::StrCat("hmoe_expert_shard_up{shard=\"", shard, "\"}")), 1);
  // Prometheus' own checker, where Debian's prometheus package is installed.
  if (::access("/usr/bin/promtool", X_OK) == 0) {
    const std::string file = h.pair.file("metrics.txt");
    std::ofstream(file) << t;
    EXPECT_EQ(std::system(("/usr/bin/promtool check metrics < " + file + " >/dev/null").c_str()), 0)
        << t;
  }
}

// With Expert Deferral (--defer-experts 1) the worker counts the expert
// slots it deferred: one per token of each forward pass per MoE layer but
// the last; a request's passes run its prompt and each generated token but
// the last.
TEST(HttpApi, MetricsCountTheDeferredExpertSlots) {
  HttpPair h;
  ASSERT_TRUE(h.Start({"--defer-experts=1"}));
  auto c = h.Client();
  int64_t pass_tokens = 0;
  for (int i = 0; i < 3; ++i) {
    const Json usage = FortuneUsage(c, 5);
    ASSERT_FALSE(usage.is_null());
    pass_tokens +=
        usage["prompt_tokens"].get<int64_t>() + usage["completion_tokens"].get<int64_t>() - 1;
  }
  // The fixture is DeepSeek-V3's layout: dense layers first, then MoE ones.
  std::ifstream f(FortunesModel() + "/config.json");
  const Json config = Json::parse(f);
  const int64_t deferring = config["num_hidden_layers"].get<int64_t>() -
                            config["first_k_dense_replace"].get<int64_t>() - 1;
  ASSERT_GT(deferring, 0);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  EXPECT_EQ(Sample(m->body, "hmoe_expert_deferred_slots_total"),
            static_cast<double>(pass_tokens * deferring))
      << m->body;
}

// Runs `cmd` (a client check script), its output and errors into *out;
// its wait status.
int RunCheck(const std::string& cmd, std::string* out) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out->append(buf, n);
  return ::pclose(p);
}

// The official `openai` Python client (pinned in
// tests/e2e/openai_client/requirements.txt, in the virtual environment
// deploy/run-tests.sh makes) against the worker: chat and completions whole
// and streamed, sampling fields, its exceptions for 404 / 400 / 401.
TEST(HttpApi, TheOfficialOpenAiClient) {
  const std::string python = std::string(HMOE_BINARY_DIR) + "/openai-venv/bin/python";
  if (::access(python.c_str(), X_OK) != 0)
    GTEST_SKIP() << "no " << python << " (deploy/run-tests.sh makes it with the pinned openai)";
  HttpPair h;
  { std::ofstream(h.pair.file("tokens")) << "client-key-0123456789\n"; }
  ASSERT_EQ(::chmod(h.pair.file("tokens").c_str(), 0600), 0);
  h.pair.set_client_token("client-key-0123456789");
  ASSERT_TRUE(h.Start({"--auth-token-file=" + h.pair.file("tokens")}));
  std::string out;
  const int status =
      RunCheck(absl::StrCat(python, " ", HMOE_SOURCE_DIR,
                            "/tests/e2e/openai_client/check.py http://127.0.0.1:", h.port,
                            "/v1 ds3_fortunes client-key-0123456789"),
               &out);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("ok   a wrong key -> AuthenticationError"), std::string::npos) << out;
}

// The official `anthropic` Python client (pinned in
// tests/e2e/anthropic_client/requirements.txt, in the virtual environment
// deploy/run-tests.sh makes) against /v1/messages: whole and streamed,
// count_tokens, a tool-use round trip in the history (the Qwen3 template,
// which renders tool turns), a stop sequence, its exceptions for 400 and
// 401 (the key sent as x-api-key).
TEST(HttpApi, TheOfficialAnthropicClient) {
  const std::string python = std::string(HMOE_BINARY_DIR) + "/anthropic-venv/bin/python";
  if (::access(python.c_str(), X_OK) != 0)
    GTEST_SKIP() << "no " << python << " (deploy/run-tests.sh makes it with the pinned anthropic)";
  HttpPair h;
  { std::ofstream(h.pair.file("tokens")) << "client-key-0123456789\n"; }
  ASSERT_EQ(::chmod(h.pair.file("tokens").c_str(), 0600), 0);
  h.pair.set_client_token("client-key-0123456789");
  ASSERT_TRUE(h.Start({"--auth-token-file=" + h.pair.file("tokens"),
                       absl::StrCat("--chat-template=", HMOE_SOURCE_DIR,
                                    "/tests/fixtures/chat_templates/qwen3.jinja")}));
  std::string out;
  const int status =
      RunCheck(absl::StrCat(python, " ", HMOE_SOURCE_DIR,
                            "/tests/e2e/anthropic_client/check.py http://127.0.0.1:", h.port,
                            " client-key-0123456789"),
               &out);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("ok   a wrong key -> AuthenticationError"), std::string::npos) << out;
}

// Clients are told the model directory's name, never the server's path to
// it (here given with a trailing slash).
TEST(HttpApi, TheModelIsNamedByItsDirectoryNotItsPath) {
  HttpPair h;
  h.model = FortunesModel() + "/";
  ASSERT_TRUE(h.Start());
  auto c = h.Client();
  auto res = c.Get("/v1/models");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(Json::parse(res->body)["data"][0]["id"], "ds3_fortunes");
  auto info = h.pair.client().ModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->model_dir(), "ds3_fortunes");
}

}  // namespace
}  // namespace hmoe
