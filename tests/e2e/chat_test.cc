// The messages form of the gRPC API (GenerateRequest.chat) and `hmoe chat`
// on it: the worker renders the model's chat template (the fortunes
// fixture's), as the HTTP API's chat completions do.
#include <stdio.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/serving_pair.h"

namespace hmoe {
namespace {

std::string Fixture(const std::string& name) {
  return std::string(HMOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

api::v1::ChatMessage Msg(const std::string& role, const std::string& content) {
  api::v1::ChatMessage m;
  m.set_role(role);
  m.set_content(content);
  return m;
}

TEST(GrpcChat, MessagesAreRenderedByTheModelsTemplate) {
  testing::Pair p;
  ASSERT_TRUE(p.Start(Fixture("ds3_fortunes")));
  auto info = p.client().ModelInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->has_chat_template());

  // What the fixture's template makes of this conversation, as token ids.
  const std::string rendered =
      "<|begin▁of▁sentence|>Be brief.\n\nUser: Hello\nAssistant: Hi there<|end▁of▁sentence|>\n"
      "User: A fortune?\nAssistant:";
  auto ids = p.client().Tokenize(rendered, false);
  ASSERT_TRUE(ids.ok());
  api::v1::GenerateRequest by_ids;
  for (int32_t t : *ids) by_ids.mutable_prompt_ids()->add_ids(t);
  by_ids.set_max_tokens(8);
  by_ids.mutable_sampling()->set_temperature(0);
  auto want = p.client().Generate(by_ids);
  ASSERT_TRUE(want.ok()) << want.status();

  api::v1::GenerateRequest chat = by_ids;
  chat.clear_prompt_ids();
  for (auto m : {Msg("system", "Be brief."), Msg("user", "Hello"), Msg("assistant", "Hi there"),
                 Msg("user", "A fortune?")})
    *chat.mutable_chat()->add_messages() = m;
  auto got = p.client().Generate(chat);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->token_ids, want->token_ids);
  EXPECT_EQ(got->usage.prompt_tokens(), static_cast<int64_t>(ids->size()));

  // Without the generation prompt the text ends after the last turn.
  chat.mutable_chat()->set_add_generation_prompt(false);
  auto no_prompt = p.client().Generate(chat);
  ASSERT_TRUE(no_prompt.ok());
  auto shorter = p.client().Tokenize(rendered.substr(0, rendered.size() - 10), false);
  ASSERT_TRUE(shorter.ok());
  EXPECT_EQ(no_prompt->usage.prompt_tokens(), static_cast<int64_t>(shorter->size()));

  struct Bad {
    std::function<void(api::v1::Chat*)> edit;
    const char* message;
  };
  const Bad bad[] = {
      {[](api::v1::Chat* c) { c->clear_messages(); }, "chat.messages: empty"},
      {[](api::v1::Chat* c) { c->mutable_messages(0)->clear_role(); }, "chat.messages[0].role"},
      {[](api::v1::Chat* c) { c->set_tools_json("{"); }, "chat.tools_json"},
      {[](api::v1::Chat* c) { c->set_template_kwargs_json("[1]"); }, "chat.template_kwargs_json"},
      {[](api::v1::Chat* c) { c->mutable_messages(1)->set_role("tool"); },
       "chat template raised: Unknown role: tool"},
      {[](api::v1::Chat* c) { c->mutable_messages(1)->set_content("\xff\xfe"); }, "chat"},
  };
  for (const Bad& b : bad) {
    api::v1::GenerateRequest r = chat;
    b.edit(r.mutable_chat());
    auto res = p.client().Generate(r);
    ASSERT_FALSE(res.ok()) << b.message;
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
    EXPECT_NE(res.status().message().find(b.message), std::string::npos) << res.status();
  }
}

TEST(GrpcChat, AModelWithoutATemplateRefusesChatNamingWhy) {
  testing::Pair p;
  ASSERT_TRUE(p.Start(Fixture("mixtral_tiny")));
  auto info = p.client().ModelInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->has_chat_template());
  api::v1::GenerateRequest r;
  *r.mutable_chat()->add_messages() = Msg("user", "hi");
  r.set_max_tokens(2);
  auto res = p.client().Generate(r);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(res.status().message().find("no chat template"), std::string::npos) << res.status();
}

// `hmoe chat` keeps the conversation as messages: two turns, the second
// answered with the first in its history.
TEST(GrpcChat, HmoeChatSendsTheConversation) {
  testing::Pair p;
  ASSERT_TRUE(p.Start(Fixture("ds3_fortunes")));
  const std::string cmd = absl::StrCat("printf 'Hello\\nA fortune?\\n' | ", HMOE_BINARY_DIR,
                                       "/bin/hmoe chat --server ", p.worker().target(),
                                       " --temperature 0 --max-tokens 6 --system 'Be brief.' 2>&1");
  FILE* f = ::popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
  EXPECT_EQ(::pclose(f), 0) << out;
  // The second reply is what the worker makes of the whole conversation.
  api::v1::GenerateRequest first;
  first.set_max_tokens(6);
  first.mutable_sampling()->set_temperature(0);
  for (auto m : {Msg("system", "Be brief."), Msg("user", "Hello")})
    *first.mutable_chat()->add_messages() = m;
  auto r1 = p.client().Generate(first);
  ASSERT_TRUE(r1.ok());
  api::v1::GenerateRequest second = first;
  *second.mutable_chat()->add_messages() = Msg("assistant", r1->text);
  *second.mutable_chat()->add_messages() = Msg("user", "A fortune?");
  auto r2 = p.client().Generate(second);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(out, r1->text + "\n" + r2->text + "\n");
}

// `hmoe bench-agent` replays its turns against the worker (the Qwen3
// template, which renders tool turns and tools): one row per turn, each
// turn's prompt extending the last one's by what the turn added, every
// turn decoding --max-tokens.
TEST(GrpcChat, BenchAgentReplaysTheTurns) {
  testing::Pair p;
  ASSERT_TRUE(p.Start(Fixture("ds3_fortunes"), 1, "tp", "shm",
                      {absl::StrCat("--chat-template=", Fixture("chat_templates/qwen3.jinja"))}));
  const std::string json = p.file("agent.json");
  const std::string cmd =
      absl::StrCat(HMOE_BINARY_DIR, "/bin/hmoe bench-agent --server ", p.worker().target(),
                   " --turns 4 --tools 1 --system-words 40 --turn-words 12 --max-tokens 3 --label "
                   "'cache off' --json ",
                   json, " 2>&1");
  FILE* f = ::popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
  ASSERT_EQ(::pclose(f), 0) << out;
  EXPECT_NE(out.find("bench-agent (cache off): 4 turns"), std::string::npos) << out;
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << out;
  ASSERT_EQ(j["rows"].size(), 4u) << j.dump();
  int64_t last = 0;
  for (const auto& row : j["rows"]) {
    EXPECT_EQ(row["completion_tokens"], 3);
    EXPECT_GT(row["prompt_tokens"].get<int64_t>(), last);
    EXPECT_EQ(row["new_prompt_tokens"].get<int64_t>(), row["prompt_tokens"].get<int64_t>() - last);
    EXPECT_GT(row["first_token_ms"].get<double>(), 0);
    last = row["prompt_tokens"].get<int64_t>();
  }
  // The system prompt and tools come first: turn 1 holds most of its prompt.
  EXPECT_GT(j["rows"][0]["prompt_tokens"].get<int64_t>(),
            j["rows"][1]["new_prompt_tokens"].get<int64_t>());
}

}  // namespace
}  // namespace hmoe
