// ChatTemplate: loading a model's chat template(s) and rendering them as
// transformers' apply_chat_template does (see chat_template.h).
#include "common/text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/small_file.h"

namespace hmoe {

namespace {

using json = nlohmann::ordered_json;

const char* const kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                      "pad_token", "cls_token", "mask_token"};

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path, int64_t max_bytes) {
  return ReadSmallFile(path.string(), max_bytes);
}

absl::StatusOr<json> ReadJson(const std::filesystem::path& path) {
  auto text = ReadFile(path, kMaxConfigJsonBytes);
  if (!text.ok()) return text.status();
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not valid JSON"));
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  return j;
}

// A special token field: a string, an AddedToken object, or null.
absl::Status ReadToken(const json& cfg, const std::string& file, const char* field,
                       std::map<std::string, std::string>* out) {
  auto it = cfg.find(field);
  if (it == cfg.end()) return absl::OkStatus();
  if (it->is_null()) {
    out->erase(field);
    return absl::OkStatus();
  }
  if (it->is_string()) {
    (*out)[field] = it->get<std::string>();
    return absl::OkStatus();
  }
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) {
      (*out)[field] = c->get<std::string>();
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      file, ": field '", field, "' must be a string, null or an object with a string 'content'"));
}

absl::StatusOr<jinja::Template> ParseNamed(const std::string& source, const std::string& where) {
  return jinja::Template::Parse(source, where);
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromModelDir(const std::string& dir,
                                                        const ChatTemplateOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  ChatTemplate ct;
  ct.options_ = options;
  const fs::path root(dir);
  ct.dir_prefix_ = (root / "").string();
  const fs::path cfg_path = root / "tokenizer_config.json";
  json cfg = json::object();
  // A file that is absent is skipped; one that exists but cannot be read
  // (not a regular file, too large, a symlink loop) is an error.
  auto cfg_json = ReadJson(cfg_path);
  if (!cfg_json.ok() && !absl::IsNotFound(cfg_json.status())) return cfg_json.status();
  const bool have_cfg = cfg_json.ok();
  if (have_cfg) {
    cfg = std::move(*cfg_json);
    for (const char* t : kSpecialTokens) {
      absl::Status s = ReadToken(cfg, cfg_path.string(), t, &ct.special_tokens_);
      if (!s.ok()) return s;
    }
  }
  const fs::path stm_path = root / "special_tokens_map.json";
  if (auto j = ReadJson(stm_path); !j.ok() && !absl::IsNotFound(j.status())) {
    return j.status();
  } else if (j.ok()) {
    for (const char* t : kSpecialTokens) {
      absl::Status s = ReadToken(*j, stm_path.string(), t, &ct.special_tokens_);
      if (!s.ok()) return s;
    }
  }

  // Template files take priority over the config's chat_template.
  std::map<std::string, std::string> sources;  // name -> (source, where)
  std::map<std::string, std::string> where;
  const fs::path default_file = root / "chat_template.jinja";
  if (auto text = ReadFile(default_file, kMaxChatTemplateBytes);
      !text.ok() && !absl::IsNotFound(text.status())) {
    return text.status();
  } else if (text.ok()) {
    sources["default"] = std::move(*text);
    where["default"] = default_file.string();
  }
  const fs::path extra_dir = root / "additional_chat_templates";
  if (fs::is_directory(extra_dir, ec)) {
    for (const auto& entry : fs::directory_iterator(extra_dir, ec)) {
      if (entry.path().extension() != ".jinja") continue;
      auto text = ReadFile(entry.path(), kMaxChatTemplateBytes);
      if (!text.ok()) return text.status();
      const std::string name = entry.path().stem().string();
      sources[name] = std::move(*text);
      where[name] = entry.path().string();
    }
  }
  if (!sources.empty()) {
    ct.named_ = !(sources.size() == 1 && sources.count("default"));
  } else {
    auto it = cfg.find("chat_template");
    if (!have_cfg || it == cfg.end() || it->is_null())
      return absl::NotFoundError(absl::StrCat(dir,
                                              ": no chat template (no chat_template.jinja, and "
                                              "tokenizer_config.json has no 'chat_template')"));
    const std::string file = cfg_path.string();
    if (it->is_string()) {
      sources["default"] = it->get<std::string>();
      where["default"] = absl::StrCat(file, ": field 'chat_template'");
    } else if (it->is_array()) {
      ct.named_ = true;
      size_t i = 0;
      for (const auto& e : *it) {
        const std::string at = absl::StrCat(file, ": field 'chat_template'[", i++, "]");
        if (!e.is_object() || !e.contains("name") || !e["name"].is_string() ||
            !e.contains("template") || !e["template"].is_string())
          return absl::InvalidArgumentError(
              absl::StrCat(at, " must be an object with string 'name' and 'template'"));
        const std::string name = e["name"].get<std::string>();
        sources[name] = e["template"].get<std::string>();
        where[name] = absl::StrCat(at, " ('", name, "')");
      }
      if (sources.empty())
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": field 'chat_template' is an empty list"));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": field 'chat_template' must be a string or a list of {name, template}"));
    }
  }
  for (const auto& [name, src] : sources) {
    auto t = ParseNamed(src, where[name]);
    if (!t.ok()) return t.status();
    ct.templates_.emplace(name, std::move(*t));
    ct.sources_.emplace(name, src);
  }
  return ct;
}

absl::StatusOr<ChatTemplate> ChatTemplate::FromString(const std::string& source,
                                                      std::optional<std::string> bos_token,
                                                      std::optional<std::string> eos_token,
                                                      const ChatTemplateOptions& options) {
  ChatTemplate ct;
  ct.options_ = options;
  if (bos_token) ct.special_tokens_["bos_token"] = *bos_token;
  if (eos_token) ct.special_tokens_["eos_token"] = *eos_token;
  auto t = jinja::Template::Parse(source, "chat_template");
  if (!t.ok()) return t.status();
  ct.templates_.emplace("default", std::move(*t));
  ct.sources_.emplace("default", source);
  return ct;
}

std::vector<std::string> ChatTemplate::template_names() const {
  std::vector<std::string> names;
  for (const auto& kv : templates_) names.push_back(kv.first);
  return names;
}

const std::string* ChatTemplate::PickName(const ChatRenderOptions& options) const {
  if (!options.template_name.empty()) {
    auto it = templates_.find(options.template_name);
    return it == templates_.end() ? nullptr : &it->first;
  }
  if (named_) {
    auto it = options.tools ? templates_.find("tool_use") : templates_.end();
    if (it == templates_.end()) it = templates_.find("default");
    return it == templates_.end() ? nullptr : &it->first;
  }
  return templates_.empty() ? nullptr : &templates_.begin()->first;
}

std::string ChatTemplate::source(const ChatRenderOptions& options) const {
  const std::string* name = PickName(options);
  return name == nullptr ? std::string() : sources_.at(*name);
}

absl::StatusOr<std::string> ChatTemplate::Render(const json& messages,
                                                 const ChatRenderOptions& options) const {
  // Which template.
  const std::string* name = PickName(options);
  if (name == nullptr && !options.template_name.empty())
    return absl::NotFoundError(absl::StrCat("no chat template named '", options.template_name,
                                            "' (have: ", absl::StrJoin(template_names(), ", "),
                                            ")"));
  if (name == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(
        "this model has multiple chat templates and no 'default'; pass template_name (have: ",
        absl::StrJoin(template_names(), ", "), ")"));
  const jinja::Template* tmpl = &templates_.at(*name);

  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be a JSON array");
  if (messages.empty())
    return absl::InvalidArgumentError(
        "Cannot apply chat template to an empty conversation. Provide at least one message.");
  json msgs = json::array();
  size_t i = 0;
  for (const auto& m : messages) {
    if (!m.is_object())
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "] must be a JSON object"));
    json clean = json::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (!it->is_null()) clean[it.key()] = *it;
    const json* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto r = clean.find(key);
      if (r != clean.end()) {
        reasoning = &*r;
        break;
      }
    }
    if (reasoning != nullptr) {
      const json value = *reasoning;
      json aliased = json::object();
      aliased["thinking"] = value;
      for (auto it = clean.begin(); it != clean.end(); ++it) aliased[it.key()] = *it;
      aliased["reasoning_content"] = value;
      clean = std::move(aliased);
    }
    msgs.push_back(std::move(clean));
    ++i;
  }
  if (options.tools && !options.tools->is_array())
    return absl::InvalidArgumentError("tools must be a JSON array of tool schemas");
  if (options.tools) {
    for (const auto& t : *options.tools)
      if (!t.is_object())
        return absl::InvalidArgumentError("each tool must be a JSON object (a JSON schema)");
  }
  if (!options.extra_context.is_object())
    return absl::InvalidArgumentError("extra_context must be a JSON object");

  json ctx = json::object();
  for (const auto& [k, v] : special_tokens_) ctx[k] = v;
  for (auto it = options.extra_context.begin(); it != options.extra_context.end(); ++it) {
    const std::string& k = it.key();
    if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
      return absl::InvalidArgumentError(absl::StrCat("extra_context may not set '", k, "'"));
    ctx[k] = *it;
  }
  ctx["messages"] = std::move(msgs);
  ctx["tools"] = options.tools ? *options.tools : json(nullptr);
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = options.add_generation_prompt;
  jinja::RenderOptions ro;
  ro.limits = options_.limits;
  ro.now = options.now;
  auto out = tmpl->Render(ctx, ro);
  if (!out.ok() && !dir_prefix_.empty()) {
    return absl::Status(out.status().code(),
                        absl::StrReplaceAll(out.status().message(), {{dir_prefix_, ""}}));
  }
  return out;
}

absl::StatusOr<ChatPrompt> RenderChatPrompt(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                            const nlohmann::ordered_json& messages,
                                            const ChatRenderOptions& options) {
  ChatPrompt p;
  auto text = chat.Render(messages, options);
  if (!text.ok()) {
    // A limit this request's input hits is hit again on a retry.
    if (text.status().code() == absl::StatusCode::kResourceExhausted)
      return absl::InvalidArgumentError(text.status().message());
    return text.status();
  }
  p.text = std::move(*text);
  auto ids = tokenizer.Encode(p.text, /*add_special_tokens=*/false);
  if (!ids.ok()) return ids.status();
  p.ids = std::move(*ids);
  return p;
}

}  // namespace hmoe
