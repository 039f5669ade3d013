// common/text/tool_calls.h: every syntax's calls parsed back from the
// families' own chat templates' renderings (tests/fixtures/chat_templates,
// made by transformers), streamed in any split equal to the whole,
// reasoning split off, malformed calls kept as content.
#include "common/text/tool_calls.h"

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using json = nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Dir() { return testing::FixturesDir() + "/chat_templates"; }

OutputParserOptions Opts(ToolSyntax s, bool in_reasoning = false) {
  OutputParserOptions o;
  o.syntax = s;
  o.starts_in_reasoning = in_reasoning;
  return o;
}

// The parse of `text` fed in pieces of the given sizes (cycled).
ParsedOutput ParseInPieces(const OutputParserOptions& o, const std::string& text,
                           const std::vector<size_t>& sizes) {
  OutputParser p(o);
  ParsedOutput joined;
  auto add = [&](const OutputDelta& d) {
    joined.content += d.content;
    joined.reasoning += d.reasoning;
    if (!d.tool_calls.empty()) {
      EXPECT_EQ(d.first_call_index, joined.tool_calls.size());
    }
    for (const ToolCall& c : d.tool_calls) joined.tool_calls.push_back(c);
  };
  size_t at = 0;
  for (size_t i = 0; at < text.size(); ++i) {
    const size_t n = std::min(sizes[i % sizes.size()], text.size() - at);
    add(p.Feed(absl::string_view(text).substr(at, n)));
    at += n;
  }
  add(p.Finish());
  // The deltas add up to the parser's own result.
  EXPECT_EQ(joined.content, p.result().content);
  EXPECT_EQ(joined.reasoning, p.result().reasoning);
  EXPECT_EQ(joined.tool_calls.size(), p.result().tool_calls.size());
  return joined;
}

void ExpectSame(const ParsedOutput& a, const ParsedOutput& b, const std::string& what) {
  EXPECT_EQ(a.content, b.content) << what;
  EXPECT_EQ(a.reasoning, b.reasoning) << what;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << what;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id) << what;
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << what;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << what;
  }
}

// Whole, byte by byte, and in random pieces: the same result.
ParsedOutput ParseEveryWay(const OutputParserOptions& o, const std::string& text) {
  const ParsedOutput whole = ParseOutput(o, text);
  ExpectSame(ParseInPieces(o, text, {1}), whole, "fed byte by byte");
  std::mt19937 rng(static_cast<uint32_t>(text.size()));
  for (int r = 0; r < 8; ++r) {
    std::vector<size_t> sizes;
    for (int i = 0; i < 16; ++i) sizes.push_back(1 + rng() % 12);
    ExpectSame(ParseInPieces(o, text, sizes), whole, "fed in random pieces");
  }
  return whole;
}

json Args(const ToolCall& c) { return json::parse(c.arguments); }

// An OpenAI message's arguments (an object, or a string holding one).
json ArgsOf(const json& function) {
  const json& a = function["arguments"];
  return a.is_string() ? json::parse(a.get<std::string>()) : a;
}

struct Family {
  const char* model;
  ToolSyntax syntax;
  const char* turn_open;  // the assistant turn starts after this
  const char* turn_close;
};

// Each assistant message with tool calls in the fixtures' conversations,
// cut out of its rendering (between the assistant's opener and its end of
// turn), parses back into the message: its text as content, its calls
// with their names and arguments.
TEST(ToolCalls, TemplateRenderingsParseBackIntoTheirMessages) {
  const json cases = json::parse(ReadFile(Dir() + "/cases.json"))["cases"];
  const Family families[] = {
      {"qwen3", ToolSyntax::kQwen3, "<|im_start|>assistant\n", "<|im_end|>"},
      {"kimi_k2", ToolSyntax::kKimiK2, "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"},
      {"deepseek_r1", ToolSyntax::kDeepseek, "<｜Assistant｜>", "<｜end▁of▁sentence｜>"},
  };
  int checked_calls = 0;
  for (const Family& f : families) {
    for (const json& c : cases) {
      if (c["model"] != f.model || !c.contains("expected")) continue;
      const std::string rendered = c["expected"].get<std::string>();
      size_t at = 0;
      for (const json& m : c["messages"]) {
        if (m["role"] != "assistant") continue;
        // (DeepSeek-R1 writes the answer after tool results with no opener
        // of its own: only the turns with calls are looked for.)
        if (!m.contains("tool_calls")) continue;
        const size_t open = rendered.find(f.turn_open, at);
        ASSERT_NE(open, std::string::npos) << c["name"];
        const size_t begin = open + std::string(f.turn_open).size();
        const size_t end = rendered.find(f.turn_close, begin);
        ASSERT_NE(end, std::string::npos) << c["name"];
        at = end;
        SCOPED_TRACE(::testing::Message() << f.model << " " << c["name"]);
        const ParsedOutput p = ParseEveryWay(Opts(f.syntax), rendered.substr(begin, end - begin));
        const std::string want = m["content"].is_string() ? m["content"].get<std::string>() : "";
        std::string got = p.content;
        while (!got.empty() && (got.back() == '\n' || got.back() == ' ')) got.pop_back();
        EXPECT_EQ(got, want);
        ASSERT_EQ(p.tool_calls.size(), m["tool_calls"].size());
        for (size_t i = 0; i < p.tool_calls.size(); ++i) {
          const json& fn = m["tool_calls"][i]["function"];
          EXPECT_EQ(p.tool_calls[i].name, fn["name"].get<std::string>());
          EXPECT_EQ(Args(p.tool_calls[i]), ArgsOf(fn));
          ++checked_calls;
        }
        if (f.syntax == ToolSyntax::kKimiK2) {
          // Kimi writes its own ids: functions.NAME:INDEX.
          EXPECT_EQ(
              p.tool_calls[0].id,
              "functions." + m["tool_calls"][0]["function"]["name"].get<std::string>() + ":0");
        }
      }
    }
  }
  EXPECT_GE(checked_calls, 12);
}

TEST(ToolCalls, TemplatesSayTheirSyntax) {
  EXPECT_EQ(ToolSyntaxOfTemplate(ReadFile(Dir() + "/deepseek_v3.jinja")), ToolSyntax::kDeepseek);
  EXPECT_EQ(ToolSyntaxOfTemplate(ReadFile(Dir() + "/deepseek_r1.jinja")), ToolSyntax::kDeepseek);
  EXPECT_EQ(ToolSyntaxOfTemplate(ReadFile(Dir() + "/kimi_k2.jinja")), ToolSyntax::kKimiK2);
  EXPECT_EQ(ToolSyntaxOfTemplate(ReadFile(Dir() + "/qwen3.jinja")), ToolSyntax::kQwen3);
  EXPECT_EQ(ToolSyntaxOfTemplate(ReadFile(Dir() + "/mixtral.jinja")), ToolSyntax::kNone);
  EXPECT_EQ(ToolSyntaxOfTemplate("{{ '<tool_call>' + name + '<arg_key>' }}"), ToolSyntax::kGlm45);
  EXPECT_EQ(ToolSyntaxOfTemplate("<tool_call>\n<function={{ f }}>"), ToolSyntax::kQwen3Coder);
}

TEST(ToolCalls, SyntaxNamesParseAndUnknownOnesAreRefused) {
  for (ToolSyntax s :
       {ToolSyntax::kNone, ToolSyntax::kDeepseek, ToolSyntax::kKimiK2, ToolSyntax::kQwen3,
        ToolSyntax::kQwen3Coder, ToolSyntax::kGlm45, ToolSyntax::kMixtral}) {
    auto back = ParseToolSyntax(ToolSyntaxName(s));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, s);
  }
  auto bad = ParseToolSyntax("hermes2");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("qwen3_coder"), std::string::npos);
}

// Two calls in one section: DeepSeek-V3.1's form (NAME<sep>ARGS) and
// Mixtral's list, which runs to the end of the text.
TEST(ToolCalls, TwoCallsInOneSection) {
  struct Case {
    ToolSyntax s;
    std::string text, content, first_id;
  };
  const Case cases[] = {
      {ToolSyntax::kDeepseek,
       "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": "
       "\"Rome\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<"
       "｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>",
       "Sure.", ""},
      {ToolSyntax::kMixtral,
       "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}, \"id\": "
       "\"a1b2c3d4e\"}, {\"name\": \"get_time\", \"arguments\": {}}]",
       "", "a1b2c3d4e"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(ToolSyntaxName(c.s));
    const ParsedOutput p = ParseEveryWay(Opts(c.s), c.text);
    EXPECT_EQ(p.content, c.content);
    ASSERT_EQ(p.tool_calls.size(), 2u);
    EXPECT_EQ(p.tool_calls[0].id, c.first_id);
    EXPECT_EQ(p.tool_calls[0].name, "get_weather");
    EXPECT_EQ(Args(p.tool_calls[0]), json({{"city", "Rome"}}));
    EXPECT_EQ(p.tool_calls[1].name, "get_time");
    EXPECT_EQ(Args(p.tool_calls[1]), json::object());
  }
}

TEST(ToolCalls, Glm45XmlArgumentsAreTypedByTheSchema) {
  OutputParserOptions o = Opts(ToolSyntax::kGlm45);
  o.tools = json::parse(R"([{"type": "function", "function": {"name": "set", "parameters":
      {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
       "opts": {"type": "object"}}}}}])");
  const std::string text =
      "<think>plan it</think>\n\nOK.\n<tool_call>set\n<arg_key>code</arg_key>\n<arg_value>42"
      "</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n<arg_key>opts</arg_key>\n"
      "<arg_value>{\"a\": [1, 2]}</arg_value>\n<arg_key>free</arg_key>\n<arg_value>not json"
      "</arg_value>\n</tool_call>";
  const ParsedOutput p = ParseEveryWay(o, text);
  EXPECT_EQ(p.reasoning, "plan it");
  EXPECT_EQ(p.content, "OK.\n");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].name, "set");
  // "42" stays a string (the schema says so); 7 and the object are JSON; a
  // parameter the schema does not name is JSON where it parses, else text.
  EXPECT_EQ(Args(p.tool_calls[0]),
            json::parse(R"({"code": "42", "n": 7, "opts": {"a": [1, 2]}, "free": "not json"})"));
}

TEST(ToolCalls, Qwen3CoderXmlKeepsMultilineValues) {
  OutputParserOptions o = Opts(ToolSyntax::kQwen3Coder);
  o.tools = json::parse(R"([{"type": "function", "function": {"name": "write_file",
      "parameters": {"properties": {"path": {"type": "string"}, "body": {"type": "string"}}}}}])");
  const std::string body = "def f(x):\n    return x < 3 and x > 1\n";
  const std::string text =
      "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
      "<parameter=body>\n" +
      body +
      "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
      "<function=write_file>\n<parameter=path>\nb.py\n</parameter>\n"
      "</function>\n</tool_call>";
  const ParsedOutput p = ParseEveryWay(o, text);
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.tool_calls.size(), 2u);
  EXPECT_EQ(Args(p.tool_calls[0]), json({{"path", "a.py"}, {"body", body}}));
  EXPECT_EQ(Args(p.tool_calls[1]), json({{"path", "b.py"}}));
}

TEST(ToolCalls, ReasoningIsSplitOffOnlyWhereItOpens) {
  // The prompt opened it (DeepSeek-R1's generation prompt ends in <think>).
  ParsedOutput p = ParseEveryWay(Opts(ToolSyntax::kDeepseek, true), "\nhmm, 2+2\n</think>\n\n4");
  EXPECT_EQ(p.reasoning, "\nhmm, 2+2\n");
  EXPECT_EQ(p.content, "4");
  // The model opens it (Qwen3), after leading whitespace.
  p = ParseEveryWay(Opts(ToolSyntax::kQwen3), "\n<think>\nwhy\n</think>\n\nBecause.");
  EXPECT_EQ(p.reasoning, "\nwhy\n");
  EXPECT_EQ(p.content, "Because.");
  // After content, <think> is content; a second block too.
  p = ParseEveryWay(Opts(ToolSyntax::kQwen3), "Use <think> tags.</think>");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "Use <think> tags.</think>");
  // Never closed: all reasoning.
  p = ParseEveryWay(Opts(ToolSyntax::kNone), "<think>still thinking");
  EXPECT_EQ(p.reasoning, "still thinking");
  EXPECT_EQ(p.content, "");
  // Splitting off: everything is content, byte for byte.
  OutputParserOptions off = Opts(ToolSyntax::kNone, true);
  off.split_reasoning = false;
  p = ParseEveryWay(off, "<think>x</think> y");
  EXPECT_EQ(p.content, "<think>x</think> y");
}

// Text that only looks like a call stays content, byte for byte.
TEST(ToolCalls, MalformedCallsStayContent) {
  struct Case {
    ToolSyntax s;
    std::string text;
  };
  const Case cases[] = {
      {ToolSyntax::kQwen3, "Write <tool_call>{\"name\": \"f\", \"arguments\": {bad}}</tool_call>"},
      {ToolSyntax::kQwen3, "Unclosed <tool_call>{\"name\": \"f\", \"arguments\": {}}"},
      {ToolSyntax::kQwen3, "<tool_call>{\"arguments\": {}}</tool_call>"},
      {ToolSyntax::kQwen3, "<tool_call>{\"name\": \"a b\", \"arguments\": {}}</tool_call>"},
      {ToolSyntax::kQwen3, "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call> trailing"},
      {ToolSyntax::kKimiK2,
       "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>"
       "<|tool_calls_section_end|>"},
      {ToolSyntax::kKimiK2, "<|tool_calls_section_begin|><|tool_calls_section_end|>"},
      {ToolSyntax::kDeepseek,
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>"},
      {ToolSyntax::kDeepseek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f"},
      {ToolSyntax::kGlm45, "<tool_call>f<arg_key>k</arg_key>v</tool_call>"},
      {ToolSyntax::kQwen3Coder,
       "<tool_call><function=f><parameter=>x</parameter></function></tool_call>"},
      {ToolSyntax::kMixtral, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": "},
      {ToolSyntax::kMixtral, "[TOOL_CALLS] []"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const ParsedOutput p = ParseEveryWay(Opts(c.s), c.text);
    EXPECT_EQ(p.content, c.text);
    EXPECT_TRUE(p.tool_calls.empty());
  }
}

// tool_choice "required" / a named function: the prefix appended to the
// prompt, then what the model writes after it, parse as one call.
TEST(ToolCalls, ForcedPrefixesParseWithTheContinuation) {
  struct Case {
    ToolSyntax s;
    std::string name, continuation;
  };
  const Case cases[] = {
      {ToolSyntax::kQwen3, "get_weather", "{\"city\": \"Paris\"}}\n</tool_call>"},
      {ToolSyntax::kQwen3, "",
       "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"},
      {ToolSyntax::kKimiK2, "get_weather",
       "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>"},
      {ToolSyntax::kKimiK2, "",
       "get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
       "<|tool_calls_section_end|>"},
      {ToolSyntax::kDeepseek, "",
       "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>"},
      {ToolSyntax::kQwen3Coder, "get_weather",
       "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"},
      {ToolSyntax::kGlm45, "get_weather",
       "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"},
      {ToolSyntax::kMixtral, "get_weather", "{\"city\": \"Paris\"}}]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << ToolSyntaxName(c.s) << " '" << c.name << "'");
    auto prefix = ForcedToolCallPrefix(c.s, c.name);
    ASSERT_TRUE(prefix.has_value());
    const ParsedOutput p = ParseEveryWay(Opts(c.s), *prefix + c.continuation);
    EXPECT_EQ(p.content, "");
    ASSERT_EQ(p.tool_calls.size(), 1u);
    EXPECT_EQ(p.tool_calls[0].name, "get_weather");
    EXPECT_EQ(Args(p.tool_calls[0]), json({{"city", "Paris"}}));
  }
  EXPECT_FALSE(ForcedToolCallPrefix(ToolSyntax::kNone, "").has_value());
  EXPECT_FALSE(ForcedToolCallPrefix(ToolSyntax::kDeepseek, "get_weather").has_value());
  // A name with a quote is escaped where it sits in JSON.
  EXPECT_NE(ForcedToolCallPrefix(ToolSyntax::kQwen3, "a\"b")->find("\"a\\\"b\""),
            std::string::npos);
}

// Raw model bytes that are not UTF-8 inside an XML argument value (found
// by hmoe-fuzz-tool_calls: the arguments' JSON text threw): the call parses,
// the bad bytes become U+FFFD.
TEST(ToolCalls, InvalidUtf8InAnArgumentIsReplacedNotThrown) {
  // "a", 0xFF, NUL, "b".
  const std::string value = std::string("a\xff") + '\0' + "b";
  const std::string text =
      "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>" + value + "</arg_value>\n</tool_call>";
  const ParsedOutput glm = ParseEveryWay(Opts(ToolSyntax::kGlm45), text);
  ASSERT_EQ(glm.tool_calls.size(), 1u);
  EXPECT_EQ(Args(glm.tool_calls[0])["n"], std::string("a\xEF\xBF\xBD") + '\0' + "b");
  const std::string coder = std::string("<tool_call>\n<function=f>\n<parameter=k>\n\xc3") +
                            "\n</parameter>\n</function>\n</tool_call>";
  const ParsedOutput p = ParseEveryWay(Opts(ToolSyntax::kQwen3Coder), coder);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(Args(p.tool_calls[0])["k"], "\xEF\xBF\xBD");
}

// Without a syntax and reasoning, the parser passes text through untouched
// (the plain chat path), whatever it holds.
TEST(ToolCalls, PlainTextPassesThroughUntouched) {
  OutputParserOptions o = Opts(ToolSyntax::kNone);
  o.split_reasoning = false;
  std::mt19937 rng(7);
  const std::string alphabet = "<>|/thinkool_c{}\"\n ｜▁";
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (int n = rng() % 40; n > 0; --n) s += alphabet[rng() % alphabet.size()];
    EXPECT_EQ(ParseEveryWay(o, s).content, s);
  }
}

}  // namespace
}  // namespace hmoe
