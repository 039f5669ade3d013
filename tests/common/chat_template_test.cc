// ChatTemplate (common/text/chat_template.h): the real templates of DeepSeek-V3,
// DeepSeek-R1, Qwen3, Mixtral-8x7B-Instruct and Kimi-K2 must render every
// conversation in tests/fixtures/chat_templates/cases.json byte for byte as
// transformers' apply_chat_template did (make_fixtures.py), and loading
// follows transformers' rules.
#include "common/text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::ordered_json;

std::string Dir() { return testing::FixturesDir() + "/chat_templates"; }

void Write(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f << text;
}

TEST(ChatTemplateTest, RealTemplatesMatchTransformersByteForByte) {
  std::ifstream f(Dir() + "/cases.json");
  std::stringstream ss;
  ss << f.rdbuf();
  const json fixture = json::parse(ss.str());
  std::map<std::string, ChatTemplate> loaded;
  int rendered = 0, errors = 0;
  for (const auto& c : fixture["cases"]) {
    const std::string model = c["model"].get<std::string>();
    SCOPED_TRACE(model + "/" + c["name"].get<std::string>());
    if (!loaded.count(model)) {
      auto ct = ChatTemplate::FromModelDir(Dir() + "/" + model);
      ASSERT_TRUE(ct.ok()) << ct.status();
      loaded.emplace(model, std::move(*ct));
    }
    ChatRenderOptions opts;
    opts.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    if (c.contains("tools")) opts.tools = c["tools"];
    if (c.contains("extra_context")) opts.extra_context = c["extra_context"];
    auto out = loaded.at(model).Render(c["messages"], opts);
    if (c.contains("expected")) {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, c["expected"].get<std::string>());
      ++rendered;
    } else {
      ASSERT_FALSE(out.ok()) << *out;
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(out.status().message()),
                  HasSubstr(c["expected_error"].get<std::string>()));
      ++errors;
    }
  }
  EXPECT_EQ(loaded.size(), 5u);
  EXPECT_GE(rendered, 55);
  EXPECT_GE(errors, 3);
}

TEST(ChatTemplateTest, ExposesSpecialTokensAsTransformersDoes) {
  auto ct = ChatTemplate::FromModelDir(Dir() + "/deepseek_v3");
  ASSERT_TRUE(ct.ok()) << ct.status();
  EXPECT_EQ(ct->special_tokens().at("bos_token"),
            "<\xef\xbd\x9c"
            "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>");
  auto qwen = ChatTemplate::FromModelDir(Dir() + "/qwen3");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->special_tokens().count("bos_token"), 0u);  // null in the config
  EXPECT_EQ(qwen->special_tokens().at("eos_token"), "<|im_end|>");
}

TEST(ChatTemplateTest, ChatTemplateJinjaTakesPriorityOverTheConfig) {
  testing::TempDir dir;
  Write(dir.file("tokenizer_config.json"),
        R"({"chat_template": "from config", "bos_token": {"content": "<B>"}, "eos_token": "<E>"})");
  Write(dir.file("chat_template.jinja"), "from file {{ bos_token }}{{ eos_token }}\n");
  auto ct = ChatTemplate::FromModelDir(dir.path());
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto out = ct->Render(json::array({{{"role", "user"}, {"content", "x"}}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "from file <B><E>");
}

TEST(ChatTemplateTest, SpecialTokensMapOverridesTheConfig) {
  testing::TempDir dir;
  Write(dir.file("tokenizer_config.json"),
        R"({"chat_template": "{{ bos_token }}", "bos_token": "<a>"})");
  Write(dir.file("special_tokens_map.json"),
        R"({"bos_token": {"content": "<b>", "lstrip": false}})");
  auto ct = ChatTemplate::FromModelDir(dir.path());
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto out = ct->Render(json::array({{{"role", "user"}, {"content", "x"}}}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<b>");
}

TEST(ChatTemplateTest, NamedTemplatesPickToolUseWhenToolsAreGiven) {
  testing::TempDir dir;
  Write(dir.file("tokenizer_config.json"), R"({"chat_template": [
      {"name": "default", "template": "default:{{ messages|length }}"},
      {"name": "tool_use", "template": "tools:{{ tools|length }}"},
      {"name": "rag", "template": "rag"}]})");
  auto ct = ChatTemplate::FromModelDir(dir.path());
  ASSERT_TRUE(ct.ok()) << ct.status();
  const json msgs = json::array({{{"role", "user"}, {"content", "x"}}});
  EXPECT_EQ(*ct->Render(msgs), "default:1");
  ChatRenderOptions with_tools;
  with_tools.tools = json::array({{{"type", "function"}}});
  EXPECT_EQ(*ct->Render(msgs, with_tools), "tools:1");
  ChatRenderOptions named;
  named.template_name = "rag";
  EXPECT_EQ(*ct->Render(msgs, named), "rag");
  named.template_name = "nope";
  EXPECT_EQ(ct->Render(msgs, named).status().code(), absl::StatusCode::kNotFound);
}

TEST(ChatTemplateTest, AdditionalTemplateFiles) {
  testing::TempDir dir;
  Write(dir.file("chat_template.jinja"), "d");
  Write(dir.file("additional_chat_templates/tool_use.jinja"), "t");
  auto ct = ChatTemplate::FromModelDir(dir.path());
  ASSERT_TRUE(ct.ok()) << ct.status();
  const json msgs = json::array({{{"role", "user"}, {"content", "x"}}});
  EXPECT_EQ(*ct->Render(msgs), "d");
  ChatRenderOptions with_tools;
  with_tools.tools = json::array();
  EXPECT_EQ(*ct->Render(msgs, with_tools), "t");
}

// Render's errors reach API clients: the template file is named relative to
// the model directory, not by the server's path.
TEST(ChatTemplateTest, RenderErrorsDoNotShowTheServersPath) {
  testing::TempDir dir;
  Write(dir.file("chat_template.jinja"), "{{ messages[0].content.no_such_method() }}");
  auto ct = ChatTemplate::FromModelDir(dir.path());
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto out = ct->Render(json::array({{{"role", "user"}, {"content", "x"}}}));
  ASSERT_FALSE(out.ok());
  const std::string m(out.status().message());
  EXPECT_THAT(m, HasSubstr("chat_template.jinja"));
  EXPECT_THAT(m, ::testing::Not(HasSubstr(dir.path())));
}

TEST(ChatTemplateTest, ErrorsNameTheFileAndField) {
  testing::TempDir dir;
  EXPECT_EQ(ChatTemplate::FromModelDir(dir.file("missing")).status().code(),
            absl::StatusCode::kNotFound);
  auto st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);

  Write(dir.file("tokenizer_config.json"), "{not json");
  st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("tokenizer_config.json: not valid JSON"));

  Write(dir.file("tokenizer_config.json"), R"({"chat_template": 5})");
  st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("tokenizer_config.json: field 'chat_template' must be"));

  Write(dir.file("tokenizer_config.json"), R"({"chat_template": "x", "eos_token": 7})");
  st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_THAT(std::string(st.message()), HasSubstr("tokenizer_config.json: field 'eos_token'"));

  Write(dir.file("tokenizer_config.json"), R"({"chat_template": "line1\n{% include 'x' %}"})");
  st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(st.message()),
      HasSubstr(
          "tokenizer_config.json: field 'chat_template':2:4: unsupported construct: 'include'"));

  Write(dir.file("tokenizer_config.json"), R"({"chat_template": [{"name": "default"}]})");
  st = ChatTemplate::FromModelDir(dir.path()).status();
  EXPECT_THAT(std::string(st.message()), HasSubstr("field 'chat_template'[0] must be an object"));
}

TEST(ChatTemplateTest, FromStringAndMessageNormalization) {
  auto ct = ChatTemplate::FromString(
      "{{ bos_token }}{% for m in messages %}{{ m|tojson }}{% endfor %}{{ eos_token }}", "<s>",
      "</s>");
  ASSERT_TRUE(ct.ok()) << ct.status();
  // Null values are dropped; reasoning is aliased to thinking / reasoning_content.
  const json msgs = json::parse(
      R"([{"role": "assistant", "content": null, "reasoning": "r", "tool_calls": null}])");
  auto out = ct->Render(msgs);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(
      *out,
      R"(<s>{"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}</s>)");
  EXPECT_EQ(ct->Render(json::array()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ct->Render(json::object()).status().code(), absl::StatusCode::kInvalidArgument);
  ChatRenderOptions bad;
  bad.extra_context = {{"messages", 1}};
  EXPECT_EQ(ct->Render(msgs, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// A template limit hit by a request's own input is the request's fault: a
// retry hits it again, so it is not RESOURCE_EXHAUSTED (429, "retry").
TEST(ChatTemplateTest, ALimitHitByTheRequestIsInvalidArgument) {
  ChatTemplateOptions o;
  o.limits.max_output_bytes = 64;
  auto ct = ChatTemplate::FromString("{% for m in messages %}{{ m.content }}{% endfor %}",
                                     std::nullopt, std::nullopt, o);
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto tok = Tokenizer::FromFile(testing::FixturesDir() + "/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const json msgs = {{{"role", "user"}, {"content", std::string(100, 'a')}}};
  EXPECT_EQ(ct->Render(msgs).status().code(), absl::StatusCode::kResourceExhausted);
  auto p = RenderChatPrompt(*ct, **tok, msgs, {});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("exceeded 64 bytes"));
  const json short_msgs = {{{"role", "user"}, {"content", "hi"}}};
  EXPECT_TRUE(RenderChatPrompt(*ct, **tok, short_msgs, {}).ok());
}

TEST(ChatTemplateTest, MixtralAlternationErrorIsRaisedVerbatim) {
  auto ct = ChatTemplate::FromModelDir(Dir() + "/mixtral");
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto out = ct->Render(
      json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])"));
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(
      out.status().message(),
      "chat template raised: After the optional system message, conversation roles must alternate "
      "user/assistant/user/assistant/...");
}

}  // namespace
}  // namespace hmoe
