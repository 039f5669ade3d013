// A model's chat template, rendered as transformers' apply_chat_template(
// tokenize=False) renders it (transformers 5.x), with our own Jinja
// interpreter (common/text/jinja/jinja.h).
//
// Loading (FromModelDir), as transformers' tokenizer loading does:
//   * templates: `chat_template.jinja` (the "default") and
//     `additional_chat_templates/<name>.jinja` take priority over
//     tokenizer_config.json's `chat_template`, which is a string or the
//     named list [{"name": ..., "template": ...}, ...];
//   * special tokens exposed to the template: bos_token, eos_token,
//     unk_token, sep_token, pad_token, cls_token, mask_token from
//     tokenizer_config.json (a string or an AddedToken object
//     {"content": ...}; null or absent: not defined), overridden by
//     special_tokens_map.json when that file exists.
// Every template is parsed at load; an unsupported construct fails here.
//
// Rendering (Render), as apply_chat_template does:
//   * messages: a non-empty JSON array of objects; keys whose value is null
//     are dropped; a message with reasoning_content / thinking / reasoning
//     gets both `thinking` (first) and `reasoning_content` (last) set to the
//     first of those that is not null;
//   * context: the special tokens, then extra_context (overrides them), then
//     messages, tools (null when not given), documents (null) and
//     add_generation_prompt;
//   * template choice with named templates: template_name if given, else
//     "tool_use" when tools are given and it exists, else "default".
#pragma once

#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/text/jinja/jinja.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace hmoe {

struct ChatTemplateOptions {
  jinja::Limits limits;  // per Render()
};

struct ChatRenderOptions {
  bool add_generation_prompt = false;
  std::optional<nlohmann::ordered_json> tools;  // a JSON array of tool schemas
  // Extra template variables (e.g. {"enable_thinking": false}); a JSON
  // object. May not set messages / tools / documents / add_generation_prompt.
  nlohmann::ordered_json extra_context = nlohmann::ordered_json::object();
  std::string template_name;         // named templates only; empty: as above
  std::function<std::time_t()> now;  // strftime_now's clock (empty: system)
};

class ChatTemplate {
 public:
  // NOT_FOUND: no directory, or no template in it. INVALID_ARGUMENT: a file
  // is not valid JSON, a field has the wrong type, or a template does not
  // parse (messages name the file and field).
  static absl::StatusOr<ChatTemplate> FromModelDir(const std::string& dir,
                                                   const ChatTemplateOptions& options = {});
  // One template; bos / eos exposed when given.
  static absl::StatusOr<ChatTemplate> FromString(const std::string& source,
                                                 std::optional<std::string> bos_token,
                                                 std::optional<std::string> eos_token,
                                                 const ChatTemplateOptions& options = {});

  // INVALID_ARGUMENT: bad messages / options, or the template failed
  // (raise_exception: "chat template raised: <message>"); NOT_FOUND: unknown
  // template_name; RESOURCE_EXHAUSTED: a jinja::Limits bound. Messages name
  // a template file relative to the model directory (clients see them).
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& messages,
                                     const ChatRenderOptions& options = {}) const;

  // Names of the templates ("default" for a single one).
  std::vector<std::string> template_names() const;
  const std::map<std::string, std::string>& special_tokens() const { return special_tokens_; }
  // The source text of the template Render picks for these options' tools
  // and template_name ("" when there is none).
  std::string source(const ChatRenderOptions& options = {}) const;

 private:
  const std::string* PickName(const ChatRenderOptions& options) const;
  std::map<std::string, jinja::Template> templates_;  // name -> template
  std::map<std::string, std::string> sources_;        // name -> its text
  bool named_ = false;                                // the named-list / directory form
  std::map<std::string, std::string> special_tokens_;
  ChatTemplateOptions options_;
  std::string dir_prefix_;  // FromModelDir's "DIR/": left out of Render's errors
};

// A chat request's prompt tokens: `messages` rendered by `chat` and encoded
// without adding special tokens (the template writes them, as transformers
// does). `rendered` (optional) gets the text. Render's and Encode's errors,
// but a jinja::Limits bound is INVALID_ARGUMENT: the request's own input
// hits it, and would again on a retry.
struct ChatPrompt {
  std::string text;
  std::vector<int32_t> ids;
};
absl::StatusOr<ChatPrompt> RenderChatPrompt(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                            const nlohmann::ordered_json& messages,
                                            const ChatRenderOptions& options);

}  // namespace hmoe
