// Lexer and parser of the Jinja subset (common/text/jinja/jinja.h). The lexer follows
// jinja2's (lexer.py) with trim_blocks and lstrip_blocks on and
// keep_trailing_newline off; the parser follows jinja2's parser.py.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/jinja/jinja_internal.h"

namespace hmoe::jinja::internal {

namespace {

constexpr int kMaxExprDepth = 120;  // tree height of one expression
constexpr int kMaxBlockDepth = 60;  // nested statements

// Python's str.isspace() for one code point.
bool IsPySpaceCp(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Length of the Python whitespace character at s[i], or 0.
size_t SpaceAt(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return IsPySpaceCp(c) ? 1 : 0;
  auto b = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0; };
  if (c == 0xC2 && (b(1) == 0x85 || b(1) == 0xA0)) return 2;
  if (c == 0xE1 && b(1) == 0x9A && b(2) == 0x80) return 3;
  if (c == 0xE2 && b(1) == 0x80 && (b(2) <= 0x8A || b(2) == 0xA8 || b(2) == 0xA9 || b(2) == 0xAF))
    return b(2) >= 0x80 ? 3 : 0;
  if (c == 0xE2 && b(1) == 0x81 && b(2) == 0x9F) return 3;
  if (c == 0xE3 && b(1) == 0x80 && b(2) == 0x80) return 3;
  return 0;
}

// Length of the whitespace character ending at s[end-1], or 0.
size_t SpaceBefore(std::string_view s, size_t end) {
  for (size_t n = 1; n <= 3 && n <= end; ++n)
    if (SpaceAt(s, end - n) == n) return n;
  return 0;
}

std::string_view RStripSpace(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    const size_t n = SpaceBefore(s, e);
    if (n == 0) break;
    e -= n;
  }
  return s.substr(0, e);
}

bool AllSpace(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = SpaceAt(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

enum class Tok {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string value;  // data text, name, decoded string, operator, number text
  size_t offset;
};

class Lexer {
 public:
  Lexer(std::string_view src, std::string_view name) : name_(name) {
    // Newlines normalized to \n; one trailing newline dropped.
    src_.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        src_.push_back(src[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  Pos PosOf(size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = it - line_starts_.begin();
    return Pos{static_cast<int>(line), static_cast<int>(offset - line_starts_[line - 1] + 1)};
  }

  [[noreturn]] void ErrorAt(size_t offset, const std::string& msg) const {
    const Pos p = PosOf(offset);
    Fail(absl::StrCat(name_, ":", p.line, ":", p.column, ": ", msg));
  }

  std::vector<Token> Run() {
    size_t pos = 0;
    bool line_starting = true;
    const std::string_view s = src_;
    while (pos < s.size()) {
      // Earliest tag start.
      size_t p = pos;
      int kind = 0;  // 1 var, 2 block, 3 comment
      for (; p + 1 < s.size(); ++p) {
        if (s[p] != '{') continue;
        if (s[p + 1] == '{') kind = 1;
        if (s[p + 1] == '%') kind = 2;
        if (s[p + 1] == '#') kind = 3;
        if (kind) break;
      }
      if (!kind) {
        Emit(Tok::kData, std::string(s.substr(pos)), pos);
        break;
      }
      char sign = p + 2 < s.size() && (s[p + 2] == '-' || s[p + 2] == '+') ? s[p + 2] : 0;
      std::string_view text = s.substr(pos, p - pos);
      if (sign == '-') {
        text = RStripSpace(text);
      } else if (sign != '+' && kind != 1) {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && AllSpace(text.substr(l_pos)))
          text = text.substr(0, l_pos);
      }
      if (!text.empty()) Emit(Tok::kData, std::string(text), pos);
      size_t q = p + 2 + (sign ? 1 : 0);
      if (kind == 2 && TryRaw(q, p, &pos, &line_starting)) continue;
      if (kind == 3) {
        pos = Comment(q, p, &line_starting);
        continue;
      }
      Emit(kind == 1 ? Tok::kVarBegin : Tok::kBlockBegin, "", p);
      pos = Inside(q, kind == 1, &line_starting);
    }
    Emit(Tok::kEof, "", s.size());
    return std::move(toks_);
  }

 private:
  void Emit(Tok t, std::string v, size_t off) { toks_.push_back(Token{t, std::move(v), off}); }

  // After a block end: `+%}` | `-%}\s*` | `%}\n?`; returns the end offset.
  size_t AfterEnd(size_t i, char close, bool trim, bool* line_starting) {
    const std::string_view s = src_;
    size_t end;
    if (s[i] == '+') {
      end = i + 3;
    } else if (s[i] == '-') {
      end = i + 3;
      while (end < s.size()) {
        const size_t n = SpaceAt(s, end);
        if (!n) break;
        end += n;
      }
    } else {
      end = i + 2;
      if (trim && end < s.size() && s[end] == '\n') ++end;
    }
    (void)close;
    *line_starting = end > 0 && s[end - 1] == '\n';
    return end;
  }

  bool EndAt(size_t i, char close, bool allow_plus) const {
    const std::string_view s = src_;
    auto is_end = [&](size_t k) { return k + 1 < s.size() && s[k] == close && s[k + 1] == '}'; };
    if (s[i] == '-' && is_end(i + 1)) return true;
    if (allow_plus && s[i] == '+' && is_end(i + 1)) return true;
    return is_end(i);
  }

  size_t Comment(size_t q, size_t begin, bool* line_starting) {
    const std::string_view s = src_;
    const size_t j = s.find("#}", q);
    if (j == std::string_view::npos) ErrorAt(begin, "Missing end of comment tag");
    size_t i = j;
    if (j > q && (s[j - 1] == '-' || s[j - 1] == '+')) i = j - 1;
    return AfterEnd(i, '#', true, line_starting);
  }

  // `{% raw %}...{% endraw %}` (begin without trim, end with lstrip / trim).
  bool TryRaw(size_t q, size_t begin, size_t* pos, bool* line_starting) {
    const std::string_view s = src_;
    size_t i = q;
    while (i < s.size() && SpaceAt(s, i)) i += SpaceAt(s, i);
    if (s.substr(i, 3) != "raw") return false;
    i += 3;
    while (i < s.size() && SpaceAt(s, i)) i += SpaceAt(s, i);
    size_t body;
    if (s.substr(i, 3) == "-%}") {
      body = i + 3;
      while (body < s.size() && SpaceAt(s, body)) body += SpaceAt(s, body);
    } else if (s.substr(i, 2) == "%}") {
      body = i + 2;
    } else {
      return false;
    }
    // Find `{%[-+]?\s*endraw\s*(+%}|-%}\s*|%}\n?)`.
    for (size_t k = s.find("{%", body); k != std::string_view::npos; k = s.find("{%", k + 1)) {
      size_t m = k + 2;
      char sign = m < s.size() && (s[m] == '-' || s[m] == '+') ? s[m] : 0;
      if (sign) ++m;
      while (m < s.size() && SpaceAt(s, m)) m += SpaceAt(s, m);
      if (s.substr(m, 6) != "endraw") continue;
      m += 6;
      while (m < s.size() && SpaceAt(s, m)) m += SpaceAt(s, m);
      if (!(s.substr(m, 3) == "+%}" || s.substr(m, 3) == "-%}" || s.substr(m, 2) == "%}")) continue;
      std::string_view text = s.substr(body, k - body);
      if (sign == '-') {
        text = RStripSpace(text);
      } else if (sign != '+') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
        if (l_pos > 0 && l_pos < text.size() && AllSpace(text.substr(l_pos)))
          text = text.substr(0, l_pos);
      }
      if (!text.empty()) Emit(Tok::kData, std::string(text), body);
      *pos = AfterEnd(m, '%', true, line_starting);
      return true;
    }
    ErrorAt(begin, "Missing end of raw directive");
  }

  // Tokens inside {{ }} / {% %} from q; returns the offset after the end.
  size_t Inside(size_t q, bool var, bool* line_starting) {
    const std::string_view s = src_;
    std::vector<char> balance;
    size_t i = q;
    const char close = var ? '}' : '%';
    while (true) {
      while (i < s.size() && SpaceAt(s, i)) i += SpaceAt(s, i);
      if (i >= s.size()) ErrorAt(i, "unexpected end of template");
      if (balance.empty() && EndAt(i, close, !var)) {
        Emit(var ? Tok::kVarEnd : Tok::kBlockEnd, "", i);
        return AfterEnd(i, close, !var, line_starting);
      }
      const char c = s[i];
      const size_t start = i;
      if (std::isdigit(static_cast<unsigned char>(c))) {
        i = Number(i);
        continue;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_' ||
          static_cast<unsigned char>(c) >= 0x80) {
        while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' ||
                                static_cast<unsigned char>(s[i]) >= 0x80))
          ++i;
        Emit(Tok::kName, std::string(s.substr(start, i - start)), start);
        continue;
      }
      if (c == '\'' || c == '"') {
        i = String(i);
        continue;
      }
      static const char* const kOps2[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : kOps2)
        if (s.substr(i, 2) == o) op = o;
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) != nullptr && c != 0)
        op = std::string(1, c);
      if (op.empty()) ErrorAt(i, absl::StrCat("unexpected char ", ReprString(std::string(1, c))));
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) ErrorAt(i, absl::StrCat("unexpected '", op, "'"));
        if (balance.back() != op[0])
          ErrorAt(i, absl::StrCat("unexpected '", op, "', expected '",
                                  std::string(1, balance.back()), "'"));
        balance.pop_back();
      }
      Emit(Tok::kOp, op, i);
      i += op.size();
    }
  }

  size_t Digits(size_t i, bool (*ok)(char)) const {
    const std::string_view s = src_;
    while (i < s.size() && (ok(s[i]) || (s[i] == '_' && i + 1 < s.size() && ok(s[i + 1])))) ++i;
    return i;
  }

  size_t Number(size_t i) {
    const std::string_view s = src_;
    const size_t start = i;
    auto dec = [](char c) { return c >= '0' && c <= '9'; };
    auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
    auto oct = [](char c) { return c >= '0' && c <= '7'; };
    auto bin = [](char c) { return c == '0' || c == '1'; };
    if (s[i] == '0' && i + 1 < s.size() && std::strchr("xXoObB", s[i + 1]) && s[i + 1] != 0) {
      const char k = static_cast<char>(std::tolower(s[i + 1]));
      const size_t e = Digits(i + 2, k == 'x' ? +hex : k == 'o' ? +oct : +bin);
      if (e > i + 2) {
        std::string digits;
        for (size_t j = i + 2; j < e; ++j)
          if (s[j] != '_') digits.push_back(s[j]);
        Emit(Tok::kInt, absl::StrCat(k == 'x' ? "x" : k == 'o' ? "o" : "b", digits), start);
        return e;
      }
    }
    size_t e = Digits(i, +dec);
    bool is_float = false;
    if (e + 1 < s.size() && s[e] == '.' && dec(s[e + 1])) {
      e = Digits(e + 1, +dec);
      is_float = true;
    }
    if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
      size_t k = e + 1;
      if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
      if (k < s.size() && dec(s[k])) {
        e = Digits(k, +dec);
        is_float = true;
      }
    }
    std::string text;
    for (size_t j = start; j < e; ++j)
      if (s[j] != '_') text.push_back(s[j]);
    Emit(is_float ? Tok::kFloat : Tok::kInt, text, start);
    return e;
  }

  size_t String(size_t i) {
    const std::string_view s = src_;
    const char q = s[i];
    std::string out;
    size_t j = i + 1;
    while (true) {
      if (j >= s.size()) ErrorAt(i, "unexpected char " + ReprString(std::string(1, q)));
      const char c = s[j];
      if (c == q) break;
      if (c != '\\') {
        out.push_back(c);
        ++j;
        continue;
      }
      if (j + 1 >= s.size()) ErrorAt(i, "unexpected char " + ReprString(std::string(1, q)));
      const char e = s[j + 1];
      j += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          out.push_back(e);
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
        case 'u':
        case 'U': {
          const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < n; ++k, ++j) {
            if (j >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[j])))
              ErrorAt(j,
                      absl::StrCat("truncated \\", std::string(1, e), " escape in string literal"));
            cp = cp * 16 + (std::isdigit(static_cast<unsigned char>(s[j]))
                                ? s[j] - '0'
                                : (std::tolower(s[j]) - 'a' + 10));
          }
          if (cp > 0x10FFFF) ErrorAt(j, "illegal Unicode character in string literal");
          AppendUtf8(&out, cp);
          break;
        }
        case 'N':
          ErrorAt(j - 2, "unsupported construct: \\N{...} escape in string literal");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = e - '0';
            for (int k = 0; k < 2 && j < s.size() && s[j] >= '0' && s[j] <= '7'; ++k, ++j)
              cp = cp * 8 + (s[j] - '0');
            AppendUtf8(&out, cp);
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    Emit(Tok::kString, std::move(out), i);
    return j + 1;
  }

  std::string src_;
  std::string name_;
  std::vector<size_t> line_starts_;
  std::vector<Token> toks_;
};

// jinja2 filters the parser accepts that the interpreter does not implement
// (IsFilter): rendering one fails with "No filter named".
const absl::flat_hash_set<std::string>& ParsedOnlyFilters() {
  static const auto* s = new absl::flat_hash_set<std::string>{"batch", "wordcount"};
  return *s;
}

const absl::flat_hash_set<std::string>& JinjaOnlyFilters() {
  // jinja2 filters we do not implement: a parse error names them.
  static const auto* s = new absl::flat_hash_set<std::string>{
      "filesizeformat", "format",    "groupby", "pprint",   "slice",  "striptags",
      "truncate",       "urlencode", "urlize",  "wordwrap", "xmlattr"};
  return *s;
}

class Parser {
 public:
  Parser(std::vector<Token> toks, const Lexer& lexer) : t_(std::move(toks)), lx_(lexer) {}

  Body ParseTemplate() {
    Body body = Subparse({});
    return body;
  }

 private:
  const Token& Cur() const { return t_[i_]; }
  const Token& Peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  Pos P(const Token& t) const { return lx_.PosOf(t.offset); }
  [[noreturn]] void Err(const Token& t, const std::string& msg) const {
    lx_.ErrorAt(t.offset, msg);
  }
  [[noreturn]] void Err(const std::string& msg) const { Err(Cur(), msg); }

  std::string Describe(const Token& t) const {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kString:
        return "string";
      case Tok::kInt:
        return "integer";
      case Tok::kFloat:
        return "float";
      case Tok::kData:
        return "template data";
      case Tok::kVarBegin:
        return "begin of print statement";
      case Tok::kBlockBegin:
        return "begin of statement block";
      default:
        return t.value;
    }
  }

  bool IsOp(const char* op) const { return Cur().type == Tok::kOp && Cur().value == op; }
  bool IsName(const char* n) const { return Cur().type == Tok::kName && Cur().value == n; }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    ++i_;
    return true;
  }
  bool SkipName(const char* n) {
    if (!IsName(n)) return false;
    ++i_;
    return true;
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op)) Err(absl::StrCat("expected '", op, "', got '", Describe(Cur()), "'"));
  }
  std::string ExpectName() {
    if (Cur().type != Tok::kName) Err(absl::StrCat("expected name, got '", Describe(Cur()), "'"));
    return t_[i_++].value;
  }
  void ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd)
      Err(absl::StrCat("expected end of statement block, got '", Describe(Cur()), "'"));
    ++i_;
  }

  ExprP Node(ExprKind k, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = P(at);
    return e;
  }

  // Computes the tree height; rejects over-deep expressions.
  ExprP Done(ExprP e) {
    int d = 0;
    auto see = [&](const ExprP& x) {
      if (x) d = std::max(d, x->depth);
    };
    see(e->a);
    see(e->b);
    see(e->c);
    for (const auto& x : e->items) see(x);
    for (const auto& kv : e->pairs) {
      see(kv.first);
      see(kv.second);
    }
    for (const auto& kv : e->kwargs) see(kv.second);
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth)
      FailResource(absl::StrCat("expression nested deeper than ", kMaxExprDepth, " levels at ",
                                e->pos.line, ":", e->pos.column));
    return e;
  }

  // ---- statements ----

  // Parses until a block tag whose name is in `ends` (left current: the name token).
  Body Subparse(const std::vector<std::string>& ends) {
    if (++block_depth_ > kMaxBlockDepth)
      FailResource(absl::StrCat("statements nested deeper than ", kMaxBlockDepth, " levels at ",
                                P(Cur()).line, ":", P(Cur()).column));
    Body body;
    while (true) {
      const Token& t = Cur();
      if (t.type == Tok::kEof) {
        if (!ends.empty())
          Err(absl::StrCat("unexpected end of template; expected one of: ",
                           absl::StrJoin(ends, ", ")));
        break;
      }
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->pos = P(t);
        s->text = t.value;
        body.push_back(std::move(s));
        ++i_;
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        ++i_;
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->pos = P(t);
        s->expr = ParseTuple(true, {}, false);
        if (Cur().type != Tok::kVarEnd)
          Err(absl::StrCat("expected end of print statement, got '", Describe(Cur()), "'"));
        ++i_;
        body.push_back(std::move(s));
        continue;
      }
      if (t.type == Tok::kBlockBegin) {
        const Token& nt = Peek();
        if (nt.type == Tok::kName && std::find(ends.begin(), ends.end(), nt.value) != ends.end()) {
          ++i_;  // at the end name
          break;
        }
        ++i_;
        body.push_back(ParseStatement());
        continue;
      }
      Err(absl::StrCat("unexpected '", Describe(t), "'"));
    }
    --block_depth_;
    return body;
  }

  StmtP NewStmt(StmtKind k, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->pos = P(at);
    return s;
  }

  StmtP ParseStatement() {
    const Token& t = Cur();
    if (t.type != Tok::kName) Err("tag name expected");
    const std::string& n = t.value;
    if (n == "if") return ParseIf();
    if (n == "for") return ParseFor();
    if (n == "set") return ParseSet();
    if (n == "macro") return ParseMacro();
    if (n == "call") return ParseCallBlock();
    if (n == "filter") return ParseFilterBlock();
    if (n == "with") return ParseWith();
    if (n == "generation") {
      auto s = NewStmt(StmtKind::kGeneration, t);
      ++i_;
      ExpectBlockEnd();
      s->body = Subparse({"endgeneration"});
      ++i_;
      ExpectBlockEnd();
      return s;
    }
    if (n == "break" || n == "continue") {
      if (loop_depth_ == 0) Err(absl::StrCat("'", n, "' outside of a for loop"));
      auto s = NewStmt(n == "break" ? StmtKind::kBreak : StmtKind::kContinue, t);
      ++i_;
      ExpectBlockEnd();
      return s;
    }
    static const char* const kUnsupported[] = {"extends",   "block",      "include", "import",
                                               "from",      "autoescape", "do",      "trans",
                                               "pluralize", "print"};
    for (const char* u : kUnsupported)
      if (n == u) Err(absl::StrCat("unsupported construct: '", n, "' statement"));
    Err(absl::StrCat("unknown statement '", n, "'"));
  }

  StmtP ParseIf() {
    auto s = NewStmt(StmtKind::kIf, Cur());
    ++i_;
    while (true) {
      ExprP cond = ParseTuple(false, {}, false);
      ExpectBlockEnd();
      Body body = Subparse({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      const std::string which = Cur().value;
      ++i_;
      if (which == "elif") continue;
      if (which == "else") {
        ExpectBlockEnd();
        s->else_body = Subparse({"endif"});
        ++i_;
      }
      ExpectBlockEnd();
      break;
    }
    return s;
  }

  Target ParseTarget(bool with_namespace, const std::vector<std::string>& end_names) {
    Target target;
    const bool paren = SkipOp("(");
    while (true) {
      const Token& nt = Cur();
      std::string name = ExpectName();
      if (with_namespace && !paren && SkipOp(".")) {
        target.names.push_back(std::move(name));
        target.attr = ExpectName();
        return target;
      }
      if (name == "true" || name == "false" || name == "none" || name == "True" ||
          name == "False" || name == "None")
        Err(nt, absl::StrCat("can't assign to '", name, "'"));
      target.names.push_back(std::move(name));
      if (!SkipOp(",")) break;
      target.tuple = true;
      if (paren && IsOp(")")) break;
      if (!paren && Cur().type == Tok::kName &&
          std::find(end_names.begin(), end_names.end(), Cur().value) != end_names.end())
        break;
      if (IsOp("=")) break;
    }
    if (paren) {
      ExpectOp(")");
      if (target.names.size() > 1) target.tuple = true;
    }
    return target;
  }

  StmtP ParseFor() {
    auto s = NewStmt(StmtKind::kFor, Cur());
    ++i_;
    s->target = ParseTarget(false, {"in"});
    if (!SkipName("in")) Err(absl::StrCat("expected 'in', got '", Describe(Cur()), "'"));
    s->expr = ParseTuple(false, {"recursive"}, false);
    if (SkipName("if")) s->cond = ParseExpression(true);
    if (IsName("recursive")) Err("unsupported construct: recursive for loop");
    ExpectBlockEnd();
    ++loop_depth_;
    s->body = Subparse({"endfor", "else"});
    --loop_depth_;
    if (Cur().value == "else") {
      ++i_;
      ExpectBlockEnd();
      s->else_body = Subparse({"endfor"});
    }
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  StmtP ParseSet() {
    const Token& at = Cur();
    ++i_;
    Target target = ParseTarget(true, {});
    if (SkipOp("=")) {
      auto s = NewStmt(StmtKind::kSet, at);
      s->target = std::move(target);
      s->expr = ParseTuple(true, {}, false);
      ExpectBlockEnd();
      return s;
    }
    auto s = NewStmt(StmtKind::kSetBlock, at);
    if (target.tuple) Err("block set takes a single name");
    s->target = std::move(target);
    while (SkipOp("|")) s->filters.push_back(ParseFilterCall(nullptr));
    ExpectBlockEnd();
    s->body = Subparse({"endset"});
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  void ParseSignature(std::vector<std::pair<std::string, ExprP>>* params) {
    ExpectOp("(");
    while (!IsOp(")")) {
      if (!params->empty()) ExpectOp(",");
      if (IsOp(")")) break;
      std::string name = ExpectName();
      ExprP def;
      if (SkipOp("=")) def = ParseExpression(true);
      params->emplace_back(std::move(name), std::move(def));
    }
    ExpectOp(")");
  }

  StmtP ParseMacro() {
    auto s = NewStmt(StmtKind::kMacro, Cur());
    ++i_;
    s->name = ExpectName();
    ParseSignature(&s->params);
    ExpectBlockEnd();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = Subparse({"endmacro"});
    loop_depth_ = saved;
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  StmtP ParseCallBlock() {
    auto s = NewStmt(StmtKind::kCallBlock, Cur());
    ++i_;
    if (IsOp("(")) ParseSignature(&s->params);
    s->expr = ParseExpression(true);
    if (s->expr->kind != ExprKind::kCall) Err("expected call");
    ExpectBlockEnd();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = Subparse({"endcall"});
    loop_depth_ = saved;
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  StmtP ParseFilterBlock() {
    auto s = NewStmt(StmtKind::kFilterBlock, Cur());
    ++i_;
    s->filters.push_back(ParseFilterCall(nullptr));
    while (SkipOp("|")) s->filters.push_back(ParseFilterCall(nullptr));
    ExpectBlockEnd();
    s->body = Subparse({"endfilter"});
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  StmtP ParseWith() {
    auto s = NewStmt(StmtKind::kWith, Cur());
    ++i_;
    while (Cur().type != Tok::kBlockEnd) {
      if (!s->assigns.empty()) ExpectOp(",");
      Target t = ParseTarget(false, {});
      ExpectOp("=");
      s->assigns.emplace_back(std::move(t), ParseExpression(true));
    }
    ExpectBlockEnd();
    s->body = Subparse({"endwith"});
    ++i_;
    ExpectBlockEnd();
    return s;
  }

  // ---- expressions ----

  bool TupleEnd(const std::vector<std::string>& extra) const {
    const Token& t = Cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || t.type == Tok::kEof) return true;
    if (t.type == Tok::kOp && t.value == ")") return true;
    return t.type == Tok::kName && std::find(extra.begin(), extra.end(), t.value) != extra.end();
  }

  ExprP ParseTuple(bool with_condexpr, const std::vector<std::string>& extra,
                   bool explicit_parens) {
    const Token& at = Cur();
    std::vector<ExprP> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) ExpectOp(",");
      if (TupleEnd(extra)) break;
      args.push_back(ParseExpression(with_condexpr));
      if (IsOp(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens)
        Err(absl::StrCat("Expected an expression, got '", Describe(Cur()), "'"));
    }
    auto e = Node(ExprKind::kTuple, at);
    e->items = std::move(args);
    return Done(std::move(e));
  }

  ExprP ParseExpression(bool with_condexpr) { return with_condexpr ? ParseCondExpr() : ParseOr(); }

  ExprP ParseCondExpr() {
    const Token& at = Cur();
    ExprP e1 = ParseOr();
    while (SkipName("if")) {
      ExprP cond = ParseOr();
      ExprP other;
      if (SkipName("else")) other = ParseCondExpr();
      auto e = Node(ExprKind::kCond, at);
      e->a = std::move(cond);
      e->b = std::move(e1);
      e->c = std::move(other);
      e1 = Done(std::move(e));
    }
    return e1;
  }

  ExprP ParseOr() {
    ExprP l = ParseAnd();
    while (IsName("or")) {
      const Token& at = Cur();
      ++i_;
      auto e = Node(ExprKind::kOr, at);
      e->a = std::move(l);
      e->b = ParseAnd();
      l = Done(std::move(e));
    }
    return l;
  }

  ExprP ParseAnd() {
    ExprP l = ParseNot();
    while (IsName("and")) {
      const Token& at = Cur();
      ++i_;
      auto e = Node(ExprKind::kAnd, at);
      e->a = std::move(l);
      e->b = ParseNot();
      l = Done(std::move(e));
    }
    return l;
  }

  ExprP ParseNot() {
    if (IsName("not")) {
      const Token& at = Cur();
      ++i_;
      DepthGuard g(this);
      auto e = Node(ExprKind::kNot, at);
      e->a = ParseNot();
      return Done(std::move(e));
    }
    return ParseCompare();
  }

  ExprP ParseCompare() {
    const Token& at = Cur();
    ExprP first = ParseMath1();
    auto e = Node(ExprKind::kCompare, at);
    while (true) {
      const Token& t = Cur();
      CmpOp op;
      if (t.type == Tok::kOp && t.value == "==") {
        op = CmpOp::kEq;
      } else if (t.type == Tok::kOp && t.value == "!=") {
        op = CmpOp::kNe;
      } else if (t.type == Tok::kOp && t.value == "<") {
        op = CmpOp::kLt;
      } else if (t.type == Tok::kOp && t.value == "<=") {
        op = CmpOp::kLe;
      } else if (t.type == Tok::kOp && t.value == ">") {
        op = CmpOp::kGt;
      } else if (t.type == Tok::kOp && t.value == ">=") {
        op = CmpOp::kGe;
      } else if (IsName("in")) {
        op = CmpOp::kIn;
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().value == "in") {
        op = CmpOp::kNotIn;
        ++i_;
      } else {
        break;
      }
      ++i_;
      e->ops.push_back(op);
      e->items.push_back(ParseMath1());
    }
    if (e->ops.empty()) return first;
    e->a = std::move(first);
    return Done(std::move(e));
  }

  ExprP Binary(BinOp op, ExprP l, ExprP r, const Token& at) {
    auto e = Node(ExprKind::kBinary, at);
    e->bin = op;
    e->a = std::move(l);
    e->b = std::move(r);
    return Done(std::move(e));
  }

  ExprP ParseMath1() {
    ExprP l = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& at = Cur();
      const BinOp op = at.value == "+" ? BinOp::kAdd : BinOp::kSub;
      ++i_;
      l = Binary(op, std::move(l), ParseConcat(), at);
    }
    return l;
  }

  ExprP ParseConcat() {
    const Token& at = Cur();
    ExprP first = ParseMath2();
    if (!IsOp("~")) return first;
    auto e = Node(ExprKind::kConcat, at);
    e->items.push_back(std::move(first));
    while (SkipOp("~")) e->items.push_back(ParseMath2());
    return Done(std::move(e));
  }

  ExprP ParseMath2() {
    ExprP l = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& at = Cur();
      const BinOp op = at.value == "*"    ? BinOp::kMul
                       : at.value == "/"  ? BinOp::kDiv
                       : at.value == "//" ? BinOp::kFloorDiv
                                          : BinOp::kMod;
      ++i_;
      l = Binary(op, std::move(l), ParsePow(), at);
    }
    return l;
  }

  ExprP ParsePow() {
    ExprP l = ParseUnary(true);
    while (IsOp("**")) {
      const Token& at = Cur();
      ++i_;
      l = Binary(BinOp::kPow, std::move(l), ParseUnary(true), at);
    }
    return l;
  }

  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p_(p) {
      if (++p_->expr_depth_ > kMaxExprDepth)
        FailResource(absl::StrCat("expression nested deeper than ", kMaxExprDepth, " levels at ",
                                  p_->P(p_->Cur()).line, ":", p_->P(p_->Cur()).column));
    }
    ~DepthGuard() { --p_->expr_depth_; }
    Parser* p_;
  };

  ExprP ParseUnary(bool with_filter) {
    DepthGuard g(this);
    const Token& at = Cur();
    ExprP node;
    if (IsOp("-") || IsOp("+")) {
      const bool neg = at.value == "-";
      ++i_;
      auto e = Node(neg ? ExprKind::kNeg : ExprKind::kPos, at);
      e->a = ParseUnary(false);
      node = Done(std::move(e));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprP ParsePrimary() {
    const Token& t = Cur();
    if (t.type == Tok::kName) {
      ++i_;
      auto e = Node(ExprKind::kLiteral, t);
      if (t.value == "true" || t.value == "True") {
        e->literal = Value::Bool(true);
      } else if (t.value == "false" || t.value == "False") {
        e->literal = Value::Bool(false);
      } else if (t.value == "none" || t.value == "None") {
        e->literal = Value::None();
      } else {
        e->kind = ExprKind::kName;
        e->name = t.value;
      }
      return Done(std::move(e));
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (Cur().type == Tok::kString) s += t_[i_++].value;
      auto e = Node(ExprKind::kLiteral, t);
      e->literal = Value::Str(std::move(s));
      return Done(std::move(e));
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      ++i_;
      auto e = Node(ExprKind::kLiteral, t);
      e->literal =
          t.type == Tok::kInt ? ParseInt(t) : Value::Float(std::strtod(t.value.c_str(), nullptr));
      return Done(std::move(e));
    }
    if (SkipOp("(")) {
      ExprP e = ParseTuple(true, {}, true);
      ExpectOp(")");
      return e;
    }
    if (IsOp("[")) {
      ++i_;
      auto e = Node(ExprKind::kList, t);
      while (!IsOp("]")) {
        if (!e->items.empty()) ExpectOp(",");
        if (IsOp("]")) break;
        e->items.push_back(ParseExpression(true));
      }
      ExpectOp("]");
      return Done(std::move(e));
    }
    if (IsOp("{")) {
      ++i_;
      auto e = Node(ExprKind::kDict, t);
      while (!IsOp("}")) {
        if (!e->pairs.empty()) ExpectOp(",");
        if (IsOp("}")) break;
        ExprP k = ParseExpression(true);
        ExpectOp(":");
        ExprP v = ParseExpression(true);
        e->pairs.emplace_back(std::move(k), std::move(v));
      }
      ExpectOp("}");
      return Done(std::move(e));
    }
    Err(absl::StrCat("unexpected '", Describe(t), "'"));
  }

  Value ParseInt(const Token& t) {
    const std::string& v = t.value;
    int base = 10;
    size_t start = 0;
    if (!v.empty() && (v[0] == 'x' || v[0] == 'o' || v[0] == 'b')) {
      base = v[0] == 'x' ? 16 : v[0] == 'o' ? 8 : 2;
      start = 1;
    }
    uint64_t acc = 0;
    for (size_t k = start; k < v.size(); ++k) {
      const int d = std::isdigit(static_cast<unsigned char>(v[k])) ? v[k] - '0'
                                                                   : std::tolower(v[k]) - 'a' + 10;
      if (acc > (static_cast<uint64_t>(INT64_MAX) - d) / base)
        Err(t, "unsupported construct: integer literal beyond 64 bits");
      acc = acc * base + d;
    }
    return Value::Int(static_cast<int64_t>(acc));
  }

  ExprP ParsePostfix(ExprP node) {
    while (true) {
      const Token& t = Cur();
      if (IsOp(".")) {
        ++i_;
        const Token& a = Cur();
        if (a.type == Tok::kName) {
          ++i_;
          auto e = Node(ExprKind::kGetAttr, t);
          e->a = std::move(node);
          e->name = a.value;
          node = Done(std::move(e));
        } else if (a.type == Tok::kInt) {
          ++i_;
          auto e = Node(ExprKind::kGetItem, t);
          e->a = std::move(node);
          auto idx = Node(ExprKind::kLiteral, a);
          idx->literal = ParseInt(a);
          e->b = Done(std::move(idx));
          node = Done(std::move(e));
        } else {
          Err(a, "expected name or number");
        }
      } else if (IsOp("[")) {
        ++i_;
        node = ParseSubscript(std::move(node), t);
        ExpectOp("]");
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprP ParseSubscript(ExprP obj, const Token& at) {
    ExprP parts[3];
    bool slice = false;
    int k = 0;
    if (!IsOp(":")) parts[0] = ParseExpression(true);
    while (IsOp(":") && k < 2) {
      ++i_;
      slice = true;
      ++k;
      if (!IsOp(":") && !IsOp("]")) parts[k] = ParseExpression(true);
    }
    if (IsOp(",")) Err("unsupported construct: tuple subscript");
    if (!slice) {
      auto e = Node(ExprKind::kGetItem, at);
      e->a = std::move(obj);
      e->b = std::move(parts[0]);
      return Done(std::move(e));
    }
    auto e = Node(ExprKind::kSlice, at);
    e->items.push_back(std::move(obj));
    // Slice: a = start, b = stop, c = step (each may be null).
    e->a = std::move(parts[0]);
    e->b = std::move(parts[1]);
    e->c = std::move(parts[2]);
    return Done(std::move(e));
  }

  void ParseArgs(Expr* e) {
    ExpectOp("(");
    bool first = true;
    while (!IsOp(")")) {
      if (!first) ExpectOp(",");
      first = false;
      if (IsOp(")")) break;
      if (IsOp("*") || IsOp("**")) Err("unsupported construct: *args / **kwargs in a call");
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().value == "=") {
        std::string key = t_[i_].value;
        i_ += 2;
        e->kwargs.emplace_back(std::move(key), ParseExpression(true));
      } else {
        if (!e->kwargs.empty()) Err("invalid syntax for function call expression");
        e->items.push_back(ParseExpression(true));
      }
    }
    ExpectOp(")");
  }

  ExprP ParseCall(ExprP callee) {
    auto e = Node(ExprKind::kCall, Cur());
    e->a = std::move(callee);
    ParseArgs(e.get());
    return Done(std::move(e));
  }

  // `name` or `name(args)` after a `|`; input is the filtered node (null in
  // filter blocks / set blocks).
  ExprP ParseFilterCall(ExprP input) {
    const Token& t = Cur();
    std::string name = ExpectName();
    while (SkipOp(".")) name += "." + ExpectName();
    if (!IsFilter(name) && !ParsedOnlyFilters().contains(name)) {
      if (JinjaOnlyFilters().contains(name))
        Err(t, absl::StrCat("unsupported construct: filter '", name, "'"));
      Err(t, absl::StrCat("No filter named '", name, "'."));
    }
    auto e = Node(ExprKind::kFilter, t);
    e->name = std::move(name);
    e->a = std::move(input);
    if (IsOp("(")) ParseArgs(e.get());
    return Done(std::move(e));
  }

  ExprP ParseFilterExpr(ExprP node) {
    while (true) {
      if (IsOp("|")) {
        ++i_;
        node = ParseFilterCall(std::move(node));
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprP ParseTest(ExprP node) {
    const Token& at = Cur();
    ++i_;  // is
    const bool negated = SkipName("not");
    const Token& t = Cur();
    std::string name;
    if (t.type == Tok::kName) {
      name = ExpectName();
      while (SkipOp(".")) name += "." + ExpectName();
    } else if (t.type == Tok::kOp && (t.value == "==" || t.value == "!=" || t.value == "<" ||
                                      t.value == "<=" || t.value == ">" || t.value == ">=")) {
      // jinja2 only takes a name here.
      Err(t, absl::StrCat("expected name, got '", t.value, "'"));
    } else {
      Err(t, absl::StrCat("expected name, got '", Describe(t), "'"));
    }
    if (!IsTest(name)) Err(t, absl::StrCat("No test named '", name, "' found."));
    auto e = Node(ExprKind::kTest, at);
    e->name = std::move(name);
    e->negated = negated;
    e->a = std::move(node);
    const Token& n = Cur();
    if (IsOp("(")) {
      ParseArgs(e.get());
    } else if ((n.type == Tok::kName && n.value != "else" && n.value != "or" && n.value != "and") ||
               n.type == Tok::kString || n.type == Tok::kInt || n.type == Tok::kFloat ||
               IsOp("[") || IsOp("{")) {
      if (n.type == Tok::kName && n.value == "is")
        Err(n, "You cannot chain multiple tests with is");
      DepthGuard g(this);
      e->items.push_back(ParsePostfix(ParsePrimary()));
    }
    return Done(std::move(e));
  }

  std::vector<Token> t_;
  const Lexer& lx_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int block_depth_ = 0;
  int expr_depth_ = 0;
};

}  // namespace

std::unique_ptr<Program> ParseProgram(std::string_view source, std::string_view name) {
  Lexer lexer(source, name);
  std::vector<Token> toks = lexer.Run();
  Parser parser(std::move(toks), lexer);
  auto program = std::make_unique<Program>();
  program->name = std::string(name);
  program->body = parser.ParseTemplate();
  return program;
}

}  // namespace hmoe::jinja::internal
