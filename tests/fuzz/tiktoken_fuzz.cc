// The tiktoken format (TiktokenModel::Parse; common/text/tiktoken.h) and its
// encode / decode. The first input byte picks the mode:
//   even: the rest is a rank file, then (after the first NUL) a
//         tokenizer_config.json; an accepted pair encodes and decodes a
//         fixed sample;
//   odd:  the rest is text for the fixture (tests/fixtures/tiktoken): encode
//         it with and without special tokens, decode the ids back (valid
//         UTF-8 must come back byte for byte: traps otherwise), decode the
//         raw bytes read as ids, and stream-decode them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/text/tiktoken.h"
#include "common/text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

const hmoe::Tokenizer* Fixture() {
  static const hmoe::Tokenizer* t = [] {
    auto tk = hmoe::Tokenizer::FromModelDir(hmoe::fuzz::Fixture("tiktoken"));
    return tk.ok() ? tk->release() : nullptr;
  }();
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool text_mode = data[0] & 1;
  hmoe::fuzz::Input in(data + 1, size - 1);
  const uint8_t* raw = in.data();
  const size_t n = in.size();
  const std::string rest = in.Rest();
  if (!text_mode) {
    const size_t nul = rest.find('\0');
    const std::string ranks = rest.substr(0, nul);
    const std::string config = nul == std::string::npos ? "{}" : rest.substr(nul + 1);
    auto m = hmoe::TiktokenModel::Parse(ranks, "fuzz/tiktoken.model", config,
                                        "fuzz/tokenizer_config.json");
    if (!m.ok()) return 0;
    std::vector<int32_t> ids;
    const std::string sample = "Hello, world! 1234 \xe4\xb8\xad\xe6\x96\x87 it's\n\n\t[BOS]";
    for (bool special : {false, true}) {
      ids.clear();
      if ((*m)->Encode(sample, special, &ids).ok()) {
        std::string back;
        for (int32_t id : ids) back += (*m)->TokenBytes(id);
        if (back != sample) __builtin_trap();
      }
    }
    return 0;
  }
  const hmoe::Tokenizer* tk = Fixture();
  if (tk == nullptr) return 0;
  auto ids = tk->Encode(rest);
  if (ids.ok()) {
    auto back = tk->Decode(*ids);
    if (!back.ok() || *back != rest) __builtin_trap();
  }
  std::vector<int32_t> raw_ids;
  for (size_t i = 0; i + 2 <= n; i += 2)
    raw_ids.push_back(static_cast<int32_t>(raw[i] | (raw[i + 1] << 8)) - 16);
  (void)tk->Decode(raw_ids, false);
  hmoe::StreamDecoder sd(*tk, true);
  for (int32_t id : raw_ids) (void)sd.Push(id);
  (void)sd.Finish();
  return 0;
}
