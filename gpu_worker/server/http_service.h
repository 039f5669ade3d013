// The worker's OpenAI-compatible HTTP front end (http_server.h), beside the
// gRPC one, over the same Engine:
//   POST /v1/chat/completions, POST /v1/completions (streamed as
//     server-sent events ending "data: [DONE]", or whole; chat's output
//     split into content, reasoning_content and tool_calls by the model's
//     syntax, common/text/tool_calls.h); POST /v1/messages and
//     /v1/messages/count_tokens (the Anthropic Messages API, anthropic_api.h:
//     its errors in Anthropic's shape, 529 where OpenAI's are 503);
//     GET /v1/models;
//   GET /metrics (Prometheus text, from `metrics`); GET /health.
// Errors are OpenAI's error JSON with the fitting status (openai_api.h):
// 400 bad parameters (naming the field), a body nesting JSON deeper than
// kMaxClientJsonDepth, or bad framing; 401 no or wrong token (bearer or
// x-api-key); 404
// another model or path; 408 a request head slower than header_timeout; 413
// a body over max_body_bytes; 429 the engine's queue full; 503 draining,
// the expert service down, or max_connections open (http_server.h).
// A client that goes away cancels its request (the engine frees its KV
// blocks at its next step): a streamed request notices at its next write; a
// whole one's socket is peeked every probe_interval while it waits.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth_token.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "common/text/tool_calls.h"
#include "common/transport/grpc_tls.h"
#include "gpu_worker/engine/engine.h"

namespace hmoe {

struct HttpServiceOptions {
  std::string listen = "127.0.0.1:8000";  // HOST:PORT (port 0: any; see port())
  std::string model_name;                 // the `model` clients name and are told
  // Non-null and on: /v1/* and /metrics need "Authorization: Bearer <token>".
  std::shared_ptr<const AuthTokens> auth_tokens;
  TlsServerFiles tls;  // cert + key: HTTPS (client_ca_file: clients need a certificate)
  size_t max_body_bytes = 16 << 20;  // after chunked decoding too; more: 413
  // Connections open at once (each streamed request holds one); more: 503.
  int max_connections = 512;
  // A request head (and a TLS handshake) must arrive within this; else 408.
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration idle_timeout = absl::Seconds(5);  // a keep-alive connection waits this long
  absl::Duration io_timeout = absl::Seconds(30);   // a stalled body read or response write
  absl::Duration probe_interval = absl::Milliseconds(250);
  std::function<std::string()> metrics;  // /metrics body; empty: 404
  // False: new requests 503 (e.g. the expert service is down). Empty: always up.
  std::function<bool()> ready;
  // Chat output: the model's tool-call syntax (tool_calls.h; kNone: calls
  // stay content and tool_choice "required" / named are refused) and whether
  // <think> blocks go to reasoning_content.
  ToolSyntax tool_syntax = ToolSyntax::kNone;
  bool split_reasoning = false;
};

class HttpService {
 public:
  // Borrowed: engine, tokenizer (may be null: token-id prompts only), chat
  // (may be null: chat completions refused with `no_chat_template`).
  static absl::StatusOr<std::unique_ptr<HttpService>> Start(Engine* engine,
                                                            const Tokenizer* tokenizer,
                                                            const ChatTemplate* chat,
                                                            std::string no_chat_template,
                                                            HttpServiceOptions options);
  ~HttpService();  // Stop()
  int port() const { return port_; }
  // New requests get 503 from now on; those in flight go on.
  void SetDraining() { draining_ = true; }
  // Closes the listener and the connections; waits for the handlers.
  void Stop();

  struct Impl;

 private:
  HttpService() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::atomic<bool> draining_{false};
};

}  // namespace hmoe
