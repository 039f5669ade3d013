// An OpenAI-style HTTP request body as the worker's HTTP API parses it
// (openai::ParseRequest: every field's type and range, the chat template
// rendering messages, the tokenizer encoding the prompt), then checked as
// Engine::Submit does (CheckGenerateRequest). First byte: bit 0 = completions
// (else chat completions); bit 1 = an Anthropic Messages body
// (anthropic::ToChatBody first; chat); bits 2-4 = the tool-call syntax (and
// reasoning split) chat output is parsed in; the rest is the body.
#include <cstdint>
#include <optional>
#include <string>

#include "gpu_worker/engine/engine.h"
#include "gpu_worker/server/anthropic_api.h"
#include "gpu_worker/server/openai_api.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto* tokenizer = [] {
    auto tk = hmoe::Tokenizer::FromFile(hmoe::fuzz::Fixture("ds3_fortunes/tokenizer.json"));
    return tk.ok() ? tk->release() : nullptr;
  }();
  static const auto* chat = [] {
    auto t = hmoe::ChatTemplate::FromModelDir(hmoe::fuzz::Fixture("ds3_fortunes"));
    return t.ok() ? new hmoe::ChatTemplate(std::move(*t)) : nullptr;
  }();
  hmoe::fuzz::Input in(data, size);
  const uint8_t mode = in.Take<uint8_t>();
  const bool anthropic = (mode & 2) != 0;
  const auto endpoint = (mode & 1) && !anthropic ? hmoe::openai::Endpoint::kCompletions
                                                 : hmoe::openai::Endpoint::kChatCompletions;
  auto body = hmoe::openai::Json::parse(in.Rest(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  static constexpr hmoe::ToolSyntax kSyntaxes[] = {
      hmoe::ToolSyntax::kNone,   hmoe::ToolSyntax::kDeepseek,   hmoe::ToolSyntax::kKimiK2,
      hmoe::ToolSyntax::kQwen3,  hmoe::ToolSyntax::kQwen3Coder, hmoe::ToolSyntax::kGlm45,
      hmoe::ToolSyntax::kMixtral};
  hmoe::openai::Context ctx{"fortunes",      tokenizer, chat,
                            "none",          1024,      kSyntaxes[((mode >> 2) & 7) % 7],
                            (mode & 32) != 0};
  hmoe::openai::Error error;
  if (anthropic) {
    auto converted = hmoe::anthropic::ToChatBody(body, (mode & 64) != 0, &error);
    if (!converted.ok()) {
      if (error.message.empty()) __builtin_trap();
      (void)hmoe::anthropic::ErrorJson(error);
      return 0;
    }
    body = std::move(*converted);
  }
  auto parsed = hmoe::openai::ParseRequest(endpoint, body, ctx, &error);
  if (!parsed.ok()) {
    // Every refusal is an error a client can read.
    if (error.http_status < 400 || error.message.empty()) __builtin_trap();
    (void)hmoe::openai::ErrorJson(error);
    return 0;
  }
  hmoe::RequestLimits limits;
  limits.vocab_size = tokenizer != nullptr ? tokenizer->vocab_size() : 1000;
  limits.max_context = 1024;
  limits.kv_blocks = 256;
  limits.kv_block_tokens = 16;
  limits.has_tokenizer = tokenizer != nullptr;
  auto f = hmoe::CheckGenerateRequest(limits, &parsed->request);
  if (f.ok() && (parsed->request.max_tokens < 1 || f->kv_blocks > limits.kv_blocks))
    __builtin_trap();
  return 0;
}
