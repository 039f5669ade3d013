// The tiktoken format as Moonshot's Kimi-K2 line ships it (tokenization_kimi.py,
// class TikTokenTokenizer): `tiktoken.model`, one "base64(token bytes) rank" per
// line, ranks 0..N-1 and every single byte ranked; `tokenizer_config.json`,
// whose added_tokens_decoder names the special tokens. As tokenization_kimi.py
// builds its tiktoken.Encoding: the special ids are N .. N+255 (an id there that
// added_tokens_decoder does not name is "<|reserved_token_ID|>"), the pattern is
// Kimi's pat_str (kKimiPattern), and encode() first cuts the text into chunks
// of 400,000 code points and those where a run of whitespace or of
// non-whitespace (Python's str.isspace) passes 25,000 code points, then
// encodes each piece with tiktoken's encode(allowed_special="all") (or
// disallowed_special=() when special tokens are not allowed).
//
// Encoding matches the tiktoken package: special tokens first (leftmost, the
// longest where several start at one place; tiktoken leaves that case to its
// hash order), the pattern over the text between them, then each piece's
// token if the piece is one, else tiktoken's byte-pair merge (the adjacent
// pair whose concatenation has the lowest rank merges first, the leftmost on a
// tie; heap-ordered here). The pattern runs in PCRE2 (UTF + UCP), whose
// Unicode tables (14.0 in Debian 12's 10.42) may be older than the regex
// crate's: characters assigned since then split differently (tiktoken_test
// compares the classes with tiktoken's over every code point).
//
// Used through Tokenizer (tokenizer.h: Tokenizer::FromTiktoken, FromModelDir).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hmoe {

// Kimi's pat_str (tokenization_kimi.py), alternatives joined by "|":
//   [\p{Han}]+
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*
//       [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+
//       [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   \p{N}{1,3}
//    ?[^\s\p{L}\p{N}]+[\r\n]*
//   \s*[\r\n]+
//   \s+(?!\S)
//   \s+
// in PCRE2's syntax: a class intersection [C&&[^\p{Han}]] becomes the
// complement of Han and of the general categories C lacks; \p{Han} is \p{sc:Han} (PCRE2's bare
// \p{Han} is the Script_Extensions property, the regex crate's is Script); \s is spelled out as the
// Unicode White_Space set (PCRE2's \s also takes U+180E).
extern const char kKimiPattern[];

class TiktokenModel {
 public:
  // `rank_text` is the rank file's bytes (errors name `rank_source` and the
  // line), `config_text` tokenizer_config.json's (errors name `config_source`).
  // INVALID_ARGUMENT on: a line that is not "base64 rank", non-base64 (standard
  // alphabet, padded), a repeated token or rank, a rank outside 0..N-1, a byte
  // without a rank, a special id below N (a rank's) or past N+255, two special
  // ids with one content, a bos_token / eos_token that names no special token.
  // UNIMPLEMENTED on a tokenizer_class other than TikTokenTokenizer.
  static absl::StatusOr<std::unique_ptr<TiktokenModel>> Parse(const std::string& rank_text,
                                                              const std::string& rank_source,
                                                              const std::string& config_text,
                                                              const std::string& config_source);
  ~TiktokenModel();

  // `text` must be valid UTF-8 (not checked here). Appends the ids to *out.
  // With `allow_special`, special tokens' text becomes their ids
  // (allowed_special="all"); without, it is ordinary text.
  absl::Status Encode(absl::string_view text, bool allow_special, std::vector<int32_t>* out) const;

  // The pieces Kimi's pattern cuts valid UTF-8 `text` into, as byte ranges
  // [begin, end): what the byte-pair merge runs on (no special tokens, no
  // cuts). INVALID_ARGUMENT where PCRE2 gives up on a pathological text.
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> Split(absl::string_view text) const;

  int32_t vocab_size() const { return static_cast<int32_t>(bytes_.size()); }
  int32_t num_ranks() const { return num_ranks_; }
  // The id's bytes (a special token: its text); "" for an id out of range.
  const std::string& TokenBytes(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  // A special token by its text, else a rank by its bytes.
  std::optional<int32_t> TokenToId(absl::string_view token) const;
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }

 private:
  struct Regex;
  TiktokenModel();
  absl::Status EncodeChunk(absl::string_view text, bool allow_special,
                           std::vector<int32_t>* out) const;
  absl::Status EncodeOrdinary(absl::string_view text, std::vector<int32_t>* out) const;
  absl::Status ForEachPiece(absl::string_view text,
                            const std::function<void(size_t, size_t)>& fn) const;
  void BytePairEncode(absl::string_view piece, std::vector<int32_t>* out) const;
  void BytePairEncodeShort(absl::string_view piece, std::vector<int32_t>* out) const;
  int32_t Rank(absl::string_view bytes) const;  // -1: not a token

  // Token bytes -> rank, hashed by a short multiply-mix (tokens are short;
  // this lookup is most of the encoding time).
  struct BytesHash {
    using is_transparent = void;
    size_t operator()(absl::string_view s) const;
  };
  struct BytesEq {
    using is_transparent = void;
    bool operator()(absl::string_view a, absl::string_view b) const { return a == b; }
  };
  absl::flat_hash_map<std::string, int32_t, BytesHash, BytesEq> ranks_;
  std::vector<std::string> bytes_;  // id -> bytes (ranks, then special tokens' text)
  // Ranks of the 1- and 2-byte tokens, [b] and [256 + (b0 << 8 | b1)] (-1:
  // none), and the longest token: most lookups skip the hash map.
  std::vector<int32_t> short_rank_;
  size_t max_token_bytes_ = 0;
  int32_t num_ranks_ = 0;
  absl::flat_hash_map<std::string, int32_t> special_;
  std::vector<bool> special_flag_;  // by id - num_ranks_: added_tokens_decoder's "special"
  // First byte -> special tokens starting with it, longest first.
  std::vector<std::vector<int32_t>> special_by_first_byte_;
  std::optional<int32_t> bos_id_, eos_id_;
  std::unique_ptr<Regex> regex_;
};

}  // namespace hmoe
