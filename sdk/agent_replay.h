// The conversation `hmoe bench-agent` replays: what a coding agent sends a
// server turn after turn. Synthetic and deterministic (a seed): a long
// system prompt, tool definitions, then turns that each add a user message
// or a tool's result to the history, and after each request the recorded
// assistant reply (text or a tool call) -- never the model's own, so every
// run sends the same prompts and a turn's prompt extends the last one's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/api.pb.h"

namespace hmoe {

struct AgentReplayOptions {
  int turns = 20;
  int64_t system_words = 15000;  // ~20K tokens of instructions with a BPE tokenizer
  int64_t turn_words = 250;      // each turn's new user text or tool result
  int tools = 8;                 // tool definitions (1 to 8)
  uint64_t seed = 1;
};

struct AgentTurn {
  std::vector<api::v1::ChatMessage> before;  // added to the history, then the request
  api::v1::ChatMessage reply;                // the recorded reply, added after it
};

struct AgentConversation {
  api::v1::ChatMessage system;
  std::string tools_json;  // OpenAI's tools array
  std::vector<AgentTurn> turns;
};

AgentConversation MakeAgentConversation(const AgentReplayOptions& o);

// The chat of turn `t` (0-based): system, every earlier turn's messages and
// reply, then turn t's messages.
api::v1::Chat AgentChat(const AgentConversation& c, int t);

}  // namespace hmoe
