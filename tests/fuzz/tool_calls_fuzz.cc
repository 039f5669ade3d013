// The tool-call / reasoning parser (common/text/tool_calls.h) on model
// output it never saw. The first byte picks the syntax and the options, the
// second seeds the piece sizes; the rest is the generated text. Checks, by
// trapping: fed in pieces it returns what it returns fed whole; with no
// syntax and no reasoning split the content is the text, byte for byte.
#include <cstdint>
#include <string>
#include <vector>

#include "common/text/tool_calls.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

bool Same(const hmoe::ParsedOutput& a, const hmoe::ParsedOutput& b) {
  if (a.content != b.content || a.reasoning != b.reasoning ||
      a.tool_calls.size() != b.tool_calls.size())
    return false;
  for (size_t i = 0; i < a.tool_calls.size(); ++i)
    if (a.tool_calls[i].id != b.tool_calls[i].id || a.tool_calls[i].name != b.tool_calls[i].name ||
        a.tool_calls[i].arguments != b.tool_calls[i].arguments)
      return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hmoe::fuzz::Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  uint8_t seed = in.Take<uint8_t>();
  const std::string text = in.Rest();
  static constexpr hmoe::ToolSyntax kSyntaxes[] = {
      hmoe::ToolSyntax::kNone,   hmoe::ToolSyntax::kDeepseek,   hmoe::ToolSyntax::kKimiK2,
      hmoe::ToolSyntax::kQwen3,  hmoe::ToolSyntax::kQwen3Coder, hmoe::ToolSyntax::kGlm45,
      hmoe::ToolSyntax::kMixtral};
  hmoe::OutputParserOptions o;
  o.syntax = kSyntaxes[(mode & 7) % 7];
  o.starts_in_reasoning = (mode & 8) != 0;
  o.split_reasoning = (mode & 16) == 0;
  if (mode & 32)
    o.tools = nlohmann::json::parse(R"([{"type": "function", "function": {"name": "f",
        "parameters": {"properties": {"s": {"type": "string"}, "n": {"type": "number"}}}}}])");
  const hmoe::ParsedOutput whole = hmoe::ParseOutput(o, text);
  hmoe::OutputParser p(o);
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min<size_t>(1 + seed % 9, text.size() - at);
    seed = static_cast<uint8_t>(seed * 33 + 7);
    p.Feed(absl::string_view(text).substr(at, n));
    at += n;
  }
  p.Finish();
  if (!Same(p.result(), whole)) __builtin_trap();
  if (o.syntax == hmoe::ToolSyntax::kNone && !o.split_reasoning && whole.content != text)
    __builtin_trap();
  return 0;
}
