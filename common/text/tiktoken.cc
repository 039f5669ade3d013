#include "common/text/tiktoken.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <queue>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/small_file.h"
#include "common/status.h"
#include "common/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace hmoe {

// See tiktoken.h for the source pattern and how it is spelled here.
#define HMOE_WS                                                                                  \
  "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}" \
  "\\x{3000}"
// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] as the complement of the other
// general categories and Han (one class: no lookahead per character).
#define HMOE_UPPER "[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]"
#define HMOE_LOWER "[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]"
#define HMOE_CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
const char kKimiPattern[] =
    "\\p{sc:Han}+"
    "|[^\\r\\n\\p{L}\\p{N}]?" HMOE_UPPER "*" HMOE_LOWER "+" HMOE_CONTRACTION
    "|[^\\r\\n\\p{L}\\p{N}]?" HMOE_UPPER "+" HMOE_LOWER "*" HMOE_CONTRACTION
    "|\\p{N}{1,3}"
    "| ?[^" HMOE_WS
    "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" HMOE_WS
    "]*[\\r\\n]+"
    "|[" HMOE_WS "]+(?![^" HMOE_WS
    "])"
    "|[" HMOE_WS "]+";
#undef HMOE_WS
#undef HMOE_UPPER
#undef HMOE_LOWER
#undef HMOE_CONTRACTION

namespace {

using json = nlohmann::json;

// As tokenization_kimi.py: how many ids follow the ranks for special tokens,
// and the lengths (in code points) its encode() cuts the text at.
constexpr int32_t kNumReservedSpecialTokens = 256;
constexpr size_t kMaxEncodeChars = 400000;
constexpr size_t kMaxRunChars = 25000;
constexpr int64_t kMaxRanks = int64_t{1} << 22;
// Pieces up to this many bytes merge in tiktoken's quadratic loop on the
// stack; longer ones through a heap.
constexpr size_t kShortPiece = 64;

// Python's str.isspace() (Unicode 14; Python 3.11).
bool PyIsSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

// The code point at s[i] of valid UTF-8 and its length.
uint32_t DecodeAt(absl::string_view s, size_t i, size_t* len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
  const uint32_t c = b(0);
  if (c < 0x80 || i + 1 >= s.size()) {
    *len = 1;
    return c;
  }
  if (c < 0xe0) {
    *len = 2;
    return ((c & 0x1f) << 6) | (b(1) & 0x3f);
  }
  if (c < 0xf0 && i + 2 < s.size()) {
    *len = 3;
    return ((c & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
  }
  if (i + 3 < s.size()) {
    *len = 4;
    return ((c & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
  }
  *len = 1;
  return c;
}

int Base64Value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding; false on anything else.
bool DecodeBase64(absl::string_view in, std::string* out) {
  if (in.empty() || in.size() % 4 != 0) return false;
  out->clear();
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = in[i + static_cast<size_t>(k)];
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return false;  // data after '='
      v[k] = Base64Value(c);
      if (v[k] < 0) return false;
    }
    const uint32_t x = (static_cast<uint32_t>(v[0]) << 18) | (static_cast<uint32_t>(v[1]) << 12) |
                       (static_cast<uint32_t>(v[2]) << 6) | static_cast<uint32_t>(v[3]);
    out->push_back(static_cast<char>(x >> 16));
    if (pad < 2) out->push_back(static_cast<char>((x >> 8) & 0xff));
    if (pad < 1) out->push_back(static_cast<char>(x & 0xff));
  }
  return true;
}

// A tokenizer_config.json token field: "text", {"content": "text", ...} or null.
std::optional<std::string> TokenField(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

struct TiktokenModel::Regex {
  pcre2_code* code = nullptr;
  ~Regex() { pcre2_code_free(code); }
};

TiktokenModel::TiktokenModel() = default;
TiktokenModel::~TiktokenModel() = default;

absl::StatusOr<std::unique_ptr<TiktokenModel>> TiktokenModel::Parse(
    const std::string& rank_text, const std::string& rank_source, const std::string& config_text,
    const std::string& config_source) {
  std::unique_ptr<TiktokenModel> m(new TiktokenModel());
  const auto bad_line = [&](size_t line, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(rank_source, ": line ", line, ": ", what));
  };
  // Ranks: "base64 rank" per line; empty lines skipped as tiktoken's loader does.
  struct Entry {
    std::string bytes;
    int64_t rank;
    size_t line;
  };
  std::vector<Entry> entries;
  size_t line_no = 0;
  for (size_t pos = 0; pos < rank_text.size();) {
    size_t eol = rank_text.find('\n', pos);
    if (eol == std::string::npos) eol = rank_text.size();
    absl::string_view line(rank_text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find_first_of(" \t");
    if (sp == absl::string_view::npos || sp == 0)
      return bad_line(line_no, "not \"base64-token rank\"");
    const absl::string_view b64 = line.substr(0, sp);
    absl::string_view rank_str = line.substr(sp);
    while (!rank_str.empty() && (rank_str.front() == ' ' || rank_str.front() == '\t'))
      rank_str.remove_prefix(1);
    if (rank_str.empty() || rank_str.size() > 9 ||
        !std::all_of(rank_str.begin(), rank_str.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return bad_line(line_no, absl::StrCat("the rank \"", rank_str,
                                            "\" is not a non-negative decimal integer"));
    Entry e;
    if (!DecodeBase64(b64, &e.bytes))
      return bad_line(line_no, absl::StrCat("the token \"", b64, "\" is not base64"));
    e.rank = std::stoll(std::string(rank_str));
    e.line = line_no;
    entries.push_back(std::move(e));
    if (static_cast<int64_t>(entries.size()) > kMaxRanks)
      return bad_line(line_no, absl::StrCat("more than ", kMaxRanks, " ranks"));
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(rank_source, ": no ranks"));
  const int64_t n = static_cast<int64_t>(entries.size());
  m->num_ranks_ = static_cast<int32_t>(n);
  m->bytes_.assign(static_cast<size_t>(n), std::string());
  std::vector<size_t> rank_line(static_cast<size_t>(n), 0);
  m->ranks_.reserve(static_cast<size_t>(n));
  for (Entry& e : entries) {
    if (e.rank >= n)
      return bad_line(e.line, absl::StrCat("rank ", e.rank, " is not below the file's ", n,
                                           " ranks (ranks are 0..", n - 1, ")"));
    if (rank_line[static_cast<size_t>(e.rank)] != 0)
      return bad_line(e.line, absl::StrCat("rank ", e.rank, " repeats line ",
                                           rank_line[static_cast<size_t>(e.rank)]));
    rank_line[static_cast<size_t>(e.rank)] = e.line;
    auto [it, fresh] = m->ranks_.emplace(e.bytes, static_cast<int32_t>(e.rank));
    if (!fresh)
      return bad_line(e.line,
                      absl::StrCat("the token of rank ", e.rank, " repeats rank ", it->second,
                                   " (line ", rank_line[static_cast<size_t>(it->second)], ")"));
    m->bytes_[static_cast<size_t>(e.rank)] = std::move(e.bytes);
  }
  m->short_rank_.assign(256 + 65536, -1);
  for (const auto& [bytes, rank] : m->ranks_) {
    m->max_token_bytes_ = std::max(m->max_token_bytes_, bytes.size());
    if (bytes.size() == 1) m->short_rank_[static_cast<uint8_t>(bytes[0])] = rank;
    if (bytes.size() == 2)
      m->short_rank_[256 + (static_cast<size_t>(static_cast<uint8_t>(bytes[0])) << 8 |
                            static_cast<uint8_t>(bytes[1]))] = rank;
  }
  for (int b = 0; b < 256; ++b) {
    if (m->short_rank_[static_cast<size_t>(b)] < 0)
      return absl::InvalidArgumentError(absl::StrCat(rank_source, ": the single byte 0x",
                                                     absl::Hex(b, absl::kZeroPad2),
                                                     " has no rank (every byte needs one)"));
  }

  // Special tokens from tokenizer_config.json.
  const auto bad_config = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(config_source, ": ", what));
  };
  json cfg;
  try {
    cfg = json::parse(config_text);
  } catch (const json::exception& e) {
    return bad_config(absl::StrCat("invalid JSON: ", e.what()));
  }
  if (!cfg.is_object()) return bad_config("is not a JSON object");
  if (cfg.contains("tokenizer_class") && cfg["tokenizer_class"].is_string() &&
      cfg["tokenizer_class"].get<std::string>() != "TikTokenTokenizer")
    return absl::UnimplementedError(absl::StrCat(
        config_source, ": tokenizer_class \"", cfg["tokenizer_class"].get<std::string>(),
        "\" with tiktoken.model is not supported (Kimi's TikTokenTokenizer is)"));
  const int64_t first_special = n, end_special = n + kNumReservedSpecialTokens;
  std::vector<std::string> special_text(kNumReservedSpecialTokens);
  std::vector<bool> named(kNumReservedSpecialTokens, false);
  m->special_flag_.assign(kNumReservedSpecialTokens, true);
  if (cfg.contains("added_tokens_decoder") && !cfg["added_tokens_decoder"].is_null()) {
    const json& added = cfg["added_tokens_decoder"];
    if (!added.is_object()) return bad_config("added_tokens_decoder is not an object");
    for (auto it = added.begin(); it != added.end(); ++it) {
      const std::string& key = it.key();
      if (key.empty() || key.size() > 9 ||
          !std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return bad_config(absl::StrCat("added_tokens_decoder key \"", key, "\" is not an id"));
      const int64_t id = std::stoll(key);
      const json& v = it.value();
      if (!v.is_object() || !v.contains("content") || !v["content"].is_string() ||
          v["content"].get<std::string>().empty())
        return bad_config(
            absl::StrCat("added_tokens_decoder[\"", key, "\"] needs a non-empty content"));
      const std::string content = v["content"].get<std::string>();
      if (id < first_special)
        return bad_config(absl::StrCat("added_tokens_decoder id ", id, " (\"", content,
                                       "\") collides with the rank of line ",
                                       rank_line[static_cast<size_t>(id)], " of ", rank_source));
      if (id >= end_special)
        return bad_config(absl::StrCat("added_tokens_decoder id ", id, " (\"", content,
                                       "\") is past the special ids ", first_special, "..",
                                       end_special - 1, " that follow ", rank_source, "'s ", n,
                                       " ranks"));
      const size_t k = static_cast<size_t>(id - first_special);
      special_text[k] = content;
      named[k] = true;
      if (v.contains("special") && v["special"].is_boolean())
        m->special_flag_[k] = v["special"].get<bool>();
    }
  }
  for (int32_t k = 0; k < kNumReservedSpecialTokens; ++k) {
    const int32_t id = static_cast<int32_t>(first_special) + k;
    if (!named[static_cast<size_t>(k)])
      special_text[static_cast<size_t>(k)] = absl::StrCat("<|reserved_token_", id, "|>");
    auto [it, fresh] = m->special_.emplace(special_text[static_cast<size_t>(k)], id);
    if (!fresh)
      return bad_config(absl::StrCat("special tokens ", it->second, " and ", id, " are both \"",
                                     special_text[static_cast<size_t>(k)], "\""));
    m->bytes_.push_back(special_text[static_cast<size_t>(k)]);
  }
  m->special_by_first_byte_.assign(256, {});
  for (const auto& [text, id] : m->special_)
    m->special_by_first_byte_[static_cast<uint8_t>(text[0])].push_back(id);
  for (auto& list : m->special_by_first_byte_)
    std::sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      const size_t la = m->bytes_[static_cast<size_t>(a)].size();
      const size_t lb = m->bytes_[static_cast<size_t>(b)].size();
      return la != lb ? la > lb : a < b;
    });
  for (const char* field : {"bos_token", "eos_token"}) {
    if (!cfg.contains(field) || cfg[field].is_null()) continue;
    const std::optional<std::string> text = TokenField(cfg[field]);
    if (!text) return bad_config(absl::StrCat(field, " is not a token"));
    auto it = m->special_.find(*text);
    if (it == m->special_.end())
      return bad_config(absl::StrCat(field, " \"", *text, "\" is not a special token"));
    (absl::string_view(field) == "bos_token" ? m->bos_id_ : m->eos_id_) = it->second;
  }

  // The pattern.
  int err = 0;
  PCRE2_SIZE offset = 0;
  m->regex_ = std::make_unique<Regex>();
  m->regex_->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kKimiPattern), PCRE2_ZERO_TERMINATED,
                    PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
  if (m->regex_->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return absl::InternalError(absl::StrCat("tiktoken: Kimi's pattern does not compile at offset ",
                                            offset, ": ", reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(m->regex_->code, PCRE2_JIT_COMPLETE);  // the interpreter otherwise
  return m;
}

size_t TiktokenModel::BytesHash::operator()(absl::string_view s) const {
  // 8 bytes at a time, each word multiplied in (a wyhash-style mix).
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
  uint64_t h = s.size() * kMul;
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  }
  if (i < s.size()) {
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  }
  h *= kMul;
  return static_cast<size_t>(h ^ (h >> 32));
}

int32_t TiktokenModel::Rank(absl::string_view bytes) const {
  const auto u = [&](size_t k) { return static_cast<size_t>(static_cast<uint8_t>(bytes[k])); };
  if (bytes.size() == 1) return short_rank_[u(0)];
  if (bytes.size() == 2) return short_rank_[256 + (u(0) << 8 | u(1))];
  if (bytes.size() > max_token_bytes_) return -1;
  auto it = ranks_.find(bytes);
  return it == ranks_.end() ? -1 : it->second;
}

const std::string& TiktokenModel::TokenBytes(int32_t id) const {
  static const std::string* const kEmpty = new std::string();
  if (id < 0 || id >= vocab_size()) return *kEmpty;
  return bytes_[static_cast<size_t>(id)];
}

bool TiktokenModel::IsSpecial(int32_t id) const {
  return id >= num_ranks_ && id < vocab_size() &&
         special_flag_[static_cast<size_t>(id - num_ranks_)];
}

std::optional<int32_t> TiktokenModel::TokenToId(absl::string_view token) const {
  if (auto it = special_.find(token); it != special_.end()) return it->second;
  if (token.empty()) return std::nullopt;
  const int32_t r = Rank(token);
  if (r < 0) return std::nullopt;
  return r;
}

absl::Status TiktokenModel::Encode(absl::string_view text, bool allow_special,
                                   std::vector<int32_t>* out) const {
  // tokenization_kimi.py's cuts: chunks of kMaxEncodeChars code points, each
  // cut again before a code point that makes a run of whitespace or of
  // non-whitespace longer than kMaxRunChars.
  size_t i = 0;
  while (i < text.size()) {
    const size_t chunk_begin = i;
    size_t slice_begin = i, chars = 0, run = 0;
    bool run_space = false;
    while (i < text.size() && chars < kMaxEncodeChars) {
      size_t len = 1;
      const bool space = PyIsSpace(DecodeAt(text, i, &len));
      if (i == chunk_begin) run_space = space;
      if (space != run_space) {
        run = 1;
        run_space = space;
      } else if (++run > kMaxRunChars) {
        RETURN_IF_ERROR(EncodeChunk(text.substr(slice_begin, i - slice_begin), allow_special, out));
        slice_begin = i;
        run = 1;
      }
      i += len;
      ++chars;
    }
    RETURN_IF_ERROR(EncodeChunk(text.substr(slice_begin, i - slice_begin), allow_special, out));
  }
  return absl::OkStatus();
}

absl::Status TiktokenModel::EncodeChunk(absl::string_view text, bool allow_special,
                                        std::vector<int32_t>* out) const {
  if (!allow_special) return EncodeOrdinary(text, out);
  size_t seg = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t hit = -1;
    for (int32_t id : special_by_first_byte_[static_cast<uint8_t>(text[i])]) {
      const std::string& s = bytes_[static_cast<size_t>(id)];
      if (text.compare(i, s.size(), s) == 0) {
        hit = id;
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    RETURN_IF_ERROR(EncodeOrdinary(text.substr(seg, i - seg), out));
    out->push_back(hit);
    i += bytes_[static_cast<size_t>(hit)].size();
    seg = i;
  }
  return EncodeOrdinary(text.substr(seg), out);
}

absl::Status TiktokenModel::ForEachPiece(absl::string_view text,
                                         const std::function<void(size_t, size_t)>& fn) const {
  if (text.empty()) return absl::OkStatus();
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(regex_->code, nullptr);
  if (md == nullptr) return absl::ResourceExhaustedError("tiktoken: no memory for a regex match");
  absl::Status status;
  for (size_t pos = 0; pos < text.size();) {
    const int rc = pcre2_match(regex_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                               pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      status =
          absl::InvalidArgumentError(absl::StrCat("tiktoken: the text cannot be split at byte ",
                                                  pos, ": ", reinterpret_cast<const char*>(msg)));
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (e <= b) {  // the pattern has no empty match; step on all the same
      size_t len = 1;
      DecodeAt(text, b, &len);
      pos = b + len;
      continue;
    }
    fn(b, e);
    pos = e;
  }
  pcre2_match_data_free(md);
  return status;
}

absl::StatusOr<std::vector<std::pair<size_t, size_t>>> TiktokenModel::Split(
    absl::string_view text) const {
  std::vector<std::pair<size_t, size_t>> pieces;
  RETURN_IF_ERROR(ForEachPiece(text, [&](size_t b, size_t e) { pieces.emplace_back(b, e); }));
  return pieces;
}

absl::Status TiktokenModel::EncodeOrdinary(absl::string_view text,
                                           std::vector<int32_t>* out) const {
  return ForEachPiece(text, [&](size_t b, size_t e) {
    const absl::string_view piece = text.substr(b, e - b);
    if (const int32_t r = Rank(piece); r >= 0)
      out->push_back(r);
    else if (piece.size() <= kShortPiece)
      BytePairEncodeShort(piece, out);
    else
      BytePairEncode(piece, out);
  });
}

void TiktokenModel::BytePairEncode(absl::string_view piece, std::vector<int32_t>* out) const {
  // Parts are byte ranges [i, next[i]); the pair at i is part i and the one
  // after it. Candidates (rank, start, end of the pair) in a min-heap; one is
  // stale once part `start` is gone or its pair no longer ends at `end`.
  const uint32_t n = static_cast<uint32_t>(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  std::vector<uint8_t> gone(n, 0);
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for 0: unused
  }
  struct Cand {
    int32_t rank;
    uint32_t start, end;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : start > o.start; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  const auto offer = [&](uint32_t i) {
    const uint32_t j = next[i];
    if (j >= n) return;
    const uint32_t e = next[j];
    if (const int32_t r = Rank(piece.substr(i, e - i)); r >= 0) heap.push({r, i, e});
  };
  for (uint32_t i = 0; i + 1 < n; ++i) offer(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (gone[c.start] || next[c.start] >= n || next[next[c.start]] != c.end) continue;
    gone[next[c.start]] = 1;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    if (c.start > 0) offer(prev[c.start]);
    offer(c.start);
  }
  // Every part is a byte or a merge: always ranked.
  for (uint32_t i = 0; i < n; i = next[i]) out->push_back(Rank(piece.substr(i, next[i] - i)));
}

void TiktokenModel::BytePairEncodeShort(absl::string_view piece, std::vector<int32_t>* out) const {
  // tiktoken's own loop: parts[i] starts a part and holds the rank of it
  // merged with the next part; the lowest (leftmost on a tie) merges, its
  // neighbours' ranks are recomputed. parts[len - 1] is the end.
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  struct Part {
    uint32_t start;
    int32_t rank;
  };
  Part parts[kShortPiece + 1];
  const size_t n = piece.size();
  size_t len = n + 1;
  const auto pair_rank = [&](size_t i) {
    if (i + 2 >= len) return kNone;
    const int32_t r = Rank(piece.substr(parts[i].start, parts[i + 2].start - parts[i].start));
    return r < 0 ? kNone : r;
  };
  for (size_t i = 0; i <= n; ++i) parts[i] = {static_cast<uint32_t>(i), kNone};
  for (size_t i = 0; i + 2 <= n; ++i) parts[i].rank = pair_rank(i);
  while (len > 2) {
    int32_t best = kNone;
    size_t at = 0;
    for (size_t i = 0; i + 2 < len; ++i)
      if (parts[i].rank < best) best = parts[i].rank, at = i;
    if (best == kNone) break;
    for (size_t i = at + 1; i + 1 < len; ++i) parts[i] = parts[i + 1];
    --len;
    parts[at].rank = pair_rank(at);
    if (at > 0) parts[at - 1].rank = pair_rank(at - 1);
  }
  for (size_t i = 0; i + 1 < len; ++i)
    out->push_back(Rank(piece.substr(parts[i].start, parts[i + 1].start - parts[i].start)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTiktoken(const std::string& model_path,
                                                                   const std::string& config_path) {
  ASSIGN_OR_RETURN(std::string ranks, ReadSmallFile(model_path, kMaxTokenizerJsonBytes));
  ASSIGN_OR_RETURN(std::string config, ReadSmallFile(config_path, kMaxConfigJsonBytes));
  ASSIGN_OR_RETURN(auto model, TiktokenModel::Parse(ranks, model_path, config, config_path));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(model)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromModelDir(const std::string& dir) {
  const std::filesystem::path d(dir);
  const std::string json_path = (d / "tokenizer.json").string();
  auto from_json = FromFile(json_path);
  if (!absl::IsNotFound(from_json.status())) return from_json;
  const std::string model_path = (d / "tiktoken.model").string();
  const std::string config_path = (d / "tokenizer_config.json").string();
  auto from_tiktoken = FromTiktoken(model_path, config_path);
  if (!absl::IsNotFound(from_tiktoken.status())) return from_tiktoken;
  std::error_code ec;
  if (std::filesystem::exists(model_path, ec))
    return absl::InvalidArgumentError(
        absl::StrCat(model_path, ": needs tokenizer_config.json beside it (its special tokens)"));
  return absl::NotFoundError(
      absl::StrCat(dir, ": no tokenizer (neither tokenizer.json nor tiktoken.model)"));
}

}  // namespace hmoe
