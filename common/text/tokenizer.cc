#include "common/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>
#include <queue>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/small_file.h"
#include "common/status.h"
#include "common/text/tiktoken.h"
#include "common/text/unicode_nfc.h"
#include "nlohmann/json.hpp"

namespace hmoe {
namespace {

// Token ids above this are refused: real vocabularies stay under 1M, and the
// id -> token table is sized by the largest id.
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;

using json = nlohmann::json;

// What `name` stands for in `table` (a JSON field's spellings), or nullopt.
template <typename T>
std::optional<T> Lookup(std::string_view name,
                        std::initializer_list<std::pair<std::string_view, T>> table) {
  for (const auto& [spelling, value] : table)
    if (spelling == name) return value;
  return std::nullopt;
}

// ---- UTF-8 --------------------------------------------------------------------

// Length of the valid sequence starting at s[i] (0 if s[i] cannot start one),
// or, when the input ends early, how many bytes were consumed so far (negative).
// `bad_at` receives the index of the first byte that broke the sequence.
int Utf8Sequence(const std::string& s, size_t i, size_t* bad_at) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return 1;
  int need;
  uint8_t lo = 0x80, hi = 0xbf;  // allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf)
    need = 1;
  else if (c == 0xe0)
    need = 2, lo = 0xa0;
  else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef)
    need = 2;
  else if (c == 0xed)
    need = 2, hi = 0x9f;
  else if (c == 0xf0)
    need = 3, lo = 0x90;
  else if (c >= 0xf1 && c <= 0xf3)
    need = 3;
  else if (c == 0xf4)
    need = 3, hi = 0x8f;
  else {
    *bad_at = i + 1;
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + static_cast<size_t>(k) >= s.size()) return -k;  // truncated after k bytes
    const uint8_t x = b(i + static_cast<size_t>(k));
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xbf;
    if (x < l || x > h) {
      *bad_at = i + static_cast<size_t>(k);
      return 0;
    }
  }
  return need + 1;
}

constexpr char kReplacement[] = "\xef\xbf\xbd";

// GPT-2's reversible byte <-> printable-character map used by ByteLevel.
struct ByteMap {
  std::string to_char[256];                       // byte -> UTF-8 of its character
  std::unordered_map<uint32_t, uint8_t> to_byte;  // code point -> byte
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      std::string u;
      if (cp < 0x80) {
        u.push_back(static_cast<char>(cp));
      } else {
        u.push_back(static_cast<char>(0xc0 | (cp >> 6)));
        u.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
      }
      to_char[b] = u;
      to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& Bytes() {
  static const ByteMap* m = new ByteMap();
  return *m;
}

// Splits valid UTF-8 into its characters.
std::vector<std::string> Chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    int n = Utf8Sequence(s, i, &bad);
    if (n <= 0) n = 1;  // not reached for validated input
    out.push_back(s.substr(i, static_cast<size_t>(n)));
    i += static_cast<size_t>(n);
  }
  return out;
}

uint32_t CodePoint(const std::string& ch) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(ch[k])); };
  switch (ch.size()) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
    case 3:
      return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
  }
}

// ---- regex ----------------------------------------------------------------------

class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern,
                                                        const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return absl::InvalidArgumentError(absl::StrCat(where, ": regex does not compile at offset ",
                                                     offset, ": ",
                                                     reinterpret_cast<const char*>(msg)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional speed-up; interpreter otherwise
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Non-overlapping matches [begin, end) in `s`, left to right (empty ones
  // only with `keep_empty`, as a Replace normalizer counts them). A matching
  // error (PCRE2's match or depth limit on a pathological input) is
  // INVALID_ARGUMENT naming `where`: splitting there silently would change
  // the ids.
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> FindAll(const std::string& s,
                                                                 const std::string& where,
                                                                 bool keep_empty = false) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (md == nullptr) return absl::ResourceExhaustedError(where + ": no memory for a regex match");
    size_t pos = 0;
    absl::Status status;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                                 PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        status =
            absl::InvalidArgumentError(absl::StrCat(where, ": the text cannot be split at byte ",
                                                    pos, ": ", reinterpret_cast<const char*>(msg)));
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step over one character
        if (keep_empty) out.emplace_back(b, e);
        if (b >= s.size()) break;
        size_t bad = 0;
        int n = Utf8Sequence(s, b, &bad);
        pos = b + static_cast<size_t>(n > 0 ? n : 1);
        continue;
      }
      out.emplace_back(b, e);
      pos = e;
    }
    pcre2_match_data_free(md);
    if (!status.ok()) return status;
    return out;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizer {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  // kMetaspace: spaces become `replacement`, prepended per `prepend`
  // (always; first: only at the start of the text; never); with `regex`
  // (split), each replacement starts a new piece.
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  std::string replacement;
  std::string where;             // "tokenizer.json: pre_tokenizer Split", for errors
  std::unique_ptr<Regex> regex;  // kSplit, and kByteLevel with use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;
};

const char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::StatusOr<std::vector<std::string>> ApplySplit(const PreTokenizer& p, const std::string& s) {
  struct Seg {
    size_t b, e;
    bool delim;
  };
  std::vector<Seg> segs;
  size_t cursor = 0;
  ASSIGN_OR_RETURN(auto matches, p.regex->FindAll(s, p.where));
  for (auto [b, e] : matches) {
    if (b > cursor) segs.push_back({cursor, b, p.invert});
    segs.push_back({b, e, !p.invert});
    cursor = e;
  }
  if (cursor < s.size()) segs.push_back({cursor, s.size(), p.invert});
  std::vector<std::string> out;
  if (p.behavior == SplitBehavior::kMergedWithNext) {
    // As Hugging Face tokenizers: from the end, a delimiter joins the piece
    // after it unless that piece is a delimiter itself ("a--b" -> "a", "-",
    // "-b"); a final delimiter stands alone.
    bool next_delim = false;
    for (auto g = segs.rbegin(); g != segs.rend(); ++g) {
      std::string piece = s.substr(g->b, g->e - g->b);
      if (g->delim && !next_delim && !out.empty())
        out.back() = piece + out.back();
      else
        out.push_back(std::move(piece));
      next_delim = g->delim;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  bool last_delim = false;
  for (const Seg& g : segs) {
    std::string piece = s.substr(g.b, g.e - g.b);
    switch (p.behavior) {
      case SplitBehavior::kIsolated:
        out.push_back(piece);
        break;
      case SplitBehavior::kRemoved:
        if (!g.delim) out.push_back(piece);
        break;
      case SplitBehavior::kMergedWithPrevious:
        if (g.delim && !out.empty() && !last_delim)
          out.back() += piece;
        else
          out.push_back(piece);
        break;
      case SplitBehavior::kMergedWithNext:  // handled above
        break;
      case SplitBehavior::kContiguous:
        if (g.delim && last_delim && !out.empty())
          out.back() += piece;
        else
          out.push_back(piece);
        break;
    }
    last_delim = g.delim;
  }
  return out;
}

// One step of the normalizer chain (a Sequence is flattened into steps).
struct NormalizerStep {
  enum Kind { kNfc, kNfd, kReplace, kPrepend } kind;
  std::unique_ptr<Regex> pattern;  // kReplace
  std::string content;             // kReplace: the replacement; kPrepend: the prefix
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool lstrip, rstrip;
};

// A Metaspace pre-tokenizer's or decoder's prepend_scheme; files from
// before tokenizers 0.14 say add_prefix_space instead (true: always).
std::string MetaspacePrependScheme(const json& m) {
  return m.value("prepend_scheme", m.value("add_prefix_space", true) ? "always" : "never");
}

// A regex matching `literal` exactly.
std::string QuoteRegex(const std::string& literal) {
  std::string regex;
  for (char c : literal) {
    if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) regex += '\\';
    regex += c;
  }
  return regex;
}

// A tokenizer.json pattern ({"Regex": r} or {"String": s}) as a regex into
// *regex; false when it is neither.
bool PatternRegex(const json& pattern, std::string* regex) {
  if (pattern.contains("Regex")) {
    *regex = pattern["Regex"].get<std::string>();
  } else if (pattern.contains("String")) {
    *regex = QuoteRegex(pattern["String"].get<std::string>());
  } else {
    return false;
  }
  return true;
}

bool IsSpaceByte(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where unused
  // (left id << 32 | right id) -> {rank, merged id}
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool ignore_merges = false;
  std::optional<int32_t> unk_id;
  // byte_fallback: a character outside the vocabulary becomes its UTF-8
  // bytes' <0xXX> tokens (when all exist); fuse_unk: consecutive unknown
  // characters make one unk_token.
  bool byte_fallback = false, fuse_unk = false;
  int32_t byte_token[256];
  // Decoder: ByteLevel (byte-level characters back to bytes), or the
  // SentencePiece chain Replace* / ByteFallback / Fuse / Strip.
  bool sentencepiece_decoder = false;
  std::vector<std::pair<std::string, std::string>> decode_replace;  // in order
  bool decode_byte_fallback = false;
  std::string strip_content;
  int strip_start = 0, strip_stop = 0;
  std::vector<AddedToken> added;  // sorted by content length, longest first
  // First byte -> indices into `added` starting with it, longest first.
  std::vector<std::vector<uint32_t>> added_by_first_byte = std::vector<std::vector<uint32_t>>(256);
  std::unordered_map<int32_t, size_t> added_by_id;
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizer> pre;
  std::vector<std::vector<int32_t>>
      template_ids;  // post-processor: sequence of parts; {-1} marks "A"
  bool has_template = false;

  absl::StatusOr<std::string> Normalize(std::string text) const {
    for (const NormalizerStep& n : normalizer) {
      switch (n.kind) {
        case NormalizerStep::kNfc:
          text = NormalizeNfc(text);
          break;
        case NormalizerStep::kNfd:
          text = NormalizeNfd(text);
          break;
        case NormalizerStep::kPrepend:
          if (!text.empty()) text.insert(0, n.content);
          break;
        case NormalizerStep::kReplace: {
          ASSIGN_OR_RETURN(auto matches,
                           n.pattern->FindAll(text, "normalizer Replace", /*keep_empty=*/true));
          if (matches.empty()) break;
          std::string out;
          size_t cursor = 0;
          for (auto [b, e] : matches) {
            out.append(text, cursor, b - cursor);
            out += n.content;
            cursor = e;
          }
          out.append(text, cursor, std::string::npos);
          text = std::move(out);
          break;
        }
      }
    }
    return text;
  }

  // `at_text_start`: the segment begins the text (no added token before it).
  absl::Status EncodeSegment(const std::string& raw, std::vector<int32_t>& out,
                             bool at_text_start) const {
    ASSIGN_OR_RETURN(std::string text, Normalize(raw));
    if (text.empty()) return absl::OkStatus();  // normalized away: no tokens
    std::vector<std::string> pieces = {text};
    for (const PreTokenizer& p : pre) {
      std::vector<std::string> next;
      for (std::string& piece : pieces) {
        if (p.kind == PreTokenizer::kSplit) {
          ASSIGN_OR_RETURN(auto parts, ApplySplit(p, piece));
          for (auto& x : parts) next.push_back(std::move(x));
          continue;
        }
        if (p.kind == PreTokenizer::kMetaspace) {
          std::string m = absl::StrReplaceAll(piece, {{" ", p.replacement}});
          const bool first = at_text_start && &piece == &pieces.front();
          if ((p.prepend == PreTokenizer::kAlways ||
               (p.prepend == PreTokenizer::kFirst && first)) &&
              m.compare(0, p.replacement.size(), p.replacement) != 0)
            m.insert(0, p.replacement);
          if (!p.regex) {
            next.push_back(std::move(m));
            continue;
          }
          ASSIGN_OR_RETURN(auto parts, ApplySplit(p, m));
          for (auto& x : parts) next.push_back(std::move(x));
          continue;
        }
        if (p.add_prefix_space && (piece.empty() || piece[0] != ' '))
          piece.insert(piece.begin(), ' ');
        std::vector<std::string> parts = {piece};
        if (p.regex) {
          ASSIGN_OR_RETURN(parts, ApplySplit(p, piece));
        }
        for (const std::string& part : parts) {
          std::string mapped;
          for (char c : part) mapped += Bytes().to_char[static_cast<uint8_t>(c)];
          next.push_back(std::move(mapped));
        }
      }
      pieces = std::move(next);
    }
    for (const std::string& piece : pieces) {
      if (piece.empty()) continue;
      RETURN_IF_ERROR(Bpe(piece, out));
    }
    return absl::OkStatus();
  }

  // Merges by rank, lowest first (equal ranks: leftmost first), as Hugging
  // Face's BPE does: a heap of candidate pairs over a linked list of
  // symbols, O(n log n) in the word's length (a word is any run of letters,
  // so a request decides how long it is).
  absl::Status Bpe(const std::string& word, std::vector<int32_t>& out) const {
    if (ignore_merges) {
      auto it = vocab.find(word);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return absl::OkStatus();
      }
    }
    struct Sym {
      // -1: a character outside the vocabulary: it never merges and ends as
      // unk_token (not merged or fused as Hugging Face's unk is; byte-level
      // vocabularies hold every byte, so this does not arise there).
      int32_t id;
      int prev, next;
      size_t begin, len;  // bytes of `word`; len 0: merged into its left neighbour
    };
    std::vector<Sym> sym;
    for (size_t i = 0; i < word.size();) {
      size_t bad = 0;
      int n = Utf8Sequence(word, i, &bad);
      if (n <= 0) n = 1;  // not reached for validated input
      auto it = vocab.find(word.substr(i, static_cast<size_t>(n)));
      bool bytes_known = it == vocab.end() && byte_fallback;
      for (int k = 0; bytes_known && k < n; ++k)
        bytes_known = byte_token[static_cast<uint8_t>(word[i + static_cast<size_t>(k)])] >= 0;
      if (bytes_known) {
        for (int k = 0; k < n; ++k) {
          const int at = static_cast<int>(sym.size());
          sym.push_back({byte_token[static_cast<uint8_t>(word[i + static_cast<size_t>(k)])], at - 1,
                         at + 1, i + static_cast<size_t>(k), 1});
        }
      } else {
        const int at = static_cast<int>(sym.size());
        sym.push_back(
            {it == vocab.end() ? -1 : it->second, at - 1, at + 1, i, static_cast<size_t>(n)});
      }
      i += static_cast<size_t>(n);
    }
    if (sym.empty()) return absl::OkStatus();
    sym.back().next = -1;
    struct Cand {
      int32_t rank;
      int pos;
      int32_t merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    auto pair_of = [&](int l) -> const std::pair<int32_t, int32_t>* {
      const int r = sym[static_cast<size_t>(l)].next;
      if (r < 0) return nullptr;
      const int32_t a = sym[static_cast<size_t>(l)].id, b = sym[static_cast<size_t>(r)].id;
      if (a < 0 || b < 0) return nullptr;
      auto it = merges.find((uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b));
      return it == merges.end() ? nullptr : &it->second;
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto offer = [&](int l) {
      if (const auto* m = pair_of(l)) heap.push({m->first, l, m->second});
    };
    for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) offer(i);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      Sym& l = sym[static_cast<size_t>(c.pos)];
      if (l.len == 0) continue;  // merged away since
      const auto* m = pair_of(c.pos);
      if (m == nullptr || m->second != c.merged) continue;  // its right side changed
      Sym& r = sym[static_cast<size_t>(l.next)];
      l.id = c.merged;
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (l.next >= 0) sym[static_cast<size_t>(l.next)].prev = c.pos;
      if (l.prev >= 0) offer(l.prev);
      offer(c.pos);
    }
    bool last_unknown = false;
    for (int i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) {
      const Sym& x = sym[static_cast<size_t>(i)];
      const bool unknown = x.id < 0;
      if (!unknown) {
        out.push_back(x.id);
      } else if (unk_id) {
        if (!(fuse_unk && last_unknown)) out.push_back(*unk_id);
      } else {
        return absl::InternalError(absl::StrCat("tokenizer: symbol \"", word.substr(x.begin, x.len),
                                                "\" is not in the vocabulary and there is no "
                                                "unk_token"));
      }
      last_unknown = unknown;
    }
    return absl::OkStatus();
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  int32_t n = static_cast<int32_t>(impl_->id_to_token.size());
  vocab_size_ = n;
}
Tokenizer::Tokenizer(std::unique_ptr<TiktokenModel> tiktoken)
    : tiktoken_(std::move(tiktoken)), vocab_size_(tiktoken_->vocab_size()) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxTokenizerJsonBytes));
  return FromJson(text, path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(const std::string& json_text,
                                                               const std::string& src) {
  auto impl = std::make_unique<Impl>();
  try {
    json j = json::parse(json_text);
    auto invalid = [&](const std::string& field, const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(src, ": ", field, " ", what));
    };
    auto unimplemented = [&](const std::string& field, const std::string& type) {
      return absl::UnimplementedError(
          absl::StrCat(src, ": ", field, " type \"", type, "\" is not supported"));
    };
    if (!j.is_object()) return invalid("document", "is not an object");

    // model
    if (!j.contains("model") || !j["model"].is_object()) return invalid("model", "is missing");
    const json& m = j["model"];
    const std::string mtype = m.value("type", "BPE");
    if (mtype != "BPE") return unimplemented("model", mtype);
    impl->byte_fallback = m.value("byte_fallback", false);
    impl->fuse_unk = m.value("fuse_unk", false);
    for (const char* opt : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(opt) && !m[opt].is_null() &&
          !(m[opt].is_string() && m[opt].get<std::string>().empty()))
        return unimplemented(absl::StrCat("model.", opt),
                             m[opt].is_string() ? m[opt].get<std::string>() : m[opt].dump());
    }
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].is_number() &&
        m["dropout"].get<double>() > 0)
      return unimplemented("model.dropout", m["dropout"].dump());
    if (!m.contains("vocab") || !m["vocab"].is_object())
      return invalid("model.vocab", "is missing");
    int32_t max_id = -1;
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
          it.value().get<int64_t>() > kMaxTokenId)
        return invalid("model.vocab", absl::StrCat("entry \"", it.key(), "\" has no valid id"));
      const int32_t id = it.value().get<int32_t>();
      impl->vocab[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    impl->ignore_merges = m.value("ignore_merges", false);
    if (m.contains("merges") && m["merges"].is_array()) {
      int32_t rank = 0;
      for (const auto& mg : m["merges"]) {
        std::string a, b;
        if (mg.is_string()) {
          const std::string s = mg.get<std::string>();
          const size_t sp = s.find(' ');
          if (sp == std::string::npos)
            return invalid("model.merges", absl::StrCat("entry \"", s, "\" is not \"a b\""));
          a = s.substr(0, sp);
          b = s.substr(sp + 1);
        } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
          a = mg[0].get<std::string>();
          b = mg[1].get<std::string>();
        } else {
          return invalid("model.merges", absl::StrCat("entry ", mg.dump(), " is not a pair"));
        }
        // As Hugging Face refuses them: both sides and the result in the vocabulary.
        auto ia = impl->vocab.find(a), ib = impl->vocab.find(b), iab = impl->vocab.find(a + b);
        if (ia == impl->vocab.end() || ib == impl->vocab.end() || iab == impl->vocab.end())
          return invalid("model.merges",
                         absl::StrCat("entry ", rank, " (\"", a, "\" + \"", b, "\") has ",
                                      ia == impl->vocab.end()   ? "a first token"
                                      : ib == impl->vocab.end() ? "a second token"
                                                                : "a result",
                                      " outside model.vocab"));
        const uint64_t key =
            (uint64_t{static_cast<uint32_t>(ia->second)} << 32) | static_cast<uint32_t>(ib->second);
        // A repeated pair takes its last rank, as Hugging Face's map keeps.
        impl->merges.insert_or_assign(key, std::make_pair(rank, iab->second));
        ++rank;
      }
    }

    // normalizer (applied to the text between added tokens)
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      std::vector<const json*> todo = {&j["normalizer"]};
      while (!todo.empty()) {
        const json& n = *todo.front();
        todo.erase(todo.begin());
        const std::string type = n.value("type", "");
        NormalizerStep step{};
        if (type == "Sequence") {
          const json& list = n.at("normalizers");
          std::vector<const json*> inner;
          for (const auto& x : list) inner.push_back(&x);
          todo.insert(todo.begin(), inner.begin(), inner.end());
          continue;
        } else if (type == "NFC") {
          step.kind = NormalizerStep::kNfc;
        } else if (type == "NFD") {
          step.kind = NormalizerStep::kNfd;
        } else if (type == "Prepend") {
          step.kind = NormalizerStep::kPrepend;
          step.content = n.at("prepend").get<std::string>();
        } else if (type == "Replace") {
          step.kind = NormalizerStep::kReplace;
          std::string regex;
          if (!PatternRegex(n.at("pattern"), &regex))
            return invalid("normalizer.Replace.pattern", "needs Regex or String");
          if (regex.empty()) return invalid("normalizer.Replace.pattern", "is empty");
          ASSIGN_OR_RETURN(step.pattern, Regex::Compile(regex, src + ": normalizer Replace"));
          step.content = n.at("content").get<std::string>();
        } else {
          return unimplemented("normalizer", type.empty() ? "?" : type);
        }
        impl->normalizer.push_back(std::move(step));
      }
    }
    std::fill(std::begin(impl->byte_token), std::end(impl->byte_token), -1);
    if (impl->byte_fallback) {
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = impl->vocab.find(name);
        if (it != impl->vocab.end()) impl->byte_token[b] = it->second;
      }
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = impl->vocab.find(m["unk_token"].get<std::string>());
      if (it != impl->vocab.end()) impl->unk_id = it->second;
    }

    // added tokens
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (const auto& t : j["added_tokens"]) {
        if (!t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
            !t["content"].is_string())
          return invalid("added_tokens", absl::StrCat("entry ", t.dump(), " needs id and content"));
        const int64_t id = t["id"].get<int64_t>();
        if (id < 0 || id > kMaxTokenId)
          return invalid("added_tokens", absl::StrCat("entry ", t.dump(), " has an id outside [0, ",
                                                      kMaxTokenId, "]"));
        AddedToken a{static_cast<int32_t>(id), t["content"].get<std::string>(),
                     t.value("special", false), t.value("lstrip", false), t.value("rstrip", false)};
        if (a.content.empty())
          return invalid("added_tokens", absl::StrCat("entry ", t.dump(), " is invalid"));
        max_id = std::max(max_id, a.id);
        impl->added.push_back(std::move(a));
      }
    }
    std::stable_sort(impl->added.begin(), impl->added.end(),
                     [](const AddedToken& x, const AddedToken& y) {
                       return x.content.size() > y.content.size();
                     });
    for (size_t i = 0; i < impl->added.size(); ++i) {
      impl->added_by_id[impl->added[i].id] = i;
      impl->added_by_first_byte[static_cast<uint8_t>(impl->added[i].content[0])].push_back(
          static_cast<uint32_t>(i));
    }
    impl->id_to_token.assign(static_cast<size_t>(max_id + 1), "");
    for (const auto& [tok, id] : impl->vocab) impl->id_to_token[static_cast<size_t>(id)] = tok;

    // pre-tokenizer
    std::vector<const json*> pre;
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
      const json& p = j["pre_tokenizer"];
      if (p.value("type", "") == "Sequence") {
        for (const auto& x : p.at("pretokenizers")) pre.push_back(&x);
      } else {
        pre.push_back(&p);
      }
    }
    for (const json* p : pre) {
      const std::string type = p->value("type", "");
      PreTokenizer pt{};
      pt.where = absl::StrCat(src, ": pre_tokenizer ", type);
      if (type == "Split") {
        pt.kind = PreTokenizer::kSplit;
        std::string regex;
        if (!PatternRegex(p->at("pattern"), &regex))
          return invalid("pre_tokenizer.Split.pattern", "needs Regex or String");
        ASSIGN_OR_RETURN(pt.regex, Regex::Compile(regex, src + ": pre_tokenizer Split"));
        const std::string beh = p->value("behavior", "Isolated");
        const std::optional<SplitBehavior> b =
            Lookup<SplitBehavior>(beh, {{"Isolated", SplitBehavior::kIsolated},
                                        {"Removed", SplitBehavior::kRemoved},
                                        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
                                        {"MergedWithNext", SplitBehavior::kMergedWithNext},
                                        {"Contiguous", SplitBehavior::kContiguous}});
        if (!b) return unimplemented("pre_tokenizer.Split.behavior", beh);
        pt.behavior = *b;
        pt.invert = p->value("invert", false);
      } else if (type == "Digits") {
        pt.kind = PreTokenizer::kSplit;
        const bool individual = p->value("individual_digits", false);
        ASSIGN_OR_RETURN(pt.regex, Regex::Compile(individual ? "\\p{N}" : "\\p{N}+",
                                                  src + ": pre_tokenizer Digits"));
      } else if (type == "Metaspace") {
        pt.kind = PreTokenizer::kMetaspace;
        pt.replacement = p->value("replacement", std::string("\xe2\x96\x81"));
        if (pt.replacement.empty())
          return invalid("pre_tokenizer.Metaspace.replacement", "is empty");
        const std::string scheme = MetaspacePrependScheme(*p);
        const auto prepend =
            Lookup<PreTokenizer::Prepend>(scheme, {{"always", PreTokenizer::kAlways},
                                                   {"first", PreTokenizer::kFirst},
                                                   {"never", PreTokenizer::kNever}});
        if (!prepend) return unimplemented("pre_tokenizer.Metaspace.prepend_scheme", scheme);
        pt.prepend = *prepend;
        if (p->value("split", true)) {
          pt.behavior = SplitBehavior::kMergedWithNext;
          ASSIGN_OR_RETURN(pt.regex, Regex::Compile(QuoteRegex(pt.replacement),
                                                    src + ": pre_tokenizer Metaspace"));
        }
      } else if (type == "ByteLevel") {
        pt.kind = PreTokenizer::kByteLevel;
        pt.add_prefix_space = p->value("add_prefix_space", false);
        if (p->value("use_regex", true)) {
          ASSIGN_OR_RETURN(pt.regex,
                           Regex::Compile(kGpt2Pattern, src + ": pre_tokenizer ByteLevel"));
        }
      } else {
        return unimplemented("pre_tokenizer", type);
      }
      impl->pre.push_back(std::move(pt));
    }

    // decoder: ByteLevel (or none), or the SentencePiece chain.
    if (j.contains("decoder") && !j["decoder"].is_null()) {
      const json& d = j["decoder"];
      const std::string type = d.value("type", "");
      if (type != "ByteLevel") {
        std::vector<const json*> steps;
        if (type == "Sequence") {
          for (const auto& x : d.at("decoders")) steps.push_back(&x);
        } else {
          steps.push_back(&d);
        }
        impl->sentencepiece_decoder = true;
        bool fused = false;
        for (const json* x : steps) {
          const std::string t = x->value("type", "");
          if (fused && t != "Strip")
            return unimplemented("decoder", absl::StrCat(t, " after Fuse"));
          if (t == "Replace") {
            const json& pat = x->at("pattern");
            if (!pat.contains("String"))
              return unimplemented("decoder.Replace.pattern", pat.dump());
            impl->decode_replace.emplace_back(pat["String"].get<std::string>(),
                                              x->at("content").get<std::string>());
          } else if (t == "Metaspace") {
            // The replacement back to spaces; the first token's leading space
            // dropped unless nothing was prepended (as a Strip of 1).
            impl->decode_replace.emplace_back(x->value("replacement", std::string("\xe2\x96\x81")),
                                              " ");
            const std::string scheme = MetaspacePrependScheme(*x);
            if (scheme != "never") {
              impl->strip_content = " ";
              impl->strip_start = 1;
            }
          } else if (t == "ByteFallback") {
            impl->decode_byte_fallback = true;
          } else if (t == "Fuse") {
            fused = true;
          } else if (t == "Strip") {
            impl->strip_content = x->at("content").get<std::string>();
            impl->strip_start = x->at("start").get<int>();
            impl->strip_stop = x->at("stop").get<int>();
            if (impl->strip_content.empty() || impl->strip_start < 0 || impl->strip_stop < 0)
              return invalid("decoder.Strip", "needs a content and start, stop >= 0");
          } else {
            return unimplemented("decoder", t.empty() ? "?" : t);
          }
        }
      }
    }

    // post-processor
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      const json& pp = j["post_processor"];
      const std::string type = pp.value("type", "");
      if (type == "TemplateProcessing") {
        impl->has_template = true;
        const json& special = pp.at("special_tokens");
        for (const auto& item : pp.at("single")) {
          if (item.contains("Sequence")) {
            impl->template_ids.push_back({-1});
          } else if (item.contains("SpecialToken")) {
            const std::string name = item.at("SpecialToken").at("id").get<std::string>();
            if (!special.contains(name))
              return invalid("post_processor", absl::StrCat("template names \"", name,
                                                            "\" without special_tokens entry"));
            impl->template_ids.push_back(special.at(name).at("ids").get<std::vector<int32_t>>());
          }
        }
      } else if (type != "ByteLevel") {
        return unimplemented("post_processor", type);
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": invalid tokenizer JSON: ", e.what()));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(const std::string& text,
                                                       bool add_special_tokens) const {
  for (size_t i = 0; i < text.size();) {  // valid UTF-8 (no copy)
    size_t bad = 0;
    const int n = Utf8Sequence(text, i, &bad);
    if (n <= 0) return absl::InvalidArgumentError("text is not valid UTF-8");
    i += static_cast<size_t>(n);
  }
  if (tiktoken_) {
    std::vector<int32_t> ids;
    RETURN_IF_ERROR(tiktoken_->Encode(text, /*allow_special=*/true, &ids));
    return ids;
  }
  const Impl& t = *impl_;
  std::vector<int32_t> ids;
  // Split on added tokens: at each position the longest added token wins.
  size_t seg_begin = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (uint32_t k : t.added_by_first_byte[static_cast<uint8_t>(text[i])]) {
      const AddedToken& a = t.added[k];
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t seg_end = i, next = i + hit->content.size();
    if (hit->lstrip)
      while (seg_end > seg_begin && IsSpaceByte(text[seg_end - 1])) --seg_end;
    if (hit->rstrip)
      while (next < text.size() && IsSpaceByte(text[next])) ++next;
    if (seg_end > seg_begin)
      RETURN_IF_ERROR(
          t.EncodeSegment(text.substr(seg_begin, seg_end - seg_begin), ids, seg_begin == 0));
    ids.push_back(hit->id);
    seg_begin = i = next;
  }
  if (seg_begin < text.size())
    RETURN_IF_ERROR(t.EncodeSegment(text.substr(seg_begin), ids, seg_begin == 0));
  if (!add_special_tokens || !t.has_template) return ids;
  std::vector<int32_t> out;
  for (const auto& part : t.template_ids) {
    if (part.size() == 1 && part[0] == -1)
      out.insert(out.end(), ids.begin(), ids.end());
    else
      out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

const std::string& Tokenizer::strip_content() const {
  static const std::string* const kNone = new std::string();
  return tiktoken_ ? *kNone : impl_->strip_content;
}
int Tokenizer::strip_start() const { return tiktoken_ ? 0 : impl_->strip_start; }

std::optional<int32_t> Tokenizer::bos_token_id() const {
  return tiktoken_ ? tiktoken_->bos_id() : std::nullopt;
}
std::optional<int32_t> Tokenizer::eos_token_id() const {
  return tiktoken_ ? tiktoken_->eos_id() : std::nullopt;
}

std::optional<int32_t> Tokenizer::TokenToId(const std::string& token) const {
  if (tiktoken_) return tiktoken_->TokenToId(token);
  for (const AddedToken& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  if (tiktoken_) return tiktoken_->IsSpecial(id);
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

std::string Tokenizer::TokenBytes(int32_t id, bool skip_special_tokens) const {
  if (tiktoken_)
    return skip_special_tokens && tiktoken_->IsSpecial(id) ? std::string()
                                                           : tiktoken_->TokenBytes(id);
  auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) {
    const AddedToken& a = impl_->added[it->second];
    return a.special && skip_special_tokens ? std::string() : a.content;
  }
  if (id < 0 || id >= vocab_size_) return std::string();
  const std::string& tok = impl_->id_to_token[static_cast<size_t>(id)];
  if (impl_->sentencepiece_decoder) {
    // <0xXX> is its byte; any other piece with the Replace steps applied.
    if (impl_->decode_byte_fallback && tok.size() == 6 && tok.compare(0, 3, "<0x") == 0 &&
        tok[5] == '>' && std::isxdigit(static_cast<unsigned char>(tok[3])) &&
        std::isxdigit(static_cast<unsigned char>(tok[4])))
      return std::string(1, static_cast<char>(std::stoi(tok.substr(3, 2), nullptr, 16)));
    std::string out = tok;
    for (const auto& [from, to] : impl_->decode_replace)
      out = absl::StrReplaceAll(out, {{from, to}});
    return out;
  }
  std::string out;
  for (const std::string& ch : Chars(tok)) {
    auto b = Bytes().to_byte.find(CodePoint(ch));
    if (b != Bytes().to_byte.end())
      out.push_back(static_cast<char>(b->second));
    else
      out += ch;
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_)
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab_size_, ")"));
    bytes += TokenBytes(id, skip_special_tokens);
  }
  if (tiktoken_) return SanitizeUtf8(bytes);
  const std::string& c = impl_->strip_content;
  if (!c.empty()) {
    size_t b = 0, e = bytes.size();
    for (int i = 0; i < impl_->strip_start && bytes.compare(b, c.size(), c) == 0; ++i)
      b += c.size();
    for (int i = 0; i < impl_->strip_stop && e >= b + c.size() &&
                    bytes.compare(e - c.size(), c.size(), c) == 0;
         ++i)
      e -= c.size();
    bytes = bytes.substr(b, e - b);
  }
  return SanitizeUtf8(bytes);
}

std::string SanitizeUtf8(const std::string& s, bool hold_incomplete_tail, size_t* held) {
  std::string out;
  out.reserve(s.size());
  if (held) *held = 0;
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    const int n = Utf8Sequence(s, i, &bad);
    if (n > 0) {
      out.append(s, i, static_cast<size_t>(n));
      i += static_cast<size_t>(n);
    } else if (n < 0) {  // truncated at the end of input
      if (hold_incomplete_tail) {
        if (held) *held = s.size() - i;
        return out;
      }
      out += kReplacement;
      if (held) *held = 0;
      i = s.size();
    } else {
      out += kReplacement;
      i = bad;
    }
  }
  return out;
}

absl::StatusOr<std::string> StreamDecoder::Push(int32_t id) {
  if (id < 0 || id >= tokenizer_.vocab_size())
    return absl::InvalidArgumentError(absl::StrCat(
        "token id ", id, " is outside the vocabulary [0, ", tokenizer_.vocab_size(), ")"));
  pending_ += tokenizer_.TokenBytes(id, skip_special_);
  // The decoder's Strip at the start of the text (its end is not known
  // while streaming): up to strip_start leading copies, once.
  const std::string& c = tokenizer_.strip_content();
  while (!c.empty() && strip_left_ > 0 && !pending_.empty()) {
    if (pending_.compare(0, c.size(), c) == 0) {
      pending_.erase(0, c.size());
      --strip_left_;
    } else if (pending_.size() < c.size() && c.compare(0, pending_.size(), pending_) == 0) {
      break;  // a partial match: wait for more
    } else {
      strip_left_ = 0;
    }
  }
  size_t held = 0;
  std::string ready = SanitizeUtf8(pending_, /*hold_incomplete_tail=*/true, &held);
  pending_.erase(0, pending_.size() - held);
  return ready;
}

std::string StreamDecoder::Finish() {
  std::string out = SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace hmoe
