#include "gpu_worker/server/anthropic_api.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hmoe::anthropic {
namespace {

// Fails with 400 naming `param`.
absl::Status Bad(openai::Error* error, const std::string& param, const std::string& message) {
  error->http_status = 400;
  error->type = "invalid_request_error";
  error->param = param;
  error->message = absl::StrCat(param, ": ", message);
  return absl::InvalidArgumentError(error->message);
}

std::string TypeOf(const Json& block) {
  return block.is_object() && block.contains("type") && block["type"].is_string()
             ? block["type"].get<std::string>()
             : "";
}

// A string, or text blocks joined (a tool result's or the system's
// content); false for anything else.
bool TextOf(const Json& v, std::string* out) {
  if (v.is_string()) {
    *out = v.get<std::string>();
    return true;
  }
  if (!v.is_array()) return false;
  std::vector<std::string> parts;
  for (const Json& b : v) {
    if (TypeOf(b) != "text" || !b.contains("text") || !b["text"].is_string()) return false;
    parts.push_back(b["text"].get<std::string>());
  }
  *out = absl::StrJoin(parts, "\n");
  return true;
}

// One Anthropic message -> OpenAI messages (a user turn's tool results
// become tool messages before its text).
absl::Status AddMessage(const Json& m, const std::string& at, Json* out, openai::Error* error) {
  if (!m.is_object()) return Bad(error, at, "expected an object");
  if (!m.contains("role") || !m["role"].is_string() ||
      (m["role"] != "user" && m["role"] != "assistant"))
    return Bad(error, at + ".role", "expected \"user\" or \"assistant\"");
  const std::string role = m["role"].get<std::string>();
  if (!m.contains("content")) return Bad(error, at + ".content", "required");
  const Json& content = m["content"];
  if (content.is_string()) {
    out->push_back(Json{{"role", role}, {"content", content}});
    return absl::OkStatus();
  }
  if (!content.is_array())
    return Bad(error, at + ".content", "expected a string or an array of blocks");
  std::vector<std::string> texts;
  std::string thinking;
  Json calls = Json::array();
  for (size_t j = 0; j < content.size(); ++j) {
    const Json& b = content[j];
    const std::string bt = TypeOf(b);
    const std::string bat = absl::StrCat(at, ".content[", j, "]");
    if (bt == "text") {
      if (!b.contains("text") || !b["text"].is_string())
        return Bad(error, bat + ".text", "expected a string");
      texts.push_back(b["text"].get<std::string>());
    } else if (bt == "tool_result" && role == "user") {
      if (!b.contains("tool_use_id") || !b["tool_use_id"].is_string())
        return Bad(error, bat + ".tool_use_id", "expected a string");
      std::string text;
      if (b.contains("content") && !TextOf(b["content"], &text))
        return Bad(error, bat + ".content", "expected a string or text blocks");
      if (b.value("is_error", false)) text = "Error: " + text;
      out->push_back(Json{{"role", "tool"}, {"tool_call_id", b["tool_use_id"]}, {"content", text}});
    } else if (bt == "tool_use" && role == "assistant") {
      if (!b.contains("id") || !b["id"].is_string() || !b.contains("name") ||
          !b["name"].is_string())
        return Bad(error, bat, "a tool_use block needs a string id and name");
      const Json input = b.contains("input") ? b["input"] : Json::object();
      if (!input.is_object()) return Bad(error, bat + ".input", "expected an object");
      calls.push_back(Json{{"id", b["id"]},
                           {"type", "function"},
                           {"function", Json{{"name", b["name"]}, {"arguments", input}}}});
    } else if ((bt == "thinking" || bt == "redacted_thinking") && role == "assistant") {
      if (bt == "thinking" && b.contains("thinking") && b["thinking"].is_string())
        thinking += b["thinking"].get<std::string>();
    } else if (bt == "image" || bt == "document") {
      return Bad(error, bat, absl::StrCat(bt, " blocks are not supported: this model reads text"));
    } else {
      return Bad(error, bat + ".type",
                 absl::StrCat("\"", bt, "\" is not a ", role, " content block this server takes"));
    }
  }
  if (texts.empty() && calls.empty() && thinking.empty()) return absl::OkStatus();
  Json msg{{"role", role}, {"content", absl::StrJoin(texts, "\n")}};
  if (!thinking.empty()) msg["reasoning_content"] = thinking;
  if (!calls.empty()) msg["tool_calls"] = calls;
  out->push_back(std::move(msg));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Json> ToChatBody(const Json& body, bool count_only, openai::Error* error) {
  if (!body.is_object()) {
    error->message = "the request body is not a JSON object";
    return absl::InvalidArgumentError(error->message);
  }
  Json chat = Json::object();
  if (!count_only || body.contains("max_tokens")) {
    if (!body.contains("max_tokens")) return Bad(error, "max_tokens", "required");
    const Json& mt = body["max_tokens"];
    if (!mt.is_number_integer() || mt.get<int64_t>() < 1)
      return Bad(error, "max_tokens", "expected an integer >= 1");
    chat["max_tokens"] = mt;
  } else {
    chat["max_tokens"] = 1;
  }
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    return Bad(error, "messages", "expected a non-empty array");
  Json msgs = Json::array();
  if (body.contains("system")) {
    std::string system;
    if (!TextOf(body["system"], &system))
      return Bad(error, "system", "expected a string or an array of text blocks");
    msgs.push_back(Json{{"role", "system"}, {"content", system}});
  }
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    absl::Status s =
        AddMessage(body["messages"][i], absl::StrCat("messages[", i, "]"), &msgs, error);
    if (!s.ok()) return s;
  }
  chat["messages"] = std::move(msgs);
  // Sampling fields keep their names (ParseRequest checks their ranges).
  for (const char* f : {"temperature", "top_p", "top_k", "stream"})
    if (body.contains(f)) chat[f] = body[f];
  if (body.contains("stop_sequences")) {
    if (!body["stop_sequences"].is_array())
      return Bad(error, "stop_sequences", "expected an array of strings");
    chat["stop"] = body["stop_sequences"];
  }
  if (body.contains("tools")) {
    const Json& tools = body["tools"];
    if (!tools.is_array()) return Bad(error, "tools", "expected an array");
    Json out = Json::array();
    for (size_t i = 0; i < tools.size(); ++i) {
      const Json& t = tools[i];
      const std::string at = absl::StrCat("tools[", i, "]");
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
        return Bad(error, at + ".name", "expected a string");
      if (t.contains("type") && t["type"] != "custom")
        return Bad(error, at + ".type",
                   absl::StrCat(t["type"].dump(), ": only client tools (custom) run here"));
      Json fn{{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      fn["parameters"] = t.contains("input_schema") ? t["input_schema"] : Json::object();
      out.push_back(Json{{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(out);
  }
  if (body.contains("tool_choice")) {
    const Json& tc = body["tool_choice"];
    const std::string type = TypeOf(tc);
    if (type == "auto") {
      chat["tool_choice"] = "auto";
    } else if (type == "any") {
      chat["tool_choice"] = "required";
    } else if (type == "none") {
      chat["tool_choice"] = "none";
    } else if (type == "tool" && tc.contains("name") && tc["name"].is_string()) {
      chat["tool_choice"] = Json{{"type", "function"}, {"function", Json{{"name", tc["name"]}}}};
    } else {
      return Bad(error, "tool_choice",
                 "expected {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                 "\"name\": ...}");
    }
    if (tc.contains("disable_parallel_tool_use")) {
      if (!tc["disable_parallel_tool_use"].is_boolean())
        return Bad(error, "tool_choice.disable_parallel_tool_use", "expected a boolean");
      chat["parallel_tool_calls"] = !tc["disable_parallel_tool_use"].get<bool>();
    }
  }
  if (body.contains("thinking")) {
    const std::string type = TypeOf(body["thinking"]);
    if (type != "enabled" && type != "disabled")
      return Bad(error, "thinking.type", "expected \"enabled\" or \"disabled\"");
    const bool on = type == "enabled";
    chat["chat_template_kwargs"] = Json{{"enable_thinking", on}, {"thinking", on}};
  }
  return chat;
}

int HttpStatus(const openai::Error& e) {
  switch (e.http_status) {
    case 400:
    case 401:
    case 403:
    case 404:
    case 413:
    case 429:
      return e.http_status;
    case 503:
      return 529;  // overloaded: try again later
    default:
      return e.http_status >= 500 ? 500 : 400;
  }
}

std::string ErrorJson(const openai::Error& e) {
  const char* type = "api_error";
  switch (HttpStatus(e)) {
    case 400:
      type = "invalid_request_error";
      break;
    case 401:
      type = "authentication_error";
      break;
    case 403:
      type = "permission_error";
      break;
    case 404:
      type = "not_found_error";
      break;
    case 413:
      type = "request_too_large";
      break;
    case 429:
      type = "rate_limit_error";
      break;
    case 529:
      type = "overloaded_error";
      break;
  }
  return Json{{"type", "error"}, {"error", Json{{"type", type}, {"message", e.message}}}}.dump(
      -1, ' ', false, Json::error_handler_t::replace);
}

const char* StopReason(FinishReason finish, bool called_tools) {
  switch (finish) {
    case FinishReason::kLength:
      return "max_tokens";
    case FinishReason::kStopString:
      return called_tools ? "tool_use" : "stop_sequence";
    default:
      return called_tools ? "tool_use" : "end_turn";
  }
}

namespace {

Json ToolUse(const ToolCall& c) {
  Json input = Json::parse(c.arguments, nullptr, /*allow_exceptions=*/false);
  if (input.is_discarded()) input = Json::object();
  return Json{{"type", "tool_use"}, {"id", c.id}, {"name", c.name}, {"input", std::move(input)}};
}

Json StopSequence(FinishReason finish, bool called, const std::string& stop_string) {
  return finish == FinishReason::kStopString && !called ? Json(stop_string) : Json(nullptr);
}

}  // namespace

Json MessageJson(const std::string& id, const std::string& model, const ParsedOutput& out,
                 FinishReason finish, const std::string& stop_string, int64_t input_tokens,
                 int64_t output_tokens) {
  Json content = Json::array();
  if (!out.reasoning.empty())
    content.push_back(Json{{"type", "thinking"}, {"thinking", out.reasoning}, {"signature", ""}});
  if (!out.content.empty()) content.push_back(Json{{"type", "text"}, {"text", out.content}});
  for (const ToolCall& c : out.tool_calls) content.push_back(ToolUse(c));
  const bool called = !out.tool_calls.empty();
  return Json{{"id", id},
              {"type", "message"},
              {"role", "assistant"},
              {"model", model},
              {"content", std::move(content)},
              {"stop_reason", StopReason(finish, called)},
              {"stop_sequence", StopSequence(finish, called, stop_string)},
              {"usage", Json{{"input_tokens", input_tokens}, {"output_tokens", output_tokens}}}};
}

std::string Event(const char* name, const Json& data) {
  return absl::StrCat("event: ", name,
                      "\ndata: ", data.dump(-1, ' ', false, Json::error_handler_t::replace),
                      "\n\n");
}

std::string StreamWriter::Start(int64_t input_tokens) {
  Json message{{"id", id_},
               {"type", "message"},
               {"role", "assistant"},
               {"model", model_},
               {"content", Json::array()},
               {"stop_reason", nullptr},
               {"stop_sequence", nullptr},
               {"usage", Json{{"input_tokens", input_tokens}, {"output_tokens", 0}}}};
  return Event("message_start", Json{{"type", "message_start"}, {"message", std::move(message)}}) +
         Event("ping", Json{{"type", "ping"}});
}

std::string StreamWriter::Close() {
  if (open_ == Block::kNone) return "";
  open_ = Block::kNone;
  return Event("content_block_stop", Json{{"type", "content_block_stop"}, {"index", index_++}});
}

std::string StreamWriter::Open(Block b) {
  if (open_ == b) return "";
  std::string out = Close();
  open_ = b;
  const Json block = b == Block::kThinking
                         ? Json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                         : Json{{"type", "text"}, {"text", ""}};
  return out +
         Event("content_block_start",
               Json{{"type", "content_block_start"}, {"index", index_}, {"content_block", block}});
}

std::string StreamWriter::Delta(const OutputDelta& d) {
  std::string out;
  auto delta = [&](const Json& dj) {
    out += Event("content_block_delta",
                 Json{{"type", "content_block_delta"}, {"index", index_}, {"delta", dj}});
  };
  if (!d.reasoning.empty()) {
    out += Open(Block::kThinking);
    delta(Json{{"type", "thinking_delta"}, {"thinking", d.reasoning}});
  }
  if (!d.content.empty()) {
    out += Open(Block::kText);
    delta(Json{{"type", "text_delta"}, {"text", d.content}});
  }
  for (const ToolCall& c : d.tool_calls) {
    out += Close();
    called_ = true;
    Json start = ToolUse(c);
    start["input"] = Json::object();
    out += Event("content_block_start", Json{{"type", "content_block_start"},
                                             {"index", index_},
                                             {"content_block", std::move(start)}});
    delta(Json{{"type", "input_json_delta"}, {"partial_json", c.arguments}});
    out += Event("content_block_stop", Json{{"type", "content_block_stop"}, {"index", index_++}});
  }
  return out;
}

std::string StreamWriter::Finish(FinishReason finish, const std::string& stop_string,
                                 int64_t output_tokens) {
  std::string out = Close();
  out += Event("message_delta",
               Json{{"type", "message_delta"},
                    {"delta", Json{{"stop_reason", StopReason(finish, called_)},
                                   {"stop_sequence", StopSequence(finish, called_, stop_string)}}},
                    {"usage", Json{{"output_tokens", output_tokens}}}});
  out += Event("message_stop", Json{{"type", "message_stop"}});
  return out;
}

}  // namespace hmoe::anthropic
