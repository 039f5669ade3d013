// The OpenAI-compatible request and response shapes, apart from HTTP:
// parsing a /v1/completions or /v1/chat/completions body into an engine
// request (every field OpenAI's servers take, each checked for its type and
// range; unknown fields ignored as OpenAI does), and writing the JSON of
// responses, stream chunks and errors. http_service.cc puts it on the wire.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "common/text/tool_calls.h"
#include "gpu_worker/engine/engine.h"
#include "nlohmann/json.hpp"

namespace hmoe::openai {

using Json = nlohmann::ordered_json;

enum class Endpoint { kCompletions, kChatCompletions };

// An API error: the HTTP status and OpenAI's error object.
struct Error {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the field at fault; empty: none
  std::string code;   // e.g. "model_not_found"; empty: none
};
// {"error": {"message", "type", "param", "code"}} (null where empty).
std::string ErrorJson(const Error& e);
// The HTTP status and error type for a status from the engine or the model:
// INVALID_ARGUMENT / OUT_OF_RANGE / FAILED_PRECONDITION 400,
// UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, else 500.
Error FromStatus(const absl::Status& s);

// What a request asks for beyond the engine request itself.
struct Parsed {
  GenerateRequest request;
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage
  std::string rendered_prompt;  // chat: the template's output (for logs, tests)
  // Chat: how the generated text splits into content, reasoning and tool
  // calls; forced_prefix (tool_choice "required" or a named function: the
  // text the prompt ends with, in the call's syntax) is fed to the parser
  // before the generated text. parallel_tool_calls false: the first call
  // only.
  OutputParserOptions output;
  std::string forced_prefix;
  bool parallel_tool_calls = true;
};

// What parsing needs from the serving side.
struct Context {
  std::string model_name;        // the one model served (`model` must match when given)
  const Tokenizer* tokenizer;    // null: only token-id prompts
  const ChatTemplate* chat;      // null: chat completions refused
  std::string no_chat_template;  // why chat is null (the error's text)
  int64_t max_context = 0;       // prompt + completion tokens a request may hold
  // The served model's tool-call syntax and whether its <think> blocks are
  // returned apart (reasoning_content).
  ToolSyntax tool_syntax = ToolSyntax::kNone;
  bool split_reasoning = false;
};

// Parses and checks a request body. Errors are 400 naming the field (param),
// 404 model_not_found for another model. Defaults: max_tokens 16 for
// completions (as OpenAI), the rest of the context for chat; temperature 1
// (OpenAI's default; 0 is greedy); add_generation_prompt true (chat).
absl::StatusOr<Parsed> ParseRequest(Endpoint endpoint, const Json& body, const Context& ctx,
                                    Error* error);

// OpenAI's finish_reason for an engine finish: "stop" (eos or a stop
// string) or "length"; null while running.
Json FinishReasonJson(FinishReason r);

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0;
};
Json UsageJson(const Usage& u);

// A choice's "logprobs" for these tokens (null when the request asked for
// none, i.e. request.logprobs < 0): chat {"content": [{token, logprob,
// bytes, top_logprobs}]}; completions {tokens, token_logprobs,
// top_logprobs (the alternatives and the chosen token), text_offset (UTF-8
// bytes into the completion, counted from *offset, which advances)}.
Json LogprobsJson(Endpoint endpoint, int32_t requested, const std::vector<TokenLogprob>& tokens,
                  const Tokenizer* tokenizer, size_t* offset);

// Whole responses.
Json CompletionResponse(Endpoint endpoint, const std::string& id, int64_t created,
                        const std::string& model, const std::string& text, FinishReason finish,
                        const Usage& usage, const Json& logprobs = nullptr);
// One stream chunk: a text delta (chat: the first one also carries the
// role), or the final one with finish_reason; `usage` only on the last
// chunk of a stream with include_usage (choices empty then).
Json StreamChunk(Endpoint endpoint, const std::string& id, int64_t created,
                 const std::string& model, const std::string& text, bool first, FinishReason finish,
                 const Json& logprobs = nullptr);
// Chat with its output parsed (Parsed::output): the whole response's
// message {role, content (null when empty beside tool calls),
// reasoning_content (when any), tool_calls (when any: {id, type
// "function", function {name, arguments}})}; finish_reason "tool_calls"
// when it called tools and ended at a stop. Tool calls need their ids set.
Json ChatResponse(const std::string& id, int64_t created, const std::string& model,
                  const ParsedOutput& out, FinishReason finish, const Usage& usage,
                  const Json& logprobs = nullptr);
// A chat stream chunk for what the parser returned: delta {role (first),
// content, reasoning_content, tool_calls [{index, id, type, function}]}.
Json ChatDeltaChunk(const std::string& id, int64_t created, const std::string& model,
                    const OutputDelta& d, bool first, const Json& logprobs = nullptr);
// A chat stream's finish chunk ("tool_calls" as ChatResponse).
Json ChatFinishChunk(const std::string& id, int64_t created, const std::string& model,
                     FinishReason finish, bool called_tools);
Json UsageChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                const Usage& usage);

// GET /v1/models.
Json ModelsList(const std::string& model, int64_t created, int64_t max_context);

}  // namespace hmoe::openai
