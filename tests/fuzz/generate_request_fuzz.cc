// A Generate call's request as the worker checks it: the wire bytes parsed
// as hmoe.api.v1.GenerateRequest, turned into the engine's request
// (GenerationService::ToEngineRequest: the prompt encoded by the fixture's
// tokenizer, sampling fields) and checked as Engine::Submit does
// (CheckGenerateRequest: ids in the vocabulary, context and KV room, sampling
// bounds, stop tokens and strings).
#include <cstdint>
#include <memory>
#include <string>

#include "gpu_worker/engine/engine.h"
#include "gpu_worker/server/generation_service.h"
#include "proto/api.pb.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto* tokenizer = [] {
    auto tk = hmoe::Tokenizer::FromFile(hmoe::fuzz::Fixture("ds3_fortunes/tokenizer.json"));
    return tk.ok() ? tk->release() : nullptr;
  }();
  static auto* service = [] {
    auto* s = new hmoe::GenerationService(nullptr, nullptr, tokenizer, "fuzz", "none", nullptr);
    // Chat messages are rendered by the fixture's template.
    auto t = hmoe::ChatTemplate::FromModelDir(hmoe::fuzz::Fixture("ds3_fortunes"));
    if (t.ok()) s->set_chat_template(new hmoe::ChatTemplate(std::move(*t)), "none");
    return s;
  }();
  hmoe::api::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto er = service->ToEngineRequest(req);
  if (!er.ok()) return 0;
  hmoe::RequestLimits limits;
  limits.vocab_size = tokenizer != nullptr ? tokenizer->vocab_size() : 1000;
  limits.max_context = 4096;
  limits.kv_blocks = 256;
  limits.kv_block_tokens = 16;
  limits.has_tokenizer = tokenizer != nullptr;
  auto f = hmoe::CheckGenerateRequest(limits, &*er);
  if (f.ok() && (er->max_tokens < 1 || f->kv_blocks > limits.kv_blocks)) __builtin_trap();
  return 0;
}
