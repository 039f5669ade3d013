#include "gpu_worker/server/openai_api.h"

#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hmoe::openai {
namespace {

const char* TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a number";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "a value";
  }
}

// Field readers: absent or null leaves *out as it is; a wrong type or range
// sets `error` (param = the field) and returns false.
class Fields {
 public:
  Fields(const Json& body, Error* error) : body_(body), error_(error) {}

  const Json* Get(const char* name) const {
    auto it = body_.find(name);
    if (it == body_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool Fail(const std::string& param, const std::string& message) {
    error_->http_status = 400;
    error_->type = "invalid_request_error";
    error_->param = param;
    error_->message = message;
    return false;
  }
  bool WrongType(const std::string& param, const Json& v, const char* want) {
    return Fail(param, absl::StrCat(param, ": expected ", want, ", got ", TypeName(v)));
  }

  bool Bool(const char* name, bool* out) {
    const Json* v = Get(name);
    if (v == nullptr) return true;
    if (!v->is_boolean()) return WrongType(name, *v, "a boolean");
    *out = v->get<bool>();
    return true;
  }
  // A number in [lo, hi] (lo_open: lo itself excluded).
  bool Number(const char* name, double lo, double hi, bool lo_open, float* out) {
    const Json* v = Get(name);
    if (v == nullptr) return true;
    if (!v->is_number()) return WrongType(name, *v, "a number");
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo)) {
      return Fail(name,
                  absl::StrCat(name, ": ", x, " outside ", lo_open ? "(" : "[", lo, ", ", hi, "]"));
    }
    *out = static_cast<float>(x);
    return true;
  }
  bool Int(const char* name, int64_t lo, int64_t hi, int64_t* out, bool* present = nullptr) {
    const Json* v = Get(name);
    if (present) *present = v != nullptr;
    if (v == nullptr) return true;
    // 3.0 is an integer to Python's OpenAI servers too.
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9e15)
        return WrongType(name, *v, "an integer");
      *out = static_cast<int64_t>(d);
    } else if (v->is_number_unsigned()) {
      const uint64_t u = v->get<uint64_t>();
      *out = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                 ? std::numeric_limits<int64_t>::max()
                 : static_cast<int64_t>(u);
    } else if (v->is_number_integer()) {
      *out = v->get<int64_t>();
    } else {
      return WrongType(name, *v, "an integer");
    }
    if (*out < lo || *out > hi)
      return Fail(name, absl::StrCat(name, ": ", *out, " outside [", lo, ", ", hi, "]"));
    return true;
  }
  // Fields we take only at their "off" value: anything else is refused
  // rather than silently ignored.
  bool OnlyOff(const char* name, const Json& off, const std::string& why) {
    const Json* v = Get(name);
    if (v == nullptr || *v == off) return true;
    if (off.is_object() && v->is_object() && v->empty()) return true;
    return Fail(name, absl::StrCat(name, ": ", why));
  }

 private:
  const Json& body_;
  Error* error_;
};

// A message's content as the templates take it: a string (text parts of an
// array joined with "\n", as vLLM does), or null.
bool NormalizeContent(Fields& f, const std::string& param, Json* content) {
  if (content->is_null() || content->is_string()) return true;
  if (!content->is_array()) return f.WrongType(param, *content, "a string or an array of parts");
  std::string text;
  for (size_t j = 0; j < content->size(); ++j) {
    const Json& part = (*content)[j];
    const std::string p = absl::StrCat(param, "[", j, "]");
    if (!part.is_object()) return f.WrongType(p, part, "an object");
    auto type = part.find("type");
    if (type == part.end() || !type->is_string())
      return f.Fail(p + ".type", p + ".type: expected a string");
    if (*type != "text") {
      return f.Fail(p + ".type", absl::StrCat(p, ".type: \"", type->get<std::string>(),
                                              "\" parts are not supported (text only)"));
    }
    auto t = part.find("text");
    if (t == part.end() || !t->is_string())
      return f.Fail(p + ".text", p + ".text: expected a string");
    if (j > 0) text += "\n";
    text += t->get<std::string>();
  }
  *content = text;
  return true;
}

}  // namespace

std::string ErrorJson(const Error& e) {
  Json j;
  j["error"]["message"] = e.message;
  j["error"]["type"] = e.type;
  j["error"]["param"] = e.param.empty() ? Json(nullptr) : Json(e.param);
  j["error"]["code"] = e.code.empty() ? Json(nullptr) : Json(e.code);
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Error FromStatus(const absl::Status& s) {
  Error e;
  e.message = std::string(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      break;
    case absl::StatusCode::kUnauthenticated:
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable_error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

absl::StatusOr<Parsed> ParseRequest(Endpoint endpoint, const Json& body, const Context& ctx,
                                    Error* error) {
  const absl::Status bad = absl::InvalidArgumentError("request refused");
  Fields f(body, error);
  if (!body.is_object()) {
    f.WrongType("body", body, "a JSON object");
    error->param.clear();
    return bad;
  }
  const bool chat = endpoint == Endpoint::kChatCompletions;
  if (const Json* m = f.Get("model")) {
    if (!m->is_string()) return f.WrongType("model", *m, "a string"), bad;
    if (m->get<std::string>() != ctx.model_name) {
      error->http_status = 404;
      error->param = "model";
      error->code = "model_not_found";
      error->message = absl::StrCat("The model `", m->get<std::string>(),
                                    "` does not exist; this server serves `", ctx.model_name, "`");
      return absl::NotFoundError(error->message);
    }
  }
  Parsed out;
  GenerateRequest& r = out.request;
  SamplingParams& s = r.sampling;
  s.temperature = 1.0f;  // OpenAI's default
  if (!f.Bool("stream", &out.stream)) return bad;
  if (const Json* so = f.Get("stream_options")) {
    if (!so->is_object()) return f.WrongType("stream_options", *so, "an object"), bad;
    auto iu = so->find("include_usage");
    if (iu != so->end() && !iu->is_null()) {
      if (!iu->is_boolean()) {
        return f.WrongType("stream_options.include_usage", *iu, "a boolean"), bad;
      }
      out.include_usage = iu->get<bool>();
    }
  }
  int64_t n = 1;
  if (!f.Int("n", 1, 1 << 20, &n)) return bad;
  if (n != 1)
    return f.Fail("n", absl::StrCat("n: ", n, "; this server returns one choice (n = 1)")), bad;
  if (!f.Number("temperature", 0, 2, false, &s.temperature) ||
      !f.Number("top_p", 0, 1, true, &s.top_p) || !f.Number("min_p", 0, 1, false, &s.min_p) ||
      !f.Number("presence_penalty", -2, 2, false, &s.presence_penalty) ||
      !f.Number("frequency_penalty", -2, 2, false, &s.frequency_penalty) ||
      !f.Number("repetition_penalty", 0, 1e6, true, &s.repetition_penalty))
    return bad;
  int64_t top_k = 0;
  if (!f.Int("top_k", -1, std::numeric_limits<int32_t>::max(), &top_k)) return bad;
  s.top_k = top_k < 0 ? 0 : static_cast<int32_t>(top_k);  // -1: off (vLLM)
  int64_t seed = 0;
  bool has_seed = false;
  if (!f.Int("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
             &seed, &has_seed))
    return bad;
  if (has_seed) {
    s.has_seed = true;
    s.seed = static_cast<uint64_t>(seed);
  }
  // max_completion_tokens (the newer name) wins over max_tokens.
  int64_t max_tokens = chat ? std::max<int64_t>(ctx.max_context, 1) : 16;
  bool has_max = false;
  if (!f.Int("max_completion_tokens", 1, std::numeric_limits<int32_t>::max(), &max_tokens,
             &has_max))
    return bad;
  if (!has_max && !f.Int("max_tokens", 1, std::numeric_limits<int32_t>::max(), &max_tokens))
    return bad;
  r.max_tokens = static_cast<int32_t>(max_tokens);
  if (const Json* stop = f.Get("stop")) {
    if (stop->is_string()) {
      r.stop_strings.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string())
          return f.WrongType(absl::StrCat("stop[", i, "]"), (*stop)[i], "a string"), bad;
        r.stop_strings.push_back((*stop)[i].get<std::string>());
      }
    } else {
      return f.WrongType("stop", *stop, "a string or an array of strings"), bad;
    }
  }
  if (const Json* ids = f.Get("stop_token_ids")) {  // vLLM's extension
    if (!ids->is_array()) return f.WrongType("stop_token_ids", *ids, "an array of integers"), bad;
    for (size_t i = 0; i < ids->size(); ++i) {
      const Json& v = (*ids)[i];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
          v.get<int64_t>() > std::numeric_limits<int32_t>::max())
        return f.Fail(absl::StrCat("stop_token_ids[", i, "]"),
                      absl::StrCat("stop_token_ids[", i, "]: expected a token id")),
               bad;
      r.stop_token_ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
  }
  if (!f.Bool("ignore_eos", &r.ignore_eos)) return bad;
  // What we do not do is refused, never silently ignored.
  if (!f.OnlyOff("logit_bias", Json::object(), "not supported") ||
      !f.OnlyOff("response_format", Json{{"type", "text"}}, "only {\"type\": \"text\"}") ||
      !f.OnlyOff("best_of", Json(1), "only 1") ||
      !f.OnlyOff("echo", Json(false), "not supported") ||
      !f.OnlyOff("suffix", Json(""), "not supported"))
    return bad;
  if (chat) {
    bool logprobs = false;
    int64_t top = 0;
    bool has_top = false;
    if (!f.Bool("logprobs", &logprobs) ||
        !f.Int("top_logprobs", 0, kMaxTopLogprobs, &top, &has_top))
      return bad;
    if (has_top && !logprobs)
      return f.Fail("top_logprobs", "top_logprobs: needs logprobs true"), bad;
    r.logprobs = logprobs ? static_cast<int32_t>(top) : -1;
  } else {
    int64_t n_lp = -1;
    if (!f.Int("logprobs", 0, kMaxTopLogprobs, &n_lp)) return bad;
    r.logprobs = static_cast<int32_t>(n_lp);
  }

  if (chat) {
    const Json* messages = f.Get("messages");
    if (messages == nullptr) return f.Fail("messages", "messages: required"), bad;
    if (!messages->is_array() || messages->empty())
      return f.Fail("messages", "messages: expected a non-empty array"), bad;
    if (ctx.chat == nullptr) {
      return f.Fail("messages", absl::StrCat("chat completions need a chat template: ",
                                             ctx.no_chat_template, "; use /v1/completions")),
             bad;
    }
    Json msgs = *messages;
    for (size_t i = 0; i < msgs.size(); ++i) {
      Json& m = msgs[i];
      const std::string p = absl::StrCat("messages[", i, "]");
      if (!m.is_object()) return f.WrongType(p, m, "an object"), bad;
      auto role = m.find("role");
      if (role == m.end() || !role->is_string())
        return f.Fail(p + ".role", p + ".role: expected a string"), bad;
      // OpenAI's newer name for the system role, which templates know.
      if (*role == "developer") *role = "system";
      auto content = m.find("content");
      if (content != m.end() && !NormalizeContent(f, p + ".content", &*content)) return bad;
    }
    ChatRenderOptions ro;
    ro.add_generation_prompt = true;
    if (!f.Bool("add_generation_prompt", &ro.add_generation_prompt)) return bad;
    if (const Json* tools = f.Get("tools")) {
      if (!tools->is_array()) return f.WrongType("tools", *tools, "an array"), bad;
      for (size_t i = 0; i < tools->size(); ++i) {
        const Json& t = (*tools)[i];
        const std::string p = absl::StrCat("tools[", i, "]");
        if (!t.is_object() || !t.contains("function") || !t["function"].is_object() ||
            !t["function"].contains("name") || !t["function"]["name"].is_string())
          return f.Fail(p,
                        p + ": expected {\"type\": \"function\", \"function\": {\"name\": ...}}"),
                 bad;
      }
      ro.tools = *tools;
    }
    // tool_choice: "auto" (default), "none" (the tools are not offered),
    // "required" or {"type": "function", "function": {"name": N}} (the
    // prompt ends inside a call, in the model's syntax).
    std::string choice = "auto", forced_name;
    if (const Json* tc = f.Get("tool_choice")) {
      if (tc->is_string() && (*tc == "auto" || *tc == "none" || *tc == "required")) {
        choice = tc->get<std::string>();
      } else if (tc->is_object() && tc->contains("function") && (*tc)["function"].is_object() &&
                 (*tc)["function"].contains("name") && (*tc)["function"]["name"].is_string()) {
        choice = "function";
        forced_name = (*tc)["function"]["name"].get<std::string>();
      } else {
        return f.Fail("tool_choice",
                      "tool_choice: \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}"),
               bad;
      }
    }
    const bool forced = choice == "required" || choice == "function";
    if (forced && !ro.tools) return f.Fail("tool_choice", "tool_choice: needs tools"), bad;
    if (choice == "function") {
      bool known = false;
      for (const Json& t : *ro.tools) known = known || t["function"]["name"] == forced_name;
      if (!known)
        return f.Fail("tool_choice",
                      absl::StrCat("tool_choice: no tool named \"", forced_name, "\" in tools")),
               bad;
    }
    if (!f.Bool("parallel_tool_calls", &out.parallel_tool_calls)) return bad;
    std::optional<std::string> prefix;
    if (forced) {
      prefix = ForcedToolCallPrefix(ctx.tool_syntax, forced_name);
      if (!prefix)
        return f.Fail("tool_choice",
                      ctx.tool_syntax == ToolSyntax::kNone
                          ? "tool_choice: this model's chat template writes no tool calls the "
                            "server reads (see --tool-call-syntax)"
                          : absl::StrCat("tool_choice: a named function is not supported for the ",
                                         ToolSyntaxName(ctx.tool_syntax),
                                         " tool-call syntax; use \"required\"")),
               bad;
    }
    if (choice == "none") ro.tools.reset();
    out.output.syntax = choice == "none" ? ToolSyntax::kNone : ctx.tool_syntax;
    out.output.split_reasoning = ctx.split_reasoning;
    if (ro.tools) out.output.tools = nlohmann::json::parse(ro.tools->dump());
    if (const Json* kw = f.Get("chat_template_kwargs")) {  // vLLM's extension
      if (!kw->is_object()) return f.WrongType("chat_template_kwargs", *kw, "an object"), bad;
      for (const char* reserved : {"messages", "tools", "documents", "add_generation_prompt"}) {
        if (kw->contains(reserved))
          return f.Fail("chat_template_kwargs",
                        absl::StrCat("chat_template_kwargs: may not set ", reserved)),
                 bad;
      }
      ro.extra_context = *kw;
    }
    if (ctx.tokenizer == nullptr)
      return f.Fail("messages", "chat completions need the model's tokenizer.json"), bad;
    auto prompt = RenderChatPrompt(*ctx.chat, *ctx.tokenizer, msgs, ro);
    if (!prompt.ok()) {
      *error = FromStatus(prompt.status());
      error->param = "messages";
      return prompt.status();
    }
    r.prompt = std::move(prompt->ids);
    out.rendered_prompt = std::move(prompt->text);
    absl::string_view tail = absl::StripTrailingAsciiWhitespace(out.rendered_prompt);
    out.output.starts_in_reasoning = ctx.split_reasoning && absl::EndsWith(tail, "<think>");
    if (prefix) {
      // A forced call skips the thinking the template opened.
      std::string more = *prefix;
      if (out.output.starts_in_reasoning) more = "</think>\n\n" + more;
      out.output.starts_in_reasoning = false;
      auto ids = ctx.tokenizer->Encode(more, /*add_special_tokens=*/false);
      if (!ids.ok()) {
        *error = FromStatus(ids.status());
        error->param = "tool_choice";
        return ids.status();
      }
      r.prompt.insert(r.prompt.end(), ids->begin(), ids->end());
      out.rendered_prompt += more;
      out.forced_prefix = std::move(*prefix);
    }
  } else {
    const Json* prompt = f.Get("prompt");
    if (prompt == nullptr) return f.Fail("prompt", "prompt: required"), bad;
    const Json* p = prompt;
    // A batch of one is one prompt; more are refused (one choice per request).
    if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
      if (p->size() != 1)
        return f.Fail("prompt", "prompt: one prompt per request (a batch of 1)"), bad;
      p = &(*p)[0];
    }
    if (p->is_string()) {
      if (p->get<std::string>().empty()) return f.Fail("prompt", "prompt: empty"), bad;
      if (ctx.tokenizer == nullptr)
        return f.Fail("prompt", "prompt: this model has no tokenizer.json; send token ids"), bad;
      auto ids = ctx.tokenizer->Encode(p->get<std::string>(), /*add_special_tokens=*/true);
      if (!ids.ok()) {
        *error = FromStatus(ids.status());
        error->param = "prompt";
        return ids.status();
      }
      r.prompt = std::move(*ids);
    } else if (p->is_array()) {
      if (p->empty()) return f.Fail("prompt", "prompt: empty"), bad;
      for (size_t i = 0; i < p->size(); ++i) {
        const Json& v = (*p)[i];
        if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
            v.get<int64_t>() > std::numeric_limits<int32_t>::max())
          return f.Fail("prompt", absl::StrCat("prompt[", i, "]: expected a token id")), bad;
        r.prompt.push_back(static_cast<int32_t>(v.get<int64_t>()));
      }
    } else {
      return f.WrongType("prompt", *p, "a string, an array of token ids or a batch of one"), bad;
    }
  }
  return out;
}

Json LogprobsJson(Endpoint endpoint, int32_t requested, const std::vector<TokenLogprob>& tokens,
                  const Tokenizer* tokenizer, size_t* offset) {
  if (requested < 0) return nullptr;
  auto text_of = [&](int32_t id) {
    return tokenizer != nullptr ? tokenizer->TokenBytes(id, /*skip_special_tokens=*/false)
                                : absl::StrCat("<", id, ">");
  };
  auto bytes_of = [](const std::string& s) {
    Json b = Json::array();
    for (unsigned char ch : s) b.push_back(static_cast<int>(ch));
    return b;
  };
  if (endpoint == Endpoint::kChatCompletions) {
    Json content = Json::array();
    for (const TokenLogprob& t : tokens) {
      const std::string s = text_of(t.token);
      Json top = Json::array();
      for (const auto& [id, lp] : t.top) {
        const std::string ts = text_of(id);
        top.push_back({{"token", ts}, {"logprob", lp}, {"bytes", bytes_of(ts)}});
      }
      content.push_back(
          {{"token", s}, {"logprob", t.logprob}, {"bytes", bytes_of(s)}, {"top_logprobs", top}});
    }
    return Json{{"content", content}, {"refusal", nullptr}};
  }
  Json toks = Json::array(), lps = Json::array(), tops = Json::array(), offs = Json::array();
  for (const TokenLogprob& t : tokens) {
    const std::string s = text_of(t.token);
    toks.push_back(s);
    lps.push_back(t.logprob);
    Json top = Json::object();
    for (const auto& [id, lp] : t.top) top[text_of(id)] = lp;
    top[s] = t.logprob;  // the chosen token is always there, as in OpenAI's
    tops.push_back(top);
    offs.push_back(*offset);
    *offset += s.size();
  }
  return Json{
      {"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

Json FinishReasonJson(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopToken:
    case FinishReason::kStopString:
      return "stop";
    default:
      return nullptr;
  }
}

Json UsageJson(const Usage& u) {
  return Json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

Json CompletionResponse(Endpoint endpoint, const std::string& id, int64_t created,
                        const std::string& model, const std::string& text, FinishReason finish,
                        const Usage& usage, const Json& logprobs) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  Json choice;
  choice["index"] = 0;
  if (chat) {
    choice["message"] = Json{{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = FinishReasonJson(finish);
  return Json{{"id", id},
              {"object", chat ? "chat.completion" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({choice})},
              {"usage", UsageJson(usage)}};
}

Json StreamChunk(Endpoint endpoint, const std::string& id, int64_t created,
                 const std::string& model, const std::string& text, bool first, FinishReason finish,
                 const Json& logprobs) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  Json choice;
  choice["index"] = 0;
  if (chat) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && finish == FinishReason::kNone)) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = FinishReasonJson(finish);
  return Json{{"id", id},
              {"object", chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({choice})}};
}

namespace {

Json ChatFinishReason(FinishReason finish, bool called_tools) {
  if (called_tools && (finish == FinishReason::kStopToken || finish == FinishReason::kStopString))
    return "tool_calls";
  return FinishReasonJson(finish);
}

Json ToolCallJson(const ToolCall& c) {
  return Json{{"id", c.id},
              {"type", "function"},
              {"function", Json{{"name", c.name}, {"arguments", c.arguments}}}};
}

Json ChatCompletion(const char* object, const std::string& id, int64_t created,
                    const std::string& model, Json choice) {
  return Json{{"id", id},
              {"object", object},
              {"created", created},
              {"model", model},
              {"choices", Json::array({std::move(choice)})}};
}

}  // namespace

Json ChatResponse(const std::string& id, int64_t created, const std::string& model,
                  const ParsedOutput& out, FinishReason finish, const Usage& usage,
                  const Json& logprobs) {
  Json message{{"role", "assistant"}};
  message["content"] =
      out.content.empty() && !out.tool_calls.empty() ? Json(nullptr) : Json(out.content);
  if (!out.reasoning.empty()) message["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) {
    Json calls = Json::array();
    for (const ToolCall& c : out.tool_calls) calls.push_back(ToolCallJson(c));
    message["tool_calls"] = std::move(calls);
  }
  Json choice{{"index", 0},
              {"message", std::move(message)},
              {"logprobs", logprobs},
              {"finish_reason", ChatFinishReason(finish, !out.tool_calls.empty())}};
  Json j = ChatCompletion("chat.completion", id, created, model, std::move(choice));
  j["usage"] = UsageJson(usage);
  return j;
}

Json ChatDeltaChunk(const std::string& id, int64_t created, const std::string& model,
                    const OutputDelta& d, bool first, const Json& logprobs) {
  Json delta = Json::object();
  if (first) delta["role"] = "assistant";
  if (!d.content.empty() || (first && d.reasoning.empty() && d.tool_calls.empty()))
    delta["content"] = d.content;
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.tool_calls.empty()) {
    Json calls = Json::array();
    for (size_t i = 0; i < d.tool_calls.size(); ++i) {
      Json c = ToolCallJson(d.tool_calls[i]);
      c["index"] = d.first_call_index + static_cast<int>(i);
      calls.push_back(std::move(c));
    }
    delta["tool_calls"] = std::move(calls);
  }
  return ChatCompletion("chat.completion.chunk", id, created, model,
                        Json{{"index", 0},
                             {"delta", std::move(delta)},
                             {"logprobs", logprobs},
                             {"finish_reason", nullptr}});
}

Json ChatFinishChunk(const std::string& id, int64_t created, const std::string& model,
                     FinishReason finish, bool called_tools) {
  return ChatCompletion("chat.completion.chunk", id, created, model,
                        Json{{"index", 0},
                             {"delta", Json::object()},
                             {"logprobs", nullptr},
                             {"finish_reason", ChatFinishReason(finish, called_tools)}});
}

Json UsageChunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                const Usage& usage) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  return Json{{"id", id},
              {"object", chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array()},
              {"usage", UsageJson(usage)}};
}

Json ModelsList(const std::string& model, int64_t created, int64_t max_context) {
  return Json{{"object", "list"},
              {"data", Json::array({Json{{"id", model},
                                         {"object", "model"},
                                         {"created", created},
                                         {"owned_by", "hybridmoe"},
                                         {"max_model_len", max_context}}})}};
}

}  // namespace hmoe::openai
