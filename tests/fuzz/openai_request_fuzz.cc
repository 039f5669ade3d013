// An OpenAI-style HTTP request body as the worker's HTTP API parses it
// (openai::ParseRequest: every field's type and range, the chat template
// rendering messages, the tokenizer encoding the prompt), then checked as
// Engine::Submit does (CheckGenerateRequest). First byte: even = chat
// completions, odd = completions; the rest is the body.
#include <cstdint>
#include <optional>
#include <string>

#include "gpu_worker/engine/engine.h"
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
  const auto endpoint = (in.Take<uint8_t>() & 1) ? hmoe::openai::Endpoint::kCompletions
                                                 : hmoe::openai::Endpoint::kChatCompletions;
  const auto body = hmoe::openai::Json::parse(in.Rest(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  hmoe::openai::Context ctx{"fortunes", tokenizer, chat, "none", 1024};
  hmoe::openai::Error error;
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
