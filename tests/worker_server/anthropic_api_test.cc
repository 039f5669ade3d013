// gpu_worker/server/anthropic_api.h: a Messages body as the chat body the
// OpenAI path takes (system, text / tool_use / tool_result / thinking
// blocks, tools, tool_choice, thinking), and errors in Anthropic's shape.
#include "gpu_worker/server/anthropic_api.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hmoe {
namespace {

using Json = anthropic::Json;

TEST(AnthropicApi, AToolRoundTripBecomesTheChatConversation) {
  const Json body = Json::parse(R"({
    "model": "claude-x", "max_tokens": 100, "temperature": 0.5, "top_k": 7,
    "stop_sequences": ["END"], "system": "Be brief.",
    "messages": [
      {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Oslo."}]},
      {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Ask the tool.", "signature": "s"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
      {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "-3 C"}]},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": true},
        {"type": "text", "text": "And now?"}]}],
    "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
    "thinking": {"type": "enabled", "budget_tokens": 1024}})");
  openai::Error e;
  auto chat = anthropic::ToChatBody(body, false, &e);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(*chat, Json::parse(R"({
    "max_tokens": 100,
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather?\nIn Oslo."},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask the tool.",
       "tool_calls": [{"id": "toolu_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
      {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"},
      {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
      {"role": "user", "content": "And now?"}],
    "temperature": 0.5, "top_k": 7, "stop": ["END"],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                                "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": false,
    "chat_template_kwargs": {"enable_thinking": true, "thinking": true}})"));
  // count_tokens needs no max_tokens.
  Json no_max = body;
  no_max.erase("max_tokens");
  EXPECT_FALSE(anthropic::ToChatBody(no_max, false, &e).ok());
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_TRUE(anthropic::ToChatBody(no_max, true, &e).ok());
}

TEST(AnthropicApi, ErrorsHaveAnthropicsTypesAndStatuses) {
  struct Case {
    int in;
    int out;
    const char* type;
  };
  for (const Case& c :
       {Case{400, 400, "invalid_request_error"}, Case{401, 401, "authentication_error"},
        Case{404, 404, "not_found_error"}, Case{413, 413, "request_too_large"},
        Case{429, 429, "rate_limit_error"}, Case{503, 529, "overloaded_error"},
        Case{500, 500, "api_error"}, Case{504, 500, "api_error"}}) {
    openai::Error e;
    e.http_status = c.in;
    e.message = "why";
    EXPECT_EQ(anthropic::HttpStatus(e), c.out);
    EXPECT_EQ(Json::parse(anthropic::ErrorJson(e)),
              Json({{"type", "error"}, {"error", {{"type", c.type}, {"message", "why"}}}}));
  }
}

}  // namespace
}  // namespace hmoe
