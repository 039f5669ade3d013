#include "common/text/tool_calls.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace hmoe {
namespace {

using json = nlohmann::json;
using Calls = std::vector<ToolCall>;

constexpr absl::string_view kThinkOpen = "<think>";
constexpr absl::string_view kThinkClose = "</think>";

// ---- pieces shared by the syntaxes ------------------------------------------

absl::string_view TrimWs(absl::string_view s) {
  return absl::StripTrailingAsciiWhitespace(absl::StripLeadingAsciiWhitespace(s));
}

// `s` from `pos` on starts with `token` (after whitespace): moves pos past it.
bool Expect(absl::string_view s, size_t* pos, absl::string_view token) {
  size_t p = *pos;
  while (p < s.size() && absl::ascii_isspace(static_cast<unsigned char>(s[p]))) ++p;
  if (s.substr(p, token.size()) != token) return false;
  *pos = p + token.size();
  return true;
}

// The text from *pos up to `end` (exclusive); *pos moves past `end`.
bool Until(absl::string_view s, size_t* pos, absl::string_view end, absl::string_view* out) {
  const size_t e = s.find(end, *pos);
  if (e == absl::string_view::npos) return false;
  *out = s.substr(*pos, e - *pos);
  *pos = e + end.size();
  return true;
}

size_t Find(const std::string& s, absl::string_view m, size_t pos = 0) {
  return s.find(m.data(), pos, m.size());
}

bool OnlyWs(absl::string_view s, size_t pos) { return TrimWs(s.substr(pos)).empty(); }

std::optional<json> ParseJson(absl::string_view text) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// JSON text; invalid UTF-8 in a string (model output is raw bytes) becomes
// U+FFFD instead of an exception.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Arguments as OpenAI returns them: a JSON object's text. A JSON string
// holding an object's text (a template that wrote string arguments with
// tojson) is that object.
bool ArgumentsText(const json& v, std::string* out) {
  if (v.is_string()) {
    auto inner = ParseJson(v.get<std::string>());
    if (!inner || !inner->is_object()) return false;
    *out = Dump(*inner);
    return true;
  }
  if (!v.is_object()) return false;
  *out = Dump(v);
  return true;
}

bool ArgumentsFromText(absl::string_view text, std::string* out) {
  auto v = ParseJson(TrimWs(text));
  return v && ArgumentsText(*v, out);
}

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  for (const char c : name)
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == '<' || c == '>' || c == '"')
      return false;
  return true;
}

// The JSON type a tool's schema gives parameter `key` of function `name`
// ("" when the tools do not say).
std::string ParamType(const json& tools, absl::string_view name, const std::string& key) {
  if (!tools.is_array()) return "";
  for (const json& t : tools) {
    if (!t.is_object()) continue;
    const json* f = t.contains("function") ? &t["function"] : &t;
    if (!f->is_object() || !f->contains("name") || !(*f)["name"].is_string() ||
        (*f)["name"].get<std::string>() != name)
      continue;
    const json* props = nullptr;
    for (const char* field : {"parameters", "input_schema"})
      if (f->contains(field) && (*f)[field].is_object() && (*f)[field].contains("properties"))
        props = &(*f)[field]["properties"];
    if (props == nullptr || !props->is_object() || !props->contains(key)) return "";
    const json& p = (*props)[key];
    return p.is_object() && p.contains("type") && p["type"].is_string()
               ? p["type"].get<std::string>()
               : "";
  }
  return "";
}

// An XML-style argument value: a string where the schema says so (or the
// text is no JSON), else the JSON it spells.
json XmlValue(const json& tools, absl::string_view fn, const std::string& key,
              absl::string_view text) {
  if (ParamType(tools, fn, key) != "string") {
    if (auto v = ParseJson(TrimWs(text))) return *v;
  }
  return std::string(text);
}

// ---- one parse function per syntax: a whole section -> its calls -----------

constexpr absl::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr absl::string_view kDsCallsEnd = "<｜tool▁calls▁end｜>";
constexpr absl::string_view kDsCallBegin = "<｜tool▁call▁begin｜>";
constexpr absl::string_view kDsCallEnd = "<｜tool▁call▁end｜>";
constexpr absl::string_view kDsSep = "<｜tool▁sep｜>";

// A section of calls: BEGIN (CALL_BEGIN body CALL_END)+ END, whitespace
// between; each body through `call`, which appends its call.
struct SectionMarkers {
  absl::string_view begin, end, call_begin, call_end;
};
template <typename F>
bool ForEachCall(absl::string_view s, const SectionMarkers& m, Calls* calls, F&& call) {
  size_t pos = 0;
  if (!Expect(s, &pos, m.begin)) return false;
  for (;;) {
    if (Expect(s, &pos, m.end)) return OnlyWs(s, pos) && !calls->empty();
    absl::string_view body;
    if (!Expect(s, &pos, m.call_begin) || !Until(s, &pos, m.call_end, &body)) return false;
    ToolCall c;
    if (!call(body, &c) || !ValidName(c.name)) return false;
    calls->push_back(std::move(c));
  }
}

bool ParseDeepseek(absl::string_view s, const json&, Calls* calls) {
  return ForEachCall(
      s, {kDsCallsBegin, kDsCallsEnd, kDsCallBegin, kDsCallEnd}, calls,
      [](absl::string_view body, ToolCall* c) {
        const size_t sep = body.find(kDsSep);
        if (sep == absl::string_view::npos) return false;
        const absl::string_view left = body.substr(0, sep);
        const absl::string_view right = body.substr(sep + kDsSep.size());
        absl::string_view args = right;
        if (left == "function") {  // V3 / R1: NAME, then a ```json fenced block
          const size_t nl = right.find('\n');
          if (nl == absl::string_view::npos) return false;
          c->name = std::string(TrimWs(right.substr(0, nl)));
          args = TrimWs(right.substr(nl + 1));
          if (!absl::ConsumePrefix(&args, "```json") || !absl::ConsumeSuffix(&args, "```"))
            return false;
        } else {  // V3.1: NAME<sep>ARGS
          c->name = std::string(TrimWs(left));
        }
        return ArgumentsFromText(args, &c->arguments);
      });
}

constexpr absl::string_view kKimiSectionBegin = "<|tool_calls_section_begin|>";
constexpr absl::string_view kKimiSectionEnd = "<|tool_calls_section_end|>";
constexpr absl::string_view kKimiCallBegin = "<|tool_call_begin|>";
constexpr absl::string_view kKimiCallEnd = "<|tool_call_end|>";
constexpr absl::string_view kKimiArgBegin = "<|tool_call_argument_begin|>";

bool ParseKimi(absl::string_view s, const json&, Calls* calls) {
  return ForEachCall(s, {kKimiSectionBegin, kKimiSectionEnd, kKimiCallBegin, kKimiCallEnd}, calls,
                     [](absl::string_view body, ToolCall* c) {
                       const size_t a = body.find(kKimiArgBegin);
                       if (a == absl::string_view::npos) return false;
                       c->id = std::string(TrimWs(body.substr(0, a)));
                       // "functions.NAME:INDEX"
                       absl::string_view name = c->id;
                       absl::ConsumePrefix(&name, "functions.");
                       const size_t colon = name.rfind(':');
                       if (colon != absl::string_view::npos) name = name.substr(0, colon);
                       c->name = std::string(name);
                       return ArgumentsFromText(body.substr(a + kKimiArgBegin.size()),
                                                &c->arguments);
                     });
}

constexpr absl::string_view kToolCallOpen = "<tool_call>";
constexpr absl::string_view kToolCallClose = "</tool_call>";

// The text between <tool_call> and </tool_call>.
bool ToolCallBody(absl::string_view s, absl::string_view* body) {
  size_t pos = 0;
  return Expect(s, &pos, kToolCallOpen) && Until(s, &pos, kToolCallClose, body) && OnlyWs(s, pos);
}

bool ParseQwen3(absl::string_view s, const json&, Calls* calls) {
  absl::string_view body;
  if (!ToolCallBody(s, &body)) return false;
  auto v = ParseJson(TrimWs(body));
  if (!v || !v->is_object() || !v->contains("name") || !(*v)["name"].is_string()) return false;
  ToolCall c;
  c.name = (*v)["name"].get<std::string>();
  const char* field = v->contains("arguments") ? "arguments" : "parameters";
  const json args = v->contains(field) ? (*v)[field] : json::object();
  if (!ValidName(c.name) || !ArgumentsText(args, &c.arguments)) return false;
  calls->push_back(std::move(c));
  return true;
}

// A value between XML-ish tags keeps its text but for one newline on each
// side (how the templates lay them out).
absl::string_view XmlText(absl::string_view v) {
  absl::ConsumePrefix(&v, "\n");
  absl::ConsumeSuffix(&v, "\n");
  return v;
}

bool ParseQwen3Coder(absl::string_view s, const json& tools, Calls* calls) {
  absl::string_view body;
  if (!ToolCallBody(s, &body)) return false;
  size_t pos = 0;
  absl::string_view name, inner;
  if (!Expect(body, &pos, "<function=") || !Until(body, &pos, ">", &name) ||
      !Until(body, &pos, "</function>", &inner) || !OnlyWs(body, pos))
    return false;
  ToolCall c;
  c.name = std::string(name);
  if (!ValidName(c.name)) return false;
  json args = json::object();
  size_t p = 0;
  while (!OnlyWs(inner, p)) {
    absl::string_view key, value;
    if (!Expect(inner, &p, "<parameter=") || !Until(inner, &p, ">", &key) ||
        !Until(inner, &p, "</parameter>", &value) || key.empty())
      return false;
    const std::string k(key);
    args[k] = XmlValue(tools, c.name, k, XmlText(value));
  }
  c.arguments = Dump(args);
  calls->push_back(std::move(c));
  return true;
}

bool ParseGlm45(absl::string_view s, const json& tools, Calls* calls) {
  absl::string_view body;
  if (!ToolCallBody(s, &body)) return false;
  const size_t first = body.find("<arg_key>");
  ToolCall c;
  c.name = std::string(TrimWs(body.substr(0, first)));
  if (!ValidName(c.name)) return false;
  json args = json::object();
  size_t p = first == absl::string_view::npos ? body.size() : first;
  while (!OnlyWs(body, p)) {
    absl::string_view key, value;
    if (!Expect(body, &p, "<arg_key>") || !Until(body, &p, "</arg_key>", &key) ||
        !Expect(body, &p, "<arg_value>") || !Until(body, &p, "</arg_value>", &value))
      return false;
    const std::string k(TrimWs(key));
    if (k.empty()) return false;
    args[k] = XmlValue(tools, c.name, k, value);
  }
  c.arguments = Dump(args);
  calls->push_back(std::move(c));
  return true;
}

constexpr absl::string_view kMixtralCalls = "[TOOL_CALLS]";

bool ParseMixtral(absl::string_view s, const json&, Calls* calls) {
  size_t pos = 0;
  if (!Expect(s, &pos, kMixtralCalls)) return false;
  auto v = ParseJson(TrimWs(s.substr(pos)));
  if (!v) return false;
  const json list = v->is_array() ? *v : json::array({*v});
  if (list.empty()) return false;
  for (const json& e : list) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string()) return false;
    ToolCall c;
    c.name = e["name"].get<std::string>();
    if (e.contains("id") && e["id"].is_string()) c.id = e["id"].get<std::string>();
    const json args = e.contains("arguments") ? e["arguments"] : json::object();
    if (!ValidName(c.name) || !ArgumentsText(args, &c.arguments)) return false;
    calls->push_back(std::move(c));
  }
  return true;
}

// ---- the table ---------------------------------------------------------------

struct SyntaxRow {
  ToolSyntax syntax;
  absl::string_view name;
  absl::string_view open;   // a section starts
  absl::string_view close;  // it ends ("": with the text)
  absl::string_view mark;   // in a chat template: it writes this syntax
  bool (*parse)(absl::string_view section, const json& tools, Calls* calls);
};

// Template detection tries the rows in order: the more specific markers of
// the <tool_call> family first.
constexpr SyntaxRow kToolSyntaxes[] = {
    {ToolSyntax::kDeepseek, "deepseek", kDsCallsBegin, kDsCallsEnd, kDsCallsBegin, ParseDeepseek},
    {ToolSyntax::kKimiK2, "kimi_k2", kKimiSectionBegin, kKimiSectionEnd, kKimiSectionBegin,
     ParseKimi},
    {ToolSyntax::kQwen3Coder, "qwen3_coder", kToolCallOpen, kToolCallClose,
     "<function=", ParseQwen3Coder},
    {ToolSyntax::kGlm45, "glm45", kToolCallOpen, kToolCallClose, "<arg_key>", ParseGlm45},
    {ToolSyntax::kQwen3, "qwen3", kToolCallOpen, kToolCallClose, kToolCallOpen, ParseQwen3},
    {ToolSyntax::kMixtral, "mixtral", kMixtralCalls, "", kMixtralCalls, ParseMixtral},
};

const SyntaxRow* RowOf(ToolSyntax s) {
  for (const SyntaxRow& r : kToolSyntaxes)
    if (r.syntax == s) return &r;
  return nullptr;
}

// The length of the longest suffix of `s` that is a proper prefix of `m`.
size_t PartialSuffix(absl::string_view s, absl::string_view m) {
  for (size_t n = std::min(s.size(), m.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == m.substr(0, n)) return n;
  return 0;
}

}  // namespace

absl::StatusOr<ToolSyntax> ParseToolSyntax(absl::string_view name) {
  if (name == "none") return ToolSyntax::kNone;
  std::vector<absl::string_view> known = {"none"};
  for (const SyntaxRow& r : kToolSyntaxes) {
    if (r.name == name) return r.syntax;
    known.push_back(r.name);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown tool-call syntax \"", name,
                                                 "\" (known: ", absl::StrJoin(known, ", "), ")"));
}

absl::string_view ToolSyntaxName(ToolSyntax s) {
  const SyntaxRow* r = RowOf(s);
  return r == nullptr ? "none" : r->name;
}

ToolSyntax ToolSyntaxOfTemplate(absl::string_view chat_template) {
  for (const SyntaxRow& r : kToolSyntaxes)
    if (absl::StrContains(chat_template, r.mark)) return r.syntax;
  return ToolSyntax::kNone;
}

OutputParser::OutputParser(OutputParserOptions o) : o_(std::move(o)) {
  const bool reasoning = o_.starts_in_reasoning && o_.split_reasoning;
  state_ = reasoning ? State::kReasoning : State::kContent;
  think_allowed_ = o_.split_reasoning && !reasoning;
}

void OutputParser::EmitContent(absl::string_view s, OutputDelta* d) {
  if (s.empty()) return;
  d->content.append(s.data(), s.size());
  out_.content.append(s.data(), s.size());
  if (!TrimWs(s).empty()) think_allowed_ = false;
}

bool OutputParser::TakeSection(absl::string_view section, OutputDelta* d) {
  Calls calls;
  const SyntaxRow* row = RowOf(o_.syntax);
  if (row == nullptr || !row->parse(section, o_.tools, &calls)) return false;
  if (d->tool_calls.empty()) d->first_call_index = static_cast<int>(out_.tool_calls.size());
  for (ToolCall& c : calls) {
    out_.tool_calls.push_back(c);
    d->tool_calls.push_back(std::move(c));
  }
  return true;
}

void OutputParser::Step(OutputDelta* d, bool final) {
  const SyntaxRow* row = RowOf(o_.syntax);
  for (;;) {
    if (state_ == State::kReasoning) {
      const size_t e = Find(buf_, kThinkClose);
      if (e == std::string::npos) {
        const size_t keep = final ? 0 : PartialSuffix(buf_, kThinkClose);
        const absl::string_view shown = absl::string_view(buf_).substr(0, buf_.size() - keep);
        d->reasoning.append(shown.data(), shown.size());
        out_.reasoning.append(shown.data(), shown.size());
        buf_.erase(0, shown.size());
        return;
      }
      d->reasoning.append(buf_, 0, e);
      out_.reasoning.append(buf_, 0, e);
      buf_.erase(0, e + kThinkClose.size());
      state_ = State::kContent;
      think_allowed_ = false;
      skip_ws_ = true;  // the blank lines after </think> are layout
      continue;
    }
    if (state_ == State::kSection) {
      // buf_ starts with the row's open marker.
      size_t end = std::string::npos;
      if (!row->close.empty()) {
        const size_t c = Find(buf_, row->close, row->open.size());
        if (c != std::string::npos) end = c + row->close.size();
      } else if (final) {
        end = buf_.size();
      }
      if (end == std::string::npos) {
        if (!final) return;
        end = buf_.size();  // never closed: content
      }
      const std::string section = buf_.substr(0, end);
      buf_.erase(0, end);
      // Whitespace between calls (and after the last) is layout, not content.
      if (TakeSection(section, d))
        skip_ws_ = true;
      else
        EmitContent(section, d);
      state_ = State::kContent;
      continue;
    }
    // kContent.
    if (skip_ws_) {
      const size_t ws = buf_.find_first_not_of(" \t\r\n");
      buf_.erase(0, ws == std::string::npos ? buf_.size() : ws);
      if (buf_.empty()) return;
      skip_ws_ = false;
    }
    size_t open = std::string::npos;
    if (row != nullptr) open = Find(buf_, row->open);
    // A reasoning block opens only before any content.
    size_t think = std::string::npos;
    if (think_allowed_) {
      const size_t t = Find(buf_, kThinkOpen);
      if (t != std::string::npos && TrimWs(absl::string_view(buf_).substr(0, t)).empty()) think = t;
    }
    if (think != std::string::npos && (open == std::string::npos || think < open)) {
      buf_.erase(0, think + kThinkOpen.size());
      state_ = State::kReasoning;
      think_allowed_ = false;
      continue;
    }
    if (open != std::string::npos) {
      EmitContent(absl::string_view(buf_).substr(0, open), d);
      buf_.erase(0, open);
      state_ = State::kSection;
      continue;
    }
    size_t keep = 0;
    if (!final) {
      if (row != nullptr) keep = PartialSuffix(buf_, row->open);
      if (think_allowed_) {
        keep = std::max(keep, PartialSuffix(buf_, kThinkOpen));
        // Leading whitespace may still come before <think>.
        if (TrimWs(absl::string_view(buf_).substr(0, buf_.size() - keep)).empty())
          keep = buf_.size();
      }
    }
    EmitContent(absl::string_view(buf_).substr(0, buf_.size() - keep), d);
    buf_.erase(0, buf_.size() - keep);
    return;
  }
}

OutputDelta OutputParser::Feed(absl::string_view text) {
  OutputDelta d;
  buf_.append(text.data(), text.size());
  Step(&d, false);
  return d;
}

OutputDelta OutputParser::Finish() {
  OutputDelta d;
  Step(&d, true);
  return d;
}

ParsedOutput ParseOutput(const OutputParserOptions& o, absl::string_view text) {
  OutputParser p(o);
  p.Feed(text);
  p.Finish();
  return p.result();
}

std::optional<std::string> ForcedToolCallPrefix(ToolSyntax s, absl::string_view function_name) {
  const std::string quoted = Dump(json(std::string(function_name)));  // "name", escaped
  const bool any = function_name.empty();
  switch (s) {
    case ToolSyntax::kDeepseek:
      // V3 and V3.1 differ after the call's opening token: no name then.
      if (!any) return std::nullopt;
      return absl::StrCat(kDsCallsBegin, kDsCallBegin);
    case ToolSyntax::kKimiK2:
      return absl::StrCat(kKimiSectionBegin, kKimiCallBegin, "functions.",
                          any ? "" : absl::StrCat(function_name, ":0", kKimiArgBegin));
    case ToolSyntax::kQwen3:
      return any ? absl::StrCat(kToolCallOpen, "\n{\"name\": ")
                 : absl::StrCat(kToolCallOpen, "\n{\"name\": ", quoted, ", \"arguments\": ");
    case ToolSyntax::kQwen3Coder:
      return absl::StrCat(kToolCallOpen,
                          "\n<function=", any ? "" : absl::StrCat(function_name, ">\n"));
    case ToolSyntax::kGlm45:
      return absl::StrCat(kToolCallOpen, any ? "" : absl::StrCat(function_name, "\n"));
    case ToolSyntax::kMixtral:
      return any ? absl::StrCat(kMixtralCalls, " [{\"name\": ")
                 : absl::StrCat(kMixtralCalls, " [{\"name\": ", quoted, ", \"arguments\": ");
    case ToolSyntax::kNone:
      break;
  }
  return std::nullopt;
}

}  // namespace hmoe
