#include "gpu_worker/server/http_service.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gpu_worker/server/openai_api.h"

namespace hmoe {
namespace {

using openai::Endpoint;
using openai::Error;
using openai::Json;

void SendError(httplib::Response& res, const Error& e) {
  res.status = e.http_status;
  res.set_content(openai::ErrorJson(e), "application/json");
}

// The connection's socket, to see whether the client is still there while
// a request waits (cpp-httplib 0.11 gives handlers no socket): the TLS
// session's, or the one fd of this process whose local and peer addresses
// are the request's. -1 when not found.
int ConnectionFd(const httplib::Request& req) {
  if (req.ssl != nullptr) return SSL_get_fd(req.ssl);
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int found = -1;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    sockaddr_storage peer{}, local{};
    socklen_t pl = sizeof(peer), ll = sizeof(local);
    if (::getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
        ::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &ll) != 0)
      continue;
    auto port_of = [](const sockaddr_storage& a) {
      return a.ss_family == AF_INET ? ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port)
                                    : ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    };
    if (port_of(peer) != req.remote_port || port_of(local) != req.local_port) continue;
    char host[INET6_ADDRSTRLEN] = {};
    const void* addr =
        peer.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in&>(peer).sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6&>(peer).sin6_addr);
    if (::inet_ntop(peer.ss_family, addr, host, sizeof(host)) == nullptr) continue;
    if (req.remote_addr == host) {
      found = static_cast<int>(fd);
      break;
    }
  }
  ::closedir(d);
  return found;
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
  std::unique_ptr<httplib::Server> server;
  std::thread thread;
  int64_t created = 0;
  std::mutex id_mu;
  std::mt19937_64 id_rng{std::random_device{}()};

  std::string NewId(const char* prefix) {
    std::lock_guard<std::mutex> lock(id_mu);
    return absl::StrFormat("%s%016x%08x", prefix, id_rng(), static_cast<uint32_t>(id_rng()));
  }

  // 401 unless auth is off or the request carries a token in force.
  bool Authorized(const httplib::Request& req, httplib::Response& res) const {
    if (!o.auth_tokens || !o.auth_tokens->enabled()) return true;
    Error e;
    e.http_status = 401;
    e.type = "authentication_error";
    e.code = "invalid_api_key";
    if (req.get_header_value_count("Authorization") != 1) {
      e.message = req.has_header("Authorization")
                      ? "more than one Authorization header"
                      : "this server requires a token: send \"Authorization: Bearer <token>\"";
      SendError(res, e);
      return false;
    }
    const std::string v = req.get_header_value("Authorization");
    const size_t space = v.find(' ');
    if (space == std::string::npos || !absl::EqualsIgnoreCase(v.substr(0, space), "bearer") ||
        !o.auth_tokens->Accepts(absl::StripAsciiWhitespace(v.substr(space + 1)))) {
      e.message = "the bearer token is not one this server accepts";
      SendError(res, e);
      return false;
    }
    return true;
  }

  void Generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    if (draining->load() || (o.ready && !o.ready())) {
      Error e;
      e.http_status = 503;
      e.type = "service_unavailable_error";
      e.message = draining->load() ? "the worker is shutting down"
                                   : "the expert service is not serving; try again later";
      return SendError(res, e);
    }
    const Json body = Json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) {
      Error e;
      e.message = "the request body is not valid JSON";
      return SendError(res, e);
    }
    openai::Context ctx{o.model_name, tokenizer, chat, no_chat_template, engine->max_context()};
    Error perr;
    auto parsed = openai::ParseRequest(endpoint, body, ctx, &perr);
    if (!parsed.ok()) return SendError(res, perr);
    auto stream = std::make_shared<Stream>();
    const int32_t want_lp = parsed->request.logprobs;
    auto id = engine->Submit(std::move(parsed->request), [stream](const GenerateEvent& ev) {
      std::lock_guard<std::mutex> lock(stream->mu);
      stream->events.push_back(ev);
      if (ev.finish != FinishReason::kNone) stream->finished = true;
      stream->cv.notify_all();
    });
    if (!id.ok()) return SendError(res, openai::FromStatus(id.status()));
    const uint64_t rid = *id;
    const std::string cid = NewId(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-");
    const int64_t now = absl::ToUnixSeconds(absl::Now());

    // Wait for the first event (streamed) or the last (whole), watching the
    // client: one that went away cancels the request.
    std::deque<GenerateEvent> got;
    int fd = -2;  // looked up once the wait is long enough to need it
    for (;;) {
      for (GenerateEvent& ev : stream->Take(o.probe_interval)) got.push_back(std::move(ev));
      const bool done = !got.empty() && got.back().finish != FinishReason::kNone;
      if (done || (parsed->stream && !got.empty())) break;
      if (fd == -2) fd = ConnectionFd(req);
      if (ClientGone(fd)) {
        engine->Cancel(rid);
        res.status = 499;  // nobody reads it
        return;
      }
    }
    if (Failed(got.back())) return SendError(res, FailureOf(got.back()));

    if (!parsed->stream) {
      std::string text;
      std::vector<TokenLogprob> lps;
      for (GenerateEvent& ev : got) {
        text += ev.text;
        lps.insert(lps.end(), ev.logprobs.begin(), ev.logprobs.end());
      }
      const GenerateEvent& last = got.back();
      size_t offset = 0;
      const Json j = openai::CompletionResponse(
          endpoint, cid, now, o.model_name, text, last.finish,
          {last.prompt_tokens, last.completion_tokens},
          openai::LogprobsJson(endpoint, want_lp, lps, tokenizer, &offset));
      res.set_content(j.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
      return;
    }
    struct State {
      std::deque<GenerateEvent> pending;
      bool first = true;
      bool ended = false;      // the final event written
      size_t text_offset = 0;  // completions' logprobs.text_offset
    };
    auto st = std::make_shared<State>();
    st->pending = std::move(got);
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    const bool include_usage = parsed->include_usage;
    const std::string model = o.model_name;
    Engine* eng = engine;
    const absl::Duration probe = o.probe_interval;
    const Tokenizer* tok = tokenizer;
    res.set_chunked_content_provider(
        "text/event-stream",
        [=](size_t, httplib::DataSink& sink) {
          if (st->pending.empty()) {
            st->pending = stream->Take(probe);
            // Nothing new: a comment line, so a client that left is noticed.
            if (st->pending.empty()) return sink.write(":\n\n", 3);
          }
          std::string out;
          for (const GenerateEvent& ev : st->pending) {
            if (Failed(ev)) {
              // Mid-stream the status is sent: the error goes as an event.
              out += absl::StrCat("data: ", openai::ErrorJson(FailureOf(ev)), "\n\n");
              out += "data: [DONE]\n\n";
              st->ended = true;
              break;
            }
            const bool has_lp = want_lp >= 0 && !ev.logprobs.empty();
            if (!ev.text.empty() || st->first || has_lp || ev.finish != FinishReason::kNone) {
              // The text (or the role, first; with the tokens' logprobs)
              // and the finish reason go in separate chunks, as OpenAI's
              // servers send them.
              if (!ev.text.empty() || st->first || has_lp) {
                out += SseData(openai::StreamChunk(
                    endpoint, cid, now, model, ev.text, st->first, FinishReason::kNone,
                    has_lp ? openai::LogprobsJson(endpoint, want_lp, ev.logprobs, tok,
                                                  &st->text_offset)
                           : Json(nullptr)));
                st->first = false;
              }
              if (ev.finish != FinishReason::kNone)
                out +=
                    SseData(openai::StreamChunk(endpoint, cid, now, model, "", false, ev.finish));
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
          // Events without text (a skipped special token) write nothing:
          // an empty write would end cpp-httplib's chunked body unfinished.
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (st->ended) sink.done();
          return true;
        },
        [eng, rid, st](bool) {
          if (!st->ended) eng->Cancel(rid);  // the client went away mid-stream
        });
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
  if (impl->o.tls.enabled()) {
    if (impl->o.tls.cert_file.empty() || impl->o.tls.key_file.empty())
      return absl::InvalidArgumentError("HTTPS needs both --tls-cert-file and --tls-key-file");
    auto ssl = std::make_unique<httplib::SSLServer>(
        impl->o.tls.cert_file.c_str(), impl->o.tls.key_file.c_str(),
        impl->o.tls.client_ca_file.empty() ? nullptr : impl->o.tls.client_ca_file.c_str());
    if (!ssl->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "HTTPS: cannot use the certificate ", impl->o.tls.cert_file, " / key ",
          impl->o.tls.key_file, impl->o.tls.client_ca_file.empty() ? "" : " / client CA ",
          impl->o.tls.client_ca_file));
    }
    impl->server = std::move(ssl);
  } else {
    impl->server = std::make_unique<httplib::Server>();
  }
  httplib::Server& svr = *impl->server;
  const int threads = std::max(impl->o.threads, 2);
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  svr.set_payload_max_length(impl->o.max_body_bytes);
  svr.Post("/v1/chat/completions", [impl](const httplib::Request& q, httplib::Response& r) {
    impl->Generate(Endpoint::kChatCompletions, q, r);
  });
  svr.Post("/v1/completions", [impl](const httplib::Request& q, httplib::Response& r) {
    impl->Generate(Endpoint::kCompletions, q, r);
  });
  svr.Get("/v1/models", [impl](const httplib::Request& q, httplib::Response& r) {
    if (!impl->Authorized(q, r)) return;
    r.set_content(
        openai::ModelsList(impl->o.model_name, impl->created, impl->engine->max_context()).dump(),
        "application/json");
  });
  svr.Get("/health", [impl](const httplib::Request&, httplib::Response& r) {
    const bool up = !impl->draining->load() && (!impl->o.ready || impl->o.ready());
    r.status = up ? 200 : 503;
    r.set_content(up ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}", "application/json");
  });
  if (impl->o.metrics) {
    svr.Get("/metrics", [impl](const httplib::Request& q, httplib::Response& r) {
      if (!impl->Authorized(q, r)) return;
      r.set_content(impl->o.metrics(), "text/plain; version=0.0.4; charset=utf-8");
    });
  }
  // httplib's own refusals (unknown path, body too large, bad framing) in
  // OpenAI's error form.
  svr.set_error_handler([impl](const httplib::Request& q, httplib::Response& r) {
    if (!r.body.empty()) return;
    Error e;
    e.http_status = r.status;
    if (r.status == 404) {
      e.message = absl::StrCat("no route ", q.method, " ", q.path);
    } else if (r.status == 413) {
      e.message = absl::StrCat("the request body is over ", impl->o.max_body_bytes, " bytes");
      e.code = "request_too_large";
    } else if (r.status == 405) {
      e.message = absl::StrCat(q.method, " is not allowed on ", q.path);
    } else {
      e.message = absl::StrCat("HTTP ", r.status);
      if (r.status >= 500) e.type = "server_error";
    }
    SendError(r, e);
  });
  if (port == 0) {
    port = svr.bind_to_any_port(host);
    if (port < 0) return absl::UnavailableError("--http-listen: cannot listen on " + host);
  } else if (!svr.bind_to_port(host, port)) {
    return absl::UnavailableError("--http-listen: cannot listen on " + impl->o.listen);
  }
  s->port_ = port;
  impl->thread = std::thread([impl] { impl->server->listen_after_bind(); });
  return s;
}

void HttpService::Stop() {
  if (!impl_ || !impl_->server) return;
  impl_->server->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

HttpService::~HttpService() { Stop(); }

}  // namespace hmoe
