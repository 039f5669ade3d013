// The Jinja interpreter behind ChatTemplate (common/text/jinja/jinja.h): arbitrary
// bytes as a template, parsed and rendered under tight limits. The input is
//   <template> [ "\0" <context JSON> ]
// without the NUL (or with a context that is not a JSON object) the
// template renders with a fixed conversation (system, user, assistant with
// a tool call, tool result), tools and add_generation_prompt. Must not
// crash, leak or hang; errors are fine.
#include <cstdint>
#include <string>

#include "common/text/jinja/jinja.h"
#include "nlohmann/json.hpp"

namespace {

const nlohmann::ordered_json& DefaultContext() {
  static const auto* ctx = new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Weather in Paris? \u00e9\u4e16 \"q\" \\ \n"},
      {"role": "assistant", "content": "", "reasoning_content": "think",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
      {"role": "user", "content": [{"type": "text", "text": "thanks"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "documents": null,
    "add_generation_prompt": true,
    "enable_thinking": false,
    "bos_token": "<s>",
    "eos_token": "</s>"
  })"));
  return *ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string source = input.substr(0, nul);
  auto tmpl = hmoe::jinja::Template::Parse(source, "fuzz");
  if (!tmpl.ok()) return 0;
  nlohmann::ordered_json ctx = DefaultContext();
  if (nul != std::string::npos) {
    auto parsed = nlohmann::ordered_json::parse(input.substr(nul + 1), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) ctx = std::move(parsed);
  }
  hmoe::jinja::RenderOptions opts;
  opts.limits.max_steps = 200'000;
  opts.limits.max_output_bytes = 1 << 20;
  opts.limits.max_string_bytes = 1 << 20;
  opts.limits.max_container_items = 1 << 16;
  opts.now = [] { return static_cast<std::time_t>(1700000000); };
  (void)tmpl->Render(ctx, opts);
  return 0;
}
