// The worker's request front ends in process, on the fortunes fixture (its
// tokenizer and chat template) with the in-process experts: what hostile
// input gets over HTTP (HttpService, through a raw TCP client) and over gRPC
// (GenerationService's request building).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <csignal>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/json_depth.h"
#include "common/status.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "common/text/tool_calls.h"
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
  void StartHttp(const ChatTemplate* chat = nullptr, HttpServiceOptions o = {}) {
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

// The fortunes model, made to write `script` (token ids, then its eos)
// whatever the prompt: each pass runs the model, then each sequence's
// logits are replaced by a one-hot of its next scripted token (greedy
// sampling takes it).
class ScriptedModel final : public Model {
 public:
  ScriptedModel(const Model* inner, std::vector<int32_t> script)
      : inner_(inner), script_(std::move(script)) {
    script_.push_back(static_cast<int32_t>(inner->config().eos_token_ids.at(0)));
  }
  const ModelConfig& config() const override { return inner_->config(); }
  const ModelOptions& options() const override { return inner_->options(); }
  std::unique_ptr<Sequence> NewSequence() const override { return inner_->NewSequence(); }
  absl::Status ForwardBatch(absl::Span<const ForwardStep> steps) const override {
    RETURN_IF_ERROR(inner_->ForwardBatch(steps));
    std::lock_guard<std::mutex> lock(mu_);
    for (const ForwardStep& st : steps) {
      if (st.logits == nullptr || st.logits->empty()) continue;
      // A new sequence's first pass is its prompt (the sequence is as long
      // as the tokens it was given).
      size_t& at = next_[st.seq];
      if (st.seq->length() == static_cast<int64_t>(st.tokens.size())) at = 0;
      const int32_t want = script_[std::min(at++, script_.size() - 1)];
      std::fill(st.logits->begin(), st.logits->end(), -30.0f);
      (*st.logits)[st.logits->size() - config().vocab_size + want] = 30.0f;
    }
    return absl::OkStatus();
  }

 private:
  const Model* inner_;
  std::vector<int32_t> script_;
  mutable std::mutex mu_;
  mutable std::map<const Sequence*, size_t> next_;
};

// The data: payloads of an SSE body.
std::vector<Json> SseChunks(const std::string& body) {
  std::vector<Json> out;
  for (absl::string_view line : absl::StrSplit(body, '\n'))
    if (absl::ConsumePrefix(&line, "data: ") && line != "[DONE]")
      out.push_back(Json::parse(line.begin(), line.end()));
  return out;
}

class ChatToolCalls : public HttpApiInProcess {
 protected:
  // Serves the fortunes model scripted to write `text`, its output parsed
  // as the qwen3 syntax with reasoning split.
  void Serve(const std::string& text) {
    auto ids = tokenizer_->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    scripted_ = std::make_unique<ScriptedModel>(model_, *ids);
    http_.reset();
    auto e = Engine::Create(scripted_.get(), tokenizer_, {});
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    HttpServiceOptions o;
    o.tool_syntax = ToolSyntax::kQwen3;
    o.split_reasoning = true;
    ASSERT_NO_FATAL_FAILURE(StartHttp(nullptr, o));
  }
  // The message of a whole response, and the same request streamed with
  // its chunks' deltas joined into one message.
  void Both(Json req, Json* whole, Json* streamed, std::vector<Json>* chunks) {
    req["temperature"] = 0;
    RawResponse w = Post("/v1/chat/completions", req.dump());
    ASSERT_EQ(w.status, 200) << w.body;
    *whole = Json::parse(w.body);
    req["stream"] = true;
    RawResponse s = Post("/v1/chat/completions", req.dump());
    ASSERT_EQ(s.status, 200) << s.body;
    *chunks = SseChunks(s.body);
    Json m = {{"role", nullptr}, {"content", ""}, {"reasoning_content", ""}};
    Json calls = Json::array();
    for (const Json& c : *chunks) {
      const Json& d = c["choices"][0]["delta"];
      if (d.contains("role")) m["role"] = d["role"];
      if (d.contains("content"))
        m["content"] = m["content"].get<std::string>() + d["content"].get<std::string>();
      if (d.contains("reasoning_content"))
        m["reasoning_content"] =
            m["reasoning_content"].get<std::string>() + d["reasoning_content"].get<std::string>();
      if (d.contains("tool_calls"))
        for (const Json& tc : d["tool_calls"]) {
          EXPECT_EQ(tc["index"], calls.size());
          Json t = tc;
          t.erase("index");
          calls.push_back(t);
        }
      if (!c["choices"][0]["finish_reason"].is_null())
        m["finish_reason"] = c["choices"][0]["finish_reason"];
    }
    if (!calls.empty()) m["tool_calls"] = calls;
    *streamed = m;
  }
  std::unique_ptr<ScriptedModel> scripted_;
};

const Json kTools = Json::parse(R"([{"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
    "properties": {}}}}])");

// Reasoning, text and two calls in the model's syntax: reasoning_content,
// content and tool_calls (ids, type, name, arguments as a JSON string),
// finish_reason "tool_calls"; streamed, the same pieces as deltas with
// indexes, the role first and the finish last.
TEST_F(ChatToolCalls, CallsAndReasoningWholeAndStreamed) {
  ASSERT_NO_FATAL_FAILURE(
      Serve("<think>\nParis, then the time.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": "
            "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n"
            "{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));
  Json whole, streamed;
  std::vector<Json> chunks;
  ASSERT_NO_FATAL_FAILURE(
      Both({{"messages", {{{"role", "user"}, {"content", "Weather and time in Paris?"}}}},
            {"tools", kTools}},
           &whole, &streamed, &chunks));
  const Json& choice = whole["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const Json& m = choice["message"];
  EXPECT_EQ(m["reasoning_content"], "\nParis, then the time.\n");
  EXPECT_EQ(m["content"], "Checking.\n");
  ASSERT_EQ(m["tool_calls"].size(), 2u) << m.dump();
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            Json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(m["tool_calls"][1]["function"]["name"], "get_time");
  EXPECT_NE(m["tool_calls"][0]["id"], m["tool_calls"][1]["id"]);
  EXPECT_TRUE(absl::StartsWith(m["tool_calls"][0]["id"].get<std::string>(), "call_"));
  // Streamed: the same message (ids are per response).
  EXPECT_EQ(streamed["role"], "assistant");
  EXPECT_EQ(streamed["reasoning_content"], m["reasoning_content"]);
  EXPECT_EQ(streamed["content"], m["content"]);
  EXPECT_EQ(streamed["finish_reason"], "tool_calls");
  ASSERT_EQ(streamed["tool_calls"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(streamed["tool_calls"][i]["function"], m["tool_calls"][i]["function"]);
    EXPECT_EQ(streamed["tool_calls"][i]["type"], "function");
  }
  // The first chunk carries the role; only the last carries the finish.
  ASSERT_GE(chunks.size(), 3u);
  EXPECT_EQ(chunks.front()["choices"][0]["delta"]["role"], "assistant");
  for (size_t i = 0; i + 1 < chunks.size(); ++i)
    EXPECT_TRUE(chunks[i]["choices"][0]["finish_reason"].is_null()) << i;
  // parallel_tool_calls false: the first call only.
  RawResponse one =
      Post("/v1/chat/completions", Json({{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                         {"tools", kTools},
                                         {"parallel_tool_calls", false}})
                                       .dump());
  ASSERT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(Json::parse(one.body)["choices"][0]["message"]["tool_calls"].size(), 1u);
  // tool_choice "none": the same text is content (the tools are not offered).
  RawResponse none =
      Post("/v1/chat/completions", Json({{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                         {"tools", kTools},
                                         {"tool_choice", "none"}})
                                       .dump());
  ASSERT_EQ(none.status, 200) << none.body;
  const Json nm = Json::parse(none.body)["choices"][0];
  EXPECT_FALSE(nm["message"].contains("tool_calls"));
  EXPECT_THAT(nm["message"]["content"].get<std::string>(), HasSubstr("<tool_call>"));
  EXPECT_EQ(nm["finish_reason"], "stop");
}

// A named function: the prompt ends inside its call (the qwen3 prefix), the
// model writes the arguments, and the response is that call.
TEST_F(ChatToolCalls, ANamedFunctionIsCalled) {
  ASSERT_NO_FATAL_FAILURE(Serve("{\"city\": \"Oslo\"}}\n</tool_call>"));
  Json whole, streamed;
  std::vector<Json> chunks;
  ASSERT_NO_FATAL_FAILURE(
      Both({{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
            {"tools", kTools},
            {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}},
           &whole, &streamed, &chunks));
  const Json& m = whole["choices"][0]["message"];
  EXPECT_TRUE(m["content"].is_null()) << m.dump();
  ASSERT_EQ(m["tool_calls"].size(), 1u) << m.dump();
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            Json::parse(R"({"city": "Oslo"})"));
  EXPECT_EQ(streamed["tool_calls"][0]["function"], m["tool_calls"][0]["function"]);
}

// Malformed output in the syntax stays content; bad tool_choice is 400
// naming it.
TEST_F(ChatToolCalls, MalformedCallsAreContentAndBadChoicesAre400) {
  const std::string bad = "Here: <tool_call>\n{\"name\": \"get_weather\", oops}\n</tool_call>";
  ASSERT_NO_FATAL_FAILURE(Serve(bad));
  Json whole, streamed;
  std::vector<Json> chunks;
  ASSERT_NO_FATAL_FAILURE(
      Both({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", kTools}}, &whole,
           &streamed, &chunks));
  EXPECT_EQ(whole["choices"][0]["message"]["content"], bad);
  EXPECT_FALSE(whole["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(streamed["content"], bad);
  struct Case {
    Json choice;
    bool with_tools;
    const char* says;
  };
  const Case cases[] = {
      {"sometimes", true, "tool_choice: \"none\", \"auto\""},
      {"required", false, "tool_choice: needs tools"},
      {{{"type", "function"}, {"function", {{"name", "nope"}}}}, true, "no tool named \"nope\""},
      {{{"type", "function"}}, true, "tool_choice: \"none\""},
  };
  for (const Case& c : cases) {
    Json req = {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tool_choice", c.choice}};
    if (c.with_tools) req["tools"] = kTools;
    RawResponse r = Post("/v1/chat/completions", req.dump());
    EXPECT_EQ(r.status, 400) << r.body;
    const Json e = Json::parse(r.body)["error"];
    EXPECT_THAT(e["message"].get<std::string>(), HasSubstr(c.says));
    EXPECT_EQ(e["param"], "tool_choice");
  }
  RawResponse t =
      Post("/v1/chat/completions",
           R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})");
  EXPECT_EQ(t.status, 400) << t.body;
  EXPECT_EQ(Json::parse(t.body)["error"]["param"], "tools[0]");
}

// Without a syntax (the fortunes template writes none), "required" is
// refused: the server could not read the call.
TEST_F(HttpApiInProcess, RequiredToolChoiceNeedsASyntax) {
  ASSERT_NO_FATAL_FAILURE(StartHttp());
  RawResponse r =
      Post("/v1/chat/completions", Json({{"messages", {{{"role", "user"}, {"content", "x"}}}},
                                         {"tools", kTools},
                                         {"tool_choice", "required"}})
                                       .dump());
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_THAT(r.body, HasSubstr("--tool-call-syntax"));
}

// The Anthropic Messages API over the same scripted output: thinking, text
// and tool_use blocks, stop_reason tool_use, usage; streamed, the
// documented event order with the same blocks; count_tokens the same
// input_tokens.
TEST_F(ChatToolCalls, AnthropicMessagesWholeAndStreamed) {
  ASSERT_NO_FATAL_FAILURE(
      Serve("<think>\nParis.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", "
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
  const Json req = Json::parse(R"({"model": "claude-any", "max_tokens": 300, "temperature": 0,
      "system": [{"type": "text", "text": "Be brief."}],
      "messages": [{"role": "user", "content": "Weather in Paris?"}],
      "tools": [{"name": "get_weather", "description": "Weather.", "input_schema":
        {"type": "object", "properties": {"city": {"type": "string"}}}}]})");
  RawResponse w = Post("/v1/messages", req.dump());
  ASSERT_EQ(w.status, 200) << w.body;
  const Json m = Json::parse(w.body);
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_TRUE(absl::StartsWith(m["id"].get<std::string>(), "msg_"));
  EXPECT_EQ(m["stop_reason"], "tool_use");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  ASSERT_EQ(m["content"].size(), 3u) << m.dump();
  EXPECT_EQ(m["content"][0], Json::parse(R"({"type": "thinking", "thinking": "\nParis.\n",
                                            "signature": ""})"));
  EXPECT_EQ(m["content"][1], Json::parse(R"({"type": "text", "text": "Checking.\n"})"));
  EXPECT_EQ(m["content"][2]["type"], "tool_use");
  EXPECT_EQ(m["content"][2]["name"], "get_weather");
  EXPECT_EQ(m["content"][2]["input"], Json::parse(R"({"city": "Paris"})"));
  const int64_t input_tokens = m["usage"]["input_tokens"].get<int64_t>();
  EXPECT_GT(input_tokens, 0);
  EXPECT_GT(m["usage"]["output_tokens"].get<int64_t>(), 0);

  Json sreq = req;
  sreq["stream"] = true;
  RawResponse s = Post("/v1/messages", sreq.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  std::vector<std::string> names;
  std::vector<Json> data;
  for (absl::string_view line : absl::StrSplit(s.body, '\n')) {
    if (absl::ConsumePrefix(&line, "event: ")) names.emplace_back(line);
    if (absl::ConsumePrefix(&line, "data: ")) data.push_back(Json::parse(line.begin(), line.end()));
  }
  ASSERT_EQ(names.size(), data.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(data[i]["type"], names[i]) << i;
  // The order: message_start, ping, then thinking, text, tool_use blocks
  // (each start, deltas, stop), message_delta, message_stop.
  std::vector<std::string> compact;
  for (const std::string& n : names)
    if (n != "ping" && (compact.empty() || n != "content_block_delta" || compact.back() != n))
      compact.push_back(n);
  EXPECT_EQ(compact, (std::vector<std::string>{
                         "message_start", "content_block_start", "content_block_delta",
                         "content_block_stop", "content_block_start", "content_block_delta",
                         "content_block_stop", "content_block_start", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"}));
  EXPECT_EQ(names[1], "ping");
  EXPECT_EQ(data[0]["message"]["usage"]["input_tokens"], input_tokens);
  // Joined, the blocks are the whole response's.
  Json blocks = Json::array();
  for (const Json& d : data) {
    if (d["type"] == "content_block_start") {
      EXPECT_EQ(d["index"], blocks.size());
      blocks.push_back(d["content_block"]);
    } else if (d["type"] == "content_block_delta") {
      Json& b = blocks[d["index"].get<size_t>()];
      const Json& dl = d["delta"];
      if (dl["type"] == "text_delta")
        b["text"] = b["text"].get<std::string>() + dl["text"].get<std::string>();
      if (dl["type"] == "thinking_delta")
        b["thinking"] = b["thinking"].get<std::string>() + dl["thinking"].get<std::string>();
      if (dl["type"] == "input_json_delta")
        b["input"] = Json::parse(dl["partial_json"].get<std::string>());
    }
  }
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(blocks[0], m["content"][0]);
  EXPECT_EQ(blocks[1], m["content"][1]);
  EXPECT_EQ(blocks[2]["input"], m["content"][2]["input"]);
  EXPECT_EQ(data[data.size() - 2]["delta"]["stop_reason"], "tool_use");

  RawResponse c = Post("/v1/messages/count_tokens", req.dump());
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(Json::parse(c.body)["input_tokens"], input_tokens);
}

// A stop sequence ends the message with stop_reason stop_sequence and the
// sequence; bad requests are Anthropic's errors naming the field.
TEST_F(ChatToolCalls, AnthropicStopSequencesAndErrors) {
  ASSERT_NO_FATAL_FAILURE(Serve("One two three four."));
  RawResponse r = Post("/v1/messages", R"({"model": "m", "max_tokens": 20, "temperature": 0,
      "stop_sequences": ["three", "zzz"], "messages": [{"role": "user", "content": "Count"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  const Json m = Json::parse(r.body);
  EXPECT_EQ(m["stop_reason"], "stop_sequence");
  EXPECT_EQ(m["stop_sequence"], "three");
  EXPECT_EQ(m["content"][0]["text"], "One two ");
  struct Case {
    std::string body;
    const char* says;
  };
  const Case cases[] = {
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}]})", "max_tokens: required"},
      {R"({"model": "m", "max_tokens": 5, "messages": []})", "messages: expected a non-empty"},
      {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type":
          "image", "source": {}}]}]})",
       "messages[0].content[0]: image blocks are not supported"},
      {R"({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]})",
       "messages[0].role"},
      {R"({"model": "m", "max_tokens": 5, "temperature": 9, "messages": [{"role": "user",
          "content": "x"}]})",
       "temperature"},
      {R"({"model": "m", "max_tokens": 5, "tool_choice": {"type": "maybe"}, "messages":
          [{"role": "user", "content": "x"}]})",
       "tool_choice"},
  };
  for (const Case& c : cases) {
    RawResponse e = Post("/v1/messages", c.body);
    EXPECT_EQ(e.status, 400) << e.body;
    const Json j = Json::parse(e.body);
    EXPECT_EQ(j["type"], "error");
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.says));
  }
}

}  // namespace
}  // namespace hmoe
