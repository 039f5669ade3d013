// tokenizer.json loading (Tokenizer::FromJson) and encode / decode. The
// first input byte picks the mode:
//   even: the rest is a tokenizer.json; an accepted one encodes and decodes
//         a fixed sample;
//   odd:  the rest is text for the fixtures' tokenizers (byte-level BPE,
//         SentencePiece-style BPE): encode it, decode the ids back, decode
//         the raw bytes read as ids, and stream-decode them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

const std::vector<std::unique_ptr<hmoe::Tokenizer>>& Fixtures() {
  static const auto* t = [] {
    auto* v = new std::vector<std::unique_ptr<hmoe::Tokenizer>>();
    for (const char* dir : {"ds3_fortunes", "sp_bpe"}) {
      auto tk =
          hmoe::Tokenizer::FromFile(hmoe::fuzz::Fixture(std::string(dir) + "/tokenizer.json"));
      if (tk.ok()) v->push_back(std::move(*tk));
    }
    return v;
  }();
  return *t;
}

void Exercise(const hmoe::Tokenizer& tk, const std::string& text, const uint8_t* raw, size_t n) {
  for (bool special : {false, true}) {
    auto ids = tk.Encode(text, special);
    if (ids.ok()) (void)tk.Decode(*ids, !special);
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 2 <= n; i += 2)
    ids.push_back(static_cast<int32_t>(raw[i] | (raw[i + 1] << 8)) - 16);
  (void)tk.Decode(ids, false);
  hmoe::StreamDecoder sd(tk, false);
  for (int32_t id : ids) (void)sd.Push(id);
  (void)sd.Finish();
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
    auto tk = hmoe::Tokenizer::FromJson(rest, "fuzz/tokenizer.json");
    if (tk.ok()) Exercise(**tk, "Hello, world! 1234 \xc3\xa9t\xc3\xa9  \n\t<s>", raw, n);
    return 0;
  }
  for (const auto& tk : Fixtures()) Exercise(*tk, rest, raw, n);
  return 0;
}
