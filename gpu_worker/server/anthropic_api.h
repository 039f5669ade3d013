// The Anthropic Messages API's shapes, apart from HTTP (http_service.cc
// puts them on the wire): a /v1/messages body becomes the OpenAI chat body
// openai::ParseRequest takes (one place for sampling fields, tools and the
// chat template), and the parsed output (common/text/tool_calls.h) is
// written as a message, as stream events, or as an error.
//
//   request: model (any name: the one model answers), max_tokens (required),
//     messages (user / assistant; content a string or blocks: text,
//     tool_use, tool_result, thinking; images and documents refused),
//     system (a string or text blocks), stop_sequences, temperature, top_p,
//     top_k, stream, tools ({name, description, input_schema}), tool_choice
//     (auto / any / tool / none; disable_parallel_tool_use), thinking
//     (enabled / disabled: the template's enable_thinking and thinking).
//   response: {id "msg_...", type "message", role, model, content [thinking,
//     text, tool_use blocks], stop_reason end_turn / max_tokens /
//     stop_sequence / tool_use, stop_sequence, usage}.
//   stream: message_start, ping, then per block content_block_start,
//     content_block_delta (text_delta, thinking_delta, input_json_delta),
//     content_block_stop; message_delta (stop_reason, usage), message_stop.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/text/tool_calls.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/server/openai_api.h"
#include "nlohmann/json.hpp"

namespace hmoe::anthropic {

using Json = nlohmann::ordered_json;

// The body as an OpenAI chat completions body; `count_only`
// (/v1/messages/count_tokens) does not need max_tokens. Errors: 400 naming
// the field in *error.
absl::StatusOr<Json> ToChatBody(const Json& body, bool count_only, openai::Error* error);

// Anthropic's error: its HTTP status (400, 401, 403, 404, 413, 429, 500,
// 529 for a service that cannot serve now) and {"type": "error", "error":
// {"type", "message"}}.
int HttpStatus(const openai::Error& e);
std::string ErrorJson(const openai::Error& e);

// The stop_reason for an engine finish.
const char* StopReason(FinishReason finish, bool called_tools);

Json MessageJson(const std::string& id, const std::string& model, const ParsedOutput& out,
                 FinishReason finish, const std::string& stop_string, int64_t input_tokens,
                 int64_t output_tokens);

// Writes a message's stream events as the parser returns its pieces.
class StreamWriter {
 public:
  StreamWriter(std::string id, std::string model) : id_(std::move(id)), model_(std::move(model)) {}
  // message_start and a ping.
  std::string Start(int64_t input_tokens);
  // The events for one parser delta (tool calls need their ids).
  std::string Delta(const OutputDelta& d);
  // Closes the open block; message_delta and message_stop.
  std::string Finish(FinishReason finish, const std::string& stop_string, int64_t output_tokens);
  bool called_tools() const { return called_; }

 private:
  enum class Block { kNone, kThinking, kText };
  std::string Open(Block b);
  std::string Close();

  std::string id_, model_;
  Block open_ = Block::kNone;
  int index_ = 0;  // the next block's index
  bool called_ = false;
};

// One server-sent event: "event: NAME\ndata: JSON\n\n".
std::string Event(const char* name, const Json& data);

}  // namespace hmoe::anthropic
