#include "gpu_worker/server/http_service.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/json_depth.h"
#include "gpu_worker/server/anthropic_api.h"
#include "gpu_worker/server/http_server.h"
#include "gpu_worker/server/openai_api.h"

namespace hmoe {
namespace {

using openai::Endpoint;
using openai::Error;
using openai::Json;

void SendError(HttpResponse& res, const Error& e) {
  res.status = e.http_status;
  res.content_type = "application/json";
  res.body = openai::ErrorJson(e);
}

// Whether the client has closed its end (a FIN or an error on the socket).
// A waiting client sends nothing else, so peeking consumes nothing.
bool ClientGone(int fd) {
  if (fd < 0) return false;
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// One request's events, from the engine's thread to the HTTP thread.
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<GenerateEvent> events;
  bool finished = false;  // the final event has been queued
  // Waits up to `d` for an event; takes what there is.
  std::deque<GenerateEvent> Take(absl::Duration d) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, absl::ToChronoMilliseconds(d), [&] { return !events.empty(); });
    std::deque<GenerateEvent> out;
    out.swap(events);
    return out;
  }
};

bool Failed(const GenerateEvent& ev) {
  return ev.finish == FinishReason::kCancelled || ev.finish == FinishReason::kDeadline ||
         ev.finish == FinishReason::kError;
}

Error FailureOf(const GenerateEvent& ev) {
  return openai::FromStatus(ev.status.ok() ? absl::InternalError("request failed") : ev.status);
}

// The calls a chat response returns: only the first when
// parallel_tool_calls is false (`sent` of them already sent), each with an
// id (the model's own, else "call_" + the response's id + its index).
void KeepCalls(bool parallel, int sent, const std::string& cid, std::vector<ToolCall>* calls) {
  if (!parallel) calls->resize(std::min<size_t>(calls->size(), sent > 0 ? 0 : 1));
  for (size_t i = 0; i < calls->size(); ++i) {
    ToolCall& c = (*calls)[i];
    if (c.id.empty()) c.id = absl::StrCat("call_", cid.substr(cid.find('-') + 1), "_", sent + i);
  }
}

// What one engine event adds to a streamed chat's output: its text through
// the parser, then (final event) the parser's end; the calls kept and named
// as KeepCalls does, *calls (those sent) advanced.
OutputDelta EventDelta(OutputParser& parser, const GenerateEvent& ev, bool parallel,
                       const std::string& id_base, int* calls) {
  OutputDelta d = parser.Feed(ev.text);
  if (ev.finish != FinishReason::kNone) {
    const OutputDelta end = parser.Finish();
    d.content += end.content;
    d.reasoning += end.reasoning;
    if (d.tool_calls.empty()) d.first_call_index = end.first_call_index;
    d.tool_calls.insert(d.tool_calls.end(), end.tool_calls.begin(), end.tool_calls.end());
  }
  KeepCalls(parallel, *calls, id_base, &d.tool_calls);
  *calls += static_cast<int>(d.tool_calls.size());
  return d;
}

void SendAnthropicError(HttpResponse& res, const Error& e) {
  res.status = anthropic::HttpStatus(e);
  res.content_type = "application/json";
  res.body = anthropic::ErrorJson(e);
}

// A whole response's text, parsed (after the forced prefix), its calls kept
// and named as KeepCalls does.
ParsedOutput WholeOutput(const openai::Parsed& parsed, const std::string& text,
                         const std::string& id_base) {
  OutputParser parser(parsed.output);
  parser.Feed(parsed.forced_prefix);
  parser.Feed(text);
  parser.Finish();
  ParsedOutput out = parser.result();
  KeepCalls(parsed.parallel_tool_calls, 0, id_base, &out.tool_calls);
  return out;
}

std::string SseData(const Json& j) {
  return absl::StrCat("data: ", j.dump(-1, ' ', false, Json::error_handler_t::replace), "\n\n");
}

}  // namespace

struct HttpService::Impl {
  Engine* engine = nullptr;
  const Tokenizer* tokenizer = nullptr;
  const ChatTemplate* chat = nullptr;
  std::string no_chat_template;
  HttpServiceOptions o;
  std::atomic<bool>* draining = nullptr;
  std::unique_ptr<HttpServer> server;
  int64_t created = 0;
  std::mutex id_mu;
  std::mt19937_64 id_rng{std::random_device{}()};

  std::string NewId(const char* prefix) {
    std::lock_guard<std::mutex> lock(id_mu);
    return absl::StrFormat("%s%016x%08x", prefix, id_rng(), static_cast<uint32_t>(id_rng()));
  }

  // How an endpoint family writes its errors (OpenAI's or Anthropic's shape).
  using ErrorSink = void (*)(HttpResponse&, const Error&);

  // 401 unless auth is off or the request carries a token in force, as
  // "Authorization: Bearer <token>" or (Anthropic's clients) "x-api-key".
  bool Authorized(const HttpRequest& req, HttpResponse& res, ErrorSink send = SendError) const {
    if (!o.auth_tokens || !o.auth_tokens->enabled()) return true;
    Error e;
    e.http_status = 401;
    e.type = "authentication_error";
    e.code = "invalid_api_key";
    const size_t bearers = req.HeaderCount("authorization"), keys = req.HeaderCount("x-api-key");
    if (bearers + keys != 1) {
      e.message = bearers + keys > 1
                      ? "more than one Authorization / x-api-key header"
                      : "this server requires a token: send \"Authorization: Bearer <token>\" "
                        "(or \"x-api-key: <token>\")";
      send(res, e);
      return false;
    }
    if (keys == 1) {
      if (!o.auth_tokens->Accepts(absl::StripAsciiWhitespace(req.Header("x-api-key")))) {
        e.message = "the x-api-key token is not one this server accepts";
        send(res, e);
        return false;
      }
      return true;
    }
    const std::string v = req.Header("authorization");
    const size_t space = v.find(' ');
    if (space == std::string::npos || !absl::EqualsIgnoreCase(v.substr(0, space), "bearer") ||
        !o.auth_tokens->Accepts(absl::StripAsciiWhitespace(v.substr(space + 1)))) {
      e.message = "the bearer token is not one this server accepts";
      send(res, e);
      return false;
    }
    return true;
  }

  // A generation request's way in: the token, the service up, the body's
  // nesting bounded before parsing (the tree is copied and walked
  // recursively later) and JSON. nullopt after writing the error.
  std::optional<Json> ReadBody(const HttpRequest& req, HttpResponse& res, ErrorSink send) {
    if (!Authorized(req, res, send)) return std::nullopt;
    if (draining->load() || (o.ready && !o.ready())) {
      Error e;
      e.http_status = 503;
      e.type = "service_unavailable_error";
      e.message = draining->load() ? "the worker is shutting down"
                                   : "the expert service is not serving; try again later";
      send(res, e);
      return std::nullopt;
    }
    if (absl::Status deep = CheckJsonDepth(req.body, kMaxClientJsonDepth, "the request body");
        !deep.ok()) {
      Error e;
      e.message = std::string(deep.message());
      send(res, e);
      return std::nullopt;
    }
    Json body = Json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) {
      Error e;
      e.message = "the request body is not valid JSON";
      send(res, e);
      return std::nullopt;
    }
    return body;
  }

  openai::Context ChatContext() const {
    return openai::Context{
        o.model_name,  tokenizer,        chat, no_chat_template, engine->max_context(),
        o.tool_syntax, o.split_reasoning};
  }

  // Submits the request and waits for its first event (streamed) or its
  // last (whole), watching the client: one that went away cancels it
  // (status 499, nobody reads it). False after writing the error.
  bool SubmitAndWait(GenerateRequest request, bool streamed, const HttpRequest& req,
                     HttpResponse& res, ErrorSink send, std::shared_ptr<Stream>* stream,
                     uint64_t* rid, std::deque<GenerateEvent>* got) {
    auto st = std::make_shared<Stream>();
    auto id = engine->Submit(std::move(request), [st](const GenerateEvent& ev) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->events.push_back(ev);
      if (ev.finish != FinishReason::kNone) st->finished = true;
      st->cv.notify_all();
    });
    if (!id.ok()) {
      send(res, openai::FromStatus(id.status()));
      return false;
    }
    for (;;) {
      for (GenerateEvent& ev : st->Take(o.probe_interval)) got->push_back(std::move(ev));
      const bool done = !got->empty() && got->back().finish != FinishReason::kNone;
      if (done || (streamed && !got->empty())) break;
      if (ClientGone(req.fd)) {
        engine->Cancel(*id);
        res.status = 499;
        return false;
      }
    }
    if (Failed(got->back())) {
      send(res, FailureOf(got->back()));
      return false;
    }
    *stream = std::move(st);
    *rid = *id;
    return true;
  }

  void Generate(Endpoint endpoint, const HttpRequest& req, HttpResponse& res) {
    const std::optional<Json> body = ReadBody(req, res, SendError);
    if (!body) return;
    Error perr;
    auto parsed = openai::ParseRequest(endpoint, *body, ChatContext(), &perr);
    if (!parsed.ok()) return SendError(res, perr);
    const int32_t want_lp = parsed->request.logprobs;
    std::shared_ptr<Stream> stream;
    uint64_t rid = 0;
    std::deque<GenerateEvent> got;
    if (!SubmitAndWait(std::move(parsed->request), parsed->stream, req, res, SendError, &stream,
                       &rid, &got))
      return;
    const std::string cid = NewId(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-");
    const int64_t now = absl::ToUnixSeconds(absl::Now());

    if (!parsed->stream) {
      std::string text;
      std::vector<TokenLogprob> lps;
      for (GenerateEvent& ev : got) {
        text += ev.text;
        lps.insert(lps.end(), ev.logprobs.begin(), ev.logprobs.end());
      }
      const GenerateEvent& last = got.back();
      size_t offset = 0;
      const Json lp_json = openai::LogprobsJson(endpoint, want_lp, lps, tokenizer, &offset);
      const openai::Usage usage{last.prompt_tokens, last.completion_tokens};
      Json j;
      if (endpoint == Endpoint::kChatCompletions) {
        j = openai::ChatResponse(cid, now, o.model_name, WholeOutput(*parsed, text, cid),
                                 last.finish, usage, lp_json);
      } else {
        j = openai::CompletionResponse(endpoint, cid, now, o.model_name, text, last.finish, usage,
                                       lp_json);
      }
      res.content_type = "application/json";
      res.body = j.dump(-1, ' ', false, Json::error_handler_t::replace);
      return;
    }
    struct State {
      std::deque<GenerateEvent> pending;
      bool first = true;
      bool ended = false;                  // the final event written
      size_t text_offset = 0;              // completions' logprobs.text_offset
      std::optional<OutputParser> parser;  // chat
      int calls = 0;                       // tool calls sent
    };
    auto st = std::make_shared<State>();
    st->pending = std::move(got);
    if (endpoint == Endpoint::kChatCompletions) {
      st->parser.emplace(parsed->output);
      st->parser->Feed(parsed->forced_prefix);
    }
    const bool parallel_calls = parsed->parallel_tool_calls;
    res.headers.emplace_back("Cache-Control", "no-cache");
    res.headers.emplace_back("X-Accel-Buffering", "no");
    const bool include_usage = parsed->include_usage;
    const std::string model = o.model_name;
    Engine* eng = engine;
    const absl::Duration probe = o.probe_interval;
    const Tokenizer* tok = tokenizer;
    res.content_type = "text/event-stream";
    res.stream = [=](std::string* out_text, bool* done) {
      if (st->pending.empty()) {
        st->pending = stream->Take(probe);
        // Nothing new: a comment line, so a client that left is noticed.
        if (st->pending.empty()) {
          *out_text = ":\n\n";
          return true;
        }
      }
      std::string& out = *out_text;
      for (const GenerateEvent& ev : st->pending) {
        if (Failed(ev)) {
          // Mid-stream the status is sent: the error goes as an event.
          out += absl::StrCat("data: ", openai::ErrorJson(FailureOf(ev)), "\n\n");
          out += "data: [DONE]\n\n";
          st->ended = true;
          break;
        }
        const bool has_lp = want_lp >= 0 && !ev.logprobs.empty();
        if (st->parser) {
          // Chat: what the parser makes of the text so far (held back:
          // what may still be a marker), then the finish.
          const OutputDelta d = EventDelta(*st->parser, ev, parallel_calls, cid, &st->calls);
          if (!d.empty() || st->first || has_lp) {
            out += SseData(openai::ChatDeltaChunk(
                cid, now, model, d, st->first,
                has_lp ? openai::LogprobsJson(endpoint, want_lp, ev.logprobs, tok, &st->text_offset)
                       : Json(nullptr)));
            st->first = false;
          }
          if (ev.finish != FinishReason::kNone)
            out += SseData(openai::ChatFinishChunk(cid, now, model, ev.finish, st->calls > 0));
        } else if (!ev.text.empty() || st->first || has_lp || ev.finish != FinishReason::kNone) {
          // The text (or the role, first; with the tokens' logprobs)
          // and the finish reason go in separate chunks, as OpenAI's
          // servers send them.
          if (!ev.text.empty() || st->first || has_lp) {
            out += SseData(openai::StreamChunk(
                endpoint, cid, now, model, ev.text, st->first, FinishReason::kNone,
                has_lp ? openai::LogprobsJson(endpoint, want_lp, ev.logprobs, tok, &st->text_offset)
                       : Json(nullptr)));
            st->first = false;
          }
          if (ev.finish != FinishReason::kNone)
            out += SseData(openai::StreamChunk(endpoint, cid, now, model, "", false, ev.finish));
        }
        if (ev.finish != FinishReason::kNone) {
          if (include_usage) {
            out += SseData(openai::UsageChunk(endpoint, cid, now, model,
                                              {ev.prompt_tokens, ev.completion_tokens}));
          }
          out += "data: [DONE]\n\n";
          st->ended = true;
          break;
        }
      }
      st->pending.clear();
      *done = st->ended;
      return true;
    };
    res.on_stream_end = [eng, rid, st](bool) {
      if (!st->ended) eng->Cancel(rid);  // the client went away mid-stream
    };
  }

  // POST /v1/messages (anthropic_api.h): the body as a chat request, its
  // output as a message or as Anthropic's stream events.
  void Messages(const HttpRequest& req, HttpResponse& res) {
    const std::optional<Json> body = ReadBody(req, res, SendAnthropicError);
    if (!body) return;
    Error perr;
    auto chat_body = anthropic::ToChatBody(*body, /*count_only=*/false, &perr);
    if (!chat_body.ok()) return SendAnthropicError(res, perr);
    auto parsed =
        openai::ParseRequest(Endpoint::kChatCompletions, *chat_body, ChatContext(), &perr);
    if (!parsed.ok()) return SendAnthropicError(res, perr);
    const int64_t input_tokens = static_cast<int64_t>(parsed->request.prompt.size());
    std::shared_ptr<Stream> stream;
    uint64_t rid = 0;
    std::deque<GenerateEvent> got;
    if (!SubmitAndWait(std::move(parsed->request), parsed->stream, req, res, SendAnthropicError,
                       &stream, &rid, &got))
      return;
    const std::string mid = NewId("msg_");
    if (!parsed->stream) {
      std::string text;
      for (const GenerateEvent& ev : got) text += ev.text;
      const ParsedOutput out = WholeOutput(*parsed, text, NewId("toolu-"));
      const GenerateEvent& last = got.back();
      res.content_type = "application/json";
      res.body = anthropic::MessageJson(mid, o.model_name, out, last.finish, last.stop_string,
                                        input_tokens, last.completion_tokens)
                     .dump(-1, ' ', false, Json::error_handler_t::replace);
      return;
    }
    struct State {
      std::deque<GenerateEvent> pending;
      OutputParser parser;
      anthropic::StreamWriter writer;
      std::string call_ids;  // tool-call ids are made from it
      int calls = 0;
      bool started = false, ended = false;
    };
    auto st =
        std::make_shared<State>(State{std::move(got), OutputParser(parsed->output),
                                      anthropic::StreamWriter(mid, o.model_name), NewId("toolu-")});
    st->parser.Feed(parsed->forced_prefix);
    const bool parallel_calls = parsed->parallel_tool_calls;
    const absl::Duration probe = o.probe_interval;
    res.headers.emplace_back("Cache-Control", "no-cache");
    res.headers.emplace_back("X-Accel-Buffering", "no");
    res.content_type = "text/event-stream";
    res.stream = [st, stream, probe, parallel_calls, input_tokens](std::string* out, bool* done) {
      if (!st->started) {
        *out += st->writer.Start(input_tokens);
        st->started = true;
      }
      if (st->pending.empty()) {
        st->pending = stream->Take(probe);
        // Nothing new: a ping, so a client that left is noticed.
        if (st->pending.empty()) {
          *out += anthropic::Event("ping", Json{{"type", "ping"}});
          return true;
        }
      }
      for (const GenerateEvent& ev : st->pending) {
        if (Failed(ev)) {
          const Error e = FailureOf(ev);
          *out += absl::StrCat("event: error\ndata: ", anthropic::ErrorJson(e), "\n\n");
          st->ended = true;
          break;
        }
        *out +=
            st->writer.Delta(EventDelta(st->parser, ev, parallel_calls, st->call_ids, &st->calls));
        if (ev.finish != FinishReason::kNone) {
          *out += st->writer.Finish(ev.finish, ev.stop_string, ev.completion_tokens);
          st->ended = true;
          break;
        }
      }
      st->pending.clear();
      *done = st->ended;
      return true;
    };
    Engine* eng = engine;
    res.on_stream_end = [eng, rid, st](bool) {
      if (!st->ended) eng->Cancel(rid);  // the client went away mid-stream
    };
  }

  // POST /v1/messages/count_tokens: the prompt's tokens as rendered.
  void CountTokens(const HttpRequest& req, HttpResponse& res) {
    const std::optional<Json> body = ReadBody(req, res, SendAnthropicError);
    if (!body) return;
    Error perr;
    auto chat_body = anthropic::ToChatBody(*body, /*count_only=*/true, &perr);
    if (!chat_body.ok()) return SendAnthropicError(res, perr);
    (*chat_body).erase("stream");
    auto parsed =
        openai::ParseRequest(Endpoint::kChatCompletions, *chat_body, ChatContext(), &perr);
    if (!parsed.ok()) return SendAnthropicError(res, perr);
    res.content_type = "application/json";
    res.body = Json{{"input_tokens", parsed->request.prompt.size()}}.dump();
  }
};

absl::StatusOr<std::unique_ptr<HttpService>> HttpService::Start(Engine* engine,
                                                                const Tokenizer* tokenizer,
                                                                const ChatTemplate* chat,
                                                                std::string no_chat_template,
                                                                HttpServiceOptions options) {
  const size_t colon = options.listen.rfind(':');
  int port = -1;
  std::string host = colon == std::string::npos ? "" : options.listen.substr(0, colon);
  if (!host.empty() && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (colon == std::string::npos || !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535 || host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-listen: expected HOST:PORT, got \"", options.listen, "\""));
  }
  std::unique_ptr<HttpService> s(new HttpService());
  s->impl_ = std::make_unique<Impl>();
  Impl* impl = s->impl_.get();
  impl->engine = engine;
  impl->tokenizer = tokenizer;
  impl->chat = chat;
  impl->no_chat_template = std::move(no_chat_template);
  impl->o = std::move(options);
  impl->draining = &s->draining_;
  impl->created = absl::ToUnixSeconds(absl::Now());
  HttpServerOptions so;
  so.host = host;
  so.port = port;
  so.tls = impl->o.tls;
  so.max_body_bytes = impl->o.max_body_bytes;
  so.max_connections = impl->o.max_connections;
  so.header_timeout = impl->o.header_timeout;
  so.idle_timeout = impl->o.idle_timeout;
  so.io_timeout = impl->o.io_timeout;
  std::vector<std::string> routes = {
      "POST /v1/chat/completions",      "POST /v1/completions", "POST /v1/messages",
      "POST /v1/messages/count_tokens", "GET /v1/models",       "GET /health"};
  if (impl->o.metrics) routes.push_back("GET /metrics");
  auto handler = [impl](const HttpRequest& q, HttpResponse& r) {
    if (q.path == "/v1/chat/completions") return impl->Generate(Endpoint::kChatCompletions, q, r);
    if (q.path == "/v1/completions") return impl->Generate(Endpoint::kCompletions, q, r);
    if (q.path == "/v1/messages") return impl->Messages(q, r);
    if (q.path == "/v1/messages/count_tokens") return impl->CountTokens(q, r);
    if (q.path == "/health") {
      const bool up = !impl->draining->load() && (!impl->o.ready || impl->o.ready());
      r.status = up ? 200 : 503;
      r.content_type = "application/json";
      r.body = up ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}";
      return;
    }
    if (!impl->Authorized(q, r)) return;
    r.content_type = "application/json";
    if (q.path == "/v1/models") {
      r.body =
          openai::ModelsList(impl->o.model_name, impl->created, impl->engine->max_context()).dump();
    } else {  // /metrics
      r.content_type = "text/plain; version=0.0.4; charset=utf-8";
      r.body = impl->o.metrics();
    }
  };
  // The server's own refusals (unknown path, body too large, bad framing,
  // too many connections) in OpenAI's error form.
  auto error_body = [](const HttpRequest&, const std::string& message, HttpResponse& r) {
    Error e;
    e.http_status = r.status;
    e.message = message;
    if (r.status == 413) e.code = "request_too_large";
    if (r.status == 503)
      e.type = "service_unavailable_error";
    else if (r.status >= 500)
      e.type = "server_error";
    SendError(r, e);
  };
  auto server = HttpServer::Start(std::move(so), std::move(routes), handler, error_body);
  if (!server.ok()) return server.status();
  impl->server = std::move(*server);
  s->port_ = impl->server->port();
  return s;
}

void HttpService::Stop() {
  if (impl_ && impl_->server) impl_->server->Stop();
}

HttpService::~HttpService() { Stop(); }

}  // namespace hmoe
