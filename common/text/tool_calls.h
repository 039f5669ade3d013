// A model's generated text split into what an API returns: content,
// reasoning ("thinking") and tool calls, parsed from each family's native
// syntax. One row per syntax (tool_calls.cc, kToolSyntaxes):
//
//   deepseek     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//                ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//                (V3 / R1), or ...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
//                <｜tool▁call▁end｜>... (V3.1)
//   kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
//                <|tool_call_argument_begin|>ARGS<|tool_call_end|>...
//                <|tool_calls_section_end|>
//   qwen3        <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>, one
//                block per call (Hermes style)
//   qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
//                </function></tool_call>
//   glm45        <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
//                ...</tool_call>
//   mixtral      [TOOL_CALLS] [{"name": NAME, "arguments": ARGS}, ...] to the end
//
// Reasoning is the text between <think> and </think> (a response that
// starts inside it when the prompt opened it). Parsing is streaming: text
// comes in pieces as decoded, and each piece returns what may be shown now;
// text that could still turn out to be a marker is held back. A tool call
// is returned whole once its closing marker arrives and it parses; a call
// that does not parse, or a section left open at the end, is returned as
// content (never dropped, never an error).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace hmoe {

enum class ToolSyntax { kNone, kDeepseek, kKimiK2, kQwen3, kQwen3Coder, kGlm45, kMixtral };

// "none", "deepseek", "kimi_k2", "qwen3", "qwen3_coder", "glm45", "mixtral";
// INVALID_ARGUMENT naming the known ones otherwise.
absl::StatusOr<ToolSyntax> ParseToolSyntax(absl::string_view name);
absl::string_view ToolSyntaxName(ToolSyntax s);
// The syntax a chat template writes tool calls in (its markers), kNone when
// it writes none.
ToolSyntax ToolSyntaxOfTemplate(absl::string_view chat_template);

struct ToolCall {
  std::string id;  // the model's own id where it writes one (kimi_k2), else ""
  std::string name;
  std::string arguments;  // a JSON object's text (OpenAI's "arguments")
};

struct ParsedOutput {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> tool_calls;
};

// What one Feed / Finish adds: text to append to content and reasoning,
// and the calls completed (in order; their index = their position in
// ParsedOutput::tool_calls).
struct OutputDelta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> tool_calls;
  int first_call_index = 0;
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
};

struct OutputParserOptions {
  ToolSyntax syntax = ToolSyntax::kNone;
  // The prompt ends inside a reasoning block (its template opened <think>):
  // the response starts as reasoning.
  bool starts_in_reasoning = false;
  // Split <think>...</think> off the content (off: it stays content).
  bool split_reasoning = true;
  // The request's tools (OpenAI "tools" array) or null: the XML syntaxes
  // (qwen3_coder, glm45) type each argument by its schema (a "string"
  // parameter stays a string; others are read as JSON where they parse).
  nlohmann::json tools;
};

class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions o);
  // Appends generated text; returns what it completes.
  OutputDelta Feed(absl::string_view text);
  // The end of the generation: flushes what was held back (an unfinished
  // call or section as content; mixtral's calls, which end with the text).
  OutputDelta Finish();
  // Everything returned so far, joined.
  const ParsedOutput& result() const { return out_; }

 private:
  enum class State { kContent, kReasoning, kSection };
  void Step(OutputDelta* d, bool final);
  void EmitContent(absl::string_view s, OutputDelta* d);
  bool TakeSection(absl::string_view section, OutputDelta* d);

  OutputParserOptions o_;
  State state_;
  bool think_allowed_ = false;  // <think> may still open (no content or reasoning yet)
  bool skip_ws_ = false;        // after a parsed section: drop the whitespace that follows
  std::string buf_;             // text not yet returned
  ParsedOutput out_;
};

// The whole text at once: Feed(text) then Finish().
ParsedOutput ParseOutput(const OutputParserOptions& o, absl::string_view text);

// Text that, appended to the rendered prompt, makes the model continue
// inside a tool call (tool_choice "required": any function; a named one:
// that function), and that the parser is fed first so the call parses.
// nullopt for kNone and for syntaxes with no place for a name in front of
// the arguments.
std::optional<std::string> ForcedToolCallPrefix(ToolSyntax s, absl::string_view function_name);

}  // namespace hmoe
