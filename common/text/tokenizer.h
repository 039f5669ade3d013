// Hugging Face tokenizer.json, byte-level BPE (GPT-2 / Qwen2 / Qwen3 /
// DeepSeek-V3 style): added tokens matched first on the raw text (leftmost,
// longest), then, between them, the normalizer chain, the pre-tokenizer
// chain (Split by regex with PCRE2 in UTF + Unicode-property mode, Digits,
// ByteLevel), then BPE merges by rank (heap-ordered, O(n log n) per word);
// decoding maps byte-level characters back to bytes.
//
// Also SentencePiece-style BPE as Mixtral's and Llama-2's tokenizer.json
// lay it out: normalizer Prepend("▁") + Replace(" " -> "▁"), no
// pre-tokenizer, byte_fallback (<0xXX> tokens), fuse_unk, decoder Replace +
// ByteFallback + Fuse + Strip (streaming applies Strip's start only); or,
// as newer files have it, a Metaspace pre-tokenizer and decoder.
//
// Supported: normalizer null / NFC / NFD / Prepend / Replace (alone or in a
// Sequence, possibly empty); pre_tokenizer Split / Digits / ByteLevel (alone
// or in a Sequence) / Metaspace (prepend_scheme always / first / never,
// split); model BPE (merges as "a b" strings or [a, b] pairs,
// both sides and the result in the vocabulary, ignore_merges, byte_fallback,
// fuse_unk); decoder ByteLevel, or Replace (String) / ByteFallback / Fuse /
// Strip / Metaspace (alone or in a Sequence); post_processor TemplateProcessing (single sequence)
// or ByteLevel. Anything else -> UNIMPLEMENTED naming it. Added tokens marked "normalized": true
// are matched on the raw text too (Hugging Face matches them after normalizing; the same unless the
// normalizer changes them).
//
// Also the tiktoken format of Kimi-K2's checkpoints (tiktoken.model +
// tokenizer_config.json; tiktoken.h): FromTiktoken, or FromModelDir.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hmoe {

class TiktokenModel;

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(const std::string& json_text,
                                                             const std::string& source);
  // A tiktoken.model rank file and its tokenizer_config.json (tiktoken.h says
  // what is refused). Encode recognizes the special tokens in the text, as
  // Kimi's encode() does by default; add_special_tokens adds nothing (Kimi's
  // tokenizer has no template). TokenToId takes a special token's text or an
  // ordinary token's raw bytes.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTiktoken(const std::string& model_path,
                                                                 const std::string& config_path);
  // A model directory's tokenizer: tokenizer.json if there is one, else
  // tiktoken.model with tokenizer_config.json (INVALID_ARGUMENT if that is
  // missing). NOT_FOUND when the directory has neither file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromModelDir(const std::string& dir);
  ~Tokenizer();

  // Text must be valid UTF-8 (else INVALID_ARGUMENT). add_special_tokens applies
  // the post-processor template (e.g. a leading BOS).
  absl::StatusOr<std::vector<int32_t>> Encode(const std::string& text,
                                              bool add_special_tokens = false) const;
  // Ids out of range -> INVALID_ARGUMENT naming the id. Invalid UTF-8 in the
  // decoded bytes becomes U+FFFD (one per maximal invalid subsequence).
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  int32_t vocab_size() const { return vocab_size_; }  // max id + 1
  std::optional<int32_t> TokenToId(const std::string& token) const;
  bool IsSpecial(int32_t id) const;
  // Raw bytes one token decodes to (special tokens: their text; empty if
  // skipped), before the decoder's Strip (strip_content(), strip_start():
  // "" / 0 when it has none), which applies to the whole text.
  std::string TokenBytes(int32_t id, bool skip_special_tokens) const;
  const std::string& strip_content() const;
  int strip_start() const;
  // The BOS / EOS ids tokenizer_config.json names (tiktoken format only).
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> eos_token_id() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  explicit Tokenizer(std::unique_ptr<TiktokenModel> tiktoken);
  std::unique_ptr<Impl> impl_;               // tokenizer.json
  std::unique_ptr<TiktokenModel> tiktoken_;  // or tiktoken.model
  int32_t vocab_size_ = 0;
};

// Incremental detokenization for streaming: Push() returns only text that is
// complete, valid UTF-8; bytes of a split multi-byte character are held back
// until the rest arrives. Invalid bytes come out as U+FFFD, so output is never
// broken UTF-8 and the concatenation of all Push() results plus Finish()
// equals Decode() of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false)
      : tokenizer_(tokenizer),
        skip_special_(skip_special_tokens),
        strip_left_(tokenizer.strip_start()) {}
  absl::StatusOr<std::string> Push(int32_t id);
  std::string Finish();  // whatever is held back, made valid

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  int strip_left_;  // leading strip_content() copies still to drop
  std::string pending_;
};

// Replaces invalid UTF-8 with U+FFFD (maximal-subpart rule, like Rust's
// from_utf8_lossy). If `hold_incomplete_tail`, a truncated but so-far-valid
// sequence at the end is not emitted; its length goes to *held.
std::string SanitizeUtf8(const std::string& bytes, bool hold_incomplete_tail = false,
                         size_t* held = nullptr);

}  // namespace hmoe
