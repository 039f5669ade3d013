#include "sdk/agent_replay.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace hmoe {
namespace {

// Words of a coding agent's prose and code, drawn by the seed.
constexpr const char* kWords[] = {
    "the",     "file",   "function", "returns", "error",  "test",    "build",   "value",
    "module",  "import", "class",    "method",  "when",   "then",    "check",   "path",
    "config",  "string", "list",     "update",  "before", "after",   "user",    "tool",
    "result",  "line",   "change",   "keep",    "never",  "always",  "run",     "output",
    "request", "status", "parse",    "write",   "read",   "index",   "cache",   "token",
    "if",      "else",   "for",      "while",   "return", "const",   "int",     "auto",
    "{",       "}",      "(",        ");",      "=",      "==",      "->",      "//",
    "patch",   "diff",   "commit",   "branch",  "review", "comment", "message", "reply"};

std::string Words(std::mt19937_64& rng, int64_t n) {
  std::string s;
  constexpr size_t kN = sizeof(kWords) / sizeof(kWords[0]);
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) s += (i % 16 == 0) ? "\n" : " ";
    s += kWords[rng() % kN];
  }
  return s;
}

api::v1::ChatMessage Message(const std::string& role, const std::string& content) {
  api::v1::ChatMessage m;
  m.set_role(role);
  m.set_content(content);
  return m;
}

constexpr const char* kTools[] = {"read_file", "write_file",  "run_tests", "grep",
                                  "list_dir",  "apply_patch", "git_diff",  "search_docs"};
constexpr int kNumTools = sizeof(kTools) / sizeof(kTools[0]);

}  // namespace

AgentConversation MakeAgentConversation(const AgentReplayOptions& o) {
  std::mt19937_64 rng(o.seed);
  AgentConversation c;
  c.system = Message("system",
                     "You are a coding agent. Follow these rules.\n" + Words(rng, o.system_words));
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  const int n_tools = std::clamp(o.tools, 1, kNumTools);
  for (int i = 0; i < n_tools; ++i) {
    const char* name = kTools[i];
    tools.push_back({{"type", "function"},
                     {"function",
                      {{"name", name},
                       {"description", Words(rng, 24)},
                       {"parameters",
                        {{"type", "object"},
                         {"properties",
                          {{"path", {{"type", "string"}, {"description", Words(rng, 8)}}},
                           {"text", {{"type", "string"}, {"description", Words(rng, 8)}}}}},
                         {"required", {"path"}}}}}}});
  }
  c.tools_json = tools.dump();
  for (int t = 0; t < o.turns; ++t) {
    AgentTurn turn;
    const std::string tool = kTools[t % n_tools];
    if (t % 2 == 0) {
      // The user asks; the agent answers with a tool call.
      turn.before.push_back(Message("user", Words(rng, o.turn_words)));
      turn.reply = Message("assistant", "");
      const std::string id = absl::StrCat("call_", t);
      turn.reply.set_tool_calls_json(
          nlohmann::ordered_json::array(
              {{{"id", id},
                {"type", "function"},
                {"function",
                 {{"name", tool},
                  {"arguments",
                   nlohmann::ordered_json{{"path", absl::StrCat("src/f", t, ".cc")}}.dump()}}}}})
              .dump());
    } else {
      // The tool's result; the agent answers in text.
      api::v1::ChatMessage result = Message("tool", Words(rng, o.turn_words));
      result.set_tool_call_id(absl::StrCat("call_", t - 1));
      result.set_name(kTools[(t - 1) % n_tools]);
      turn.before.push_back(result);
      turn.reply = Message("assistant", Words(rng, 40));
    }
    c.turns.push_back(std::move(turn));
  }
  return c;
}

api::v1::Chat AgentChat(const AgentConversation& c, int t) {
  api::v1::Chat chat;
  *chat.add_messages() = c.system;
  for (int i = 0; i <= t; ++i) {
    for (const api::v1::ChatMessage& m : c.turns[static_cast<size_t>(i)].before)
      *chat.add_messages() = m;
    if (i < t) *chat.add_messages() = c.turns[static_cast<size_t>(i)].reply;
  }
  chat.set_tools_json(c.tools_json);
  return chat;
}

}  // namespace hmoe
