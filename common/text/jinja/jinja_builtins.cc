// Filters, tests and str / dict / list methods of the Jinja interpreter
// (common/text/jinja/jinja.h), as jinja2 3.1 and Python 3 define them, plus
// transformers' tojson. Filters, methods and tests are tables of named
// functions (Filters(), StrMethods(), ..., Tests()), one function per filter,
// method or test family.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/text/jinja/jinja_internal.h"
#include "common/text/jinja/jinja_runtime.h"

namespace hmoe::jinja::internal {

// ---------------------------------------------------------------- text

namespace {

std::vector<uint32_t> Decode(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += DecodeUtf8One(s, i, &cp);
    out.push_back(cp);
  }
  return out;
}

// DecodeUtf8One's inverse: an escaped byte (0xDC80..0xDCFF) goes back as itself.
void AppendCp(std::string* out, uint32_t cp) {
  if (cp >= 0xDC80 && cp <= 0xDCFF) {
    out->push_back(static_cast<char>(cp - 0xDC00));
  } else {
    AppendUtf8(out, cp);
  }
}

std::string Encode(const std::vector<uint32_t>& cps) {
  std::string out;
  for (uint32_t c : cps) AppendCp(&out, c);
  return out;
}

bool IsSpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Simple case mappings: ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic.
uint32_t Lower1(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0x80) return c;
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
  if (c >= 0x100 && c <= 0x137 && c != 0x130) return c | 1;
  if (c >= 0x139 && c <= 0x148) return (c & 1) ? c + 1 : c;
  if (c >= 0x14A && c <= 0x177) return c | 1;
  if (c == 0x178) return 0xFF;
  if (c >= 0x179 && c <= 0x17E) return (c & 1) ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x4FF))
    return c | 1;
  return c;
}

uint32_t Upper1(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0x80) return c;
  if (c == 0xB5) return 0x39C;
  if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c >= 0x100 && c <= 0x137 && c != 0x131) return c & ~1u;
  if (c == 0x131) return 'I';
  if (c >= 0x139 && c <= 0x148) return (c & 1) ? c : c - 1;
  if (c >= 0x14A && c <= 0x177) return c & ~1u;
  if (c >= 0x179 && c <= 0x17E) return (c & 1) ? c : c - 1;
  if (c == 0x17F) return 'S';
  if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 32;
  if (c == 0x3C2) return 0x3A3;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 37;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 63;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x4FF))
    return c & ~1u;
  return c;
}

bool Cased(uint32_t c) { return Lower1(c) != c || Upper1(c) != c || c == 0xDF || c == 0x149; }
bool IsLowerCp(uint32_t c) { return Upper1(c) != c || c == 0xDF || c == 0x138 || c == 0x149; }
bool IsUpperCp(uint32_t c) { return Lower1(c) != c || c == 0x130; }

void AppendUpper(std::vector<uint32_t>* out, uint32_t c) {
  if (c == 0xDF) {
    out->push_back('S');
    out->push_back('S');
  } else if (c == 0x149) {
    out->push_back(0x2BC);
    out->push_back('N');
  } else {
    out->push_back(Upper1(c));
  }
}

void AppendLower(std::vector<uint32_t>* out, const std::vector<uint32_t>& s, size_t i) {
  const uint32_t c = s[i];
  if (c == 0x130) {
    out->push_back('i');
    out->push_back(0x307);
  } else if (c == 0x3A3) {
    // Final sigma: preceded by a cased letter and not followed by one.
    bool before = false, after = false;
    for (size_t k = i; k > 0; --k) {
      if (Cased(s[k - 1])) {
        before = true;
        break;
      }
      if (s[k - 1] != '\'' && s[k - 1] != 0x2019) break;
    }
    for (size_t k = i + 1; k < s.size(); ++k) {
      if (Cased(s[k])) {
        after = true;
        break;
      }
      if (s[k] != '\'' && s[k] != 0x2019) break;
    }
    out->push_back(before && !after ? 0x3C2 : 0x3C3);
  } else {
    out->push_back(Lower1(c));
  }
}

std::string UpperStr(const std::string& s) {
  std::vector<uint32_t> out;
  for (uint32_t c : Decode(s)) AppendUpper(&out, c);
  return Encode(out);
}

std::string LowerStr(const std::string& s) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> out;
  for (size_t i = 0; i < cps.size(); ++i) AppendLower(&out, cps, i);
  return Encode(out);
}

// Python str.title().
std::string TitleStr(const std::string& s) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> out;
  bool prev_cased = false;
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t c = cps[i];
    if (prev_cased) {
      AppendLower(&out, cps, i);
    } else if (c == 0xDF) {
      out.push_back('S');
      out.push_back('s');
    } else {
      out.push_back(Upper1(c));
    }
    prev_cased = Cased(c);
  }
  return Encode(out);
}

// Python str.capitalize().
std::string CapitalizeStr(const std::string& s) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      if (cps[0] == 0xDF) {
        out.push_back('S');
        out.push_back('s');
      } else {
        out.push_back(Upper1(cps[0]));
      }
    } else {
      AppendLower(&out, cps, i);
    }
  }
  return Encode(out);
}

// jinja2's title filter: split before runs of [-\s({\[<]+, capitalize
// each piece's first character, lowercase the rest.
std::string JinjaTitle(const std::string& s) {
  const std::vector<uint32_t> cps = Decode(s);
  auto sep = [](uint32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsSpace(c);
  };
  std::vector<uint32_t> out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool is_sep = sep(cps[i]);
    while (j < cps.size() && sep(cps[j]) == is_sep) ++j;
    // piece [i, j)
    std::vector<uint32_t> piece(cps.begin() + i, cps.begin() + j);
    AppendUpper(&out, piece[0]);
    for (size_t k = 1; k < piece.size(); ++k) AppendLower(&out, piece, k);
    i = j;
  }
  return Encode(out);
}

// Python str.strip / lstrip / rstrip with chars (nullopt: whitespace).
std::string StripStr(const std::string& s, const std::optional<std::string>& chars, bool left,
                     bool right) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> set;
  if (chars) set = Decode(*chars);
  auto strip = [&](uint32_t c) {
    if (!chars) return IsSpace(c);
    return std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && strip(cps[a])) ++a;
  if (right)
    while (b > a && strip(cps[b - 1])) --b;
  return Encode(std::vector<uint32_t>(cps.begin() + a, cps.begin() + b));
}

std::vector<std::string> SplitWhitespace(const std::string& s, int64_t maxsplit, bool from_right) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<std::pair<size_t, size_t>> words;
  size_t i = 0;
  while (i < cps.size()) {
    while (i < cps.size() && IsSpace(cps[i])) ++i;
    if (i >= cps.size()) break;
    size_t j = i;
    while (j < cps.size() && !IsSpace(cps[j])) ++j;
    words.emplace_back(i, j);
    i = j;
  }
  std::vector<std::string> out;
  if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
    for (auto& w : words) out.push_back(Encode({cps.begin() + w.first, cps.begin() + w.second}));
    return out;
  }
  const size_t keep = static_cast<size_t>(maxsplit);
  if (!from_right) {
    for (size_t k = 0; k < keep; ++k)
      out.push_back(Encode({cps.begin() + words[k].first, cps.begin() + words[k].second}));
    // The rest: from the next word start to the end, right-stripped? No: kept as is.
    size_t start = words[keep].first;
    size_t end = cps.size();
    while (end > start && IsSpace(cps[end - 1])) --end;
    out.push_back(Encode({cps.begin() + start, cps.begin() + end}));
  } else {
    const size_t first = words.size() - keep;
    size_t start = 0;
    while (start < cps.size() && IsSpace(cps[start])) ++start;
    out.push_back(Encode({cps.begin() + start, cps.begin() + words[first - 1].second}));
    for (size_t k = first; k < words.size(); ++k)
      out.push_back(Encode({cps.begin() + words[k].first, cps.begin() + words[k].second}));
  }
  return out;
}

std::vector<std::string> SplitSep(const std::string& s, const std::string& sep, int64_t maxsplit,
                                  bool from_right) {
  if (sep.empty()) Fail("empty separator");
  std::vector<std::string> out;
  if (!from_right) {
    size_t pos = 0;
    int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      const size_t k = s.find(sep, pos);
      if (k == std::string::npos) break;
      out.push_back(s.substr(pos, k - pos));
      pos = k + sep.size();
      ++n;
    }
    out.push_back(s.substr(pos));
    return out;
  }
  size_t end = s.size();
  int64_t n = 0;
  std::vector<std::string> rev;
  while (maxsplit < 0 || n < maxsplit) {
    if (end < sep.size()) break;
    const size_t k = s.rfind(sep, end - sep.size());
    if (k == std::string::npos) break;
    rev.push_back(s.substr(k + sep.size(), end - k - sep.size()));
    end = k;
    ++n;
  }
  rev.push_back(s.substr(0, end));
  return std::vector<std::string>(rev.rbegin(), rev.rend());
}

std::string ReplaceStr(const std::string& s, const std::string& old, const std::string& rep,
                       int64_t count) {
  std::string out;
  if (old.empty()) {
    const std::vector<std::string> chars = SplitChars(s);
    int64_t n = 0;
    for (size_t i = 0; i <= chars.size(); ++i) {
      if (count < 0 || n < count) {
        out += rep;
        ++n;
      }
      if (i < chars.size()) out += chars[i];
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t k = s.find(old, pos);
    if (k == std::string::npos) break;
    out.append(s, pos, k - pos);
    out += rep;
    pos = k + old.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// Python str.splitlines().
std::vector<std::string> SplitLines(const std::string& s, bool keepends) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t c = cps[i];
    const bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
                    c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) continue;
    size_t end = i + 1;
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') end = i + 2;
    out.push_back(Encode({cps.begin() + start, cps.begin() + (keepends ? end : i)}));
    start = end;
    i = end - 1;
  }
  if (start < cps.size()) out.push_back(Encode({cps.begin() + start, cps.end()}));
  return out;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ---------------------------------------------------------------- tojson

struct JsonOpts {
  bool ensure_ascii = false;
  std::optional<std::string> indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

void JsonString(std::string* out, const std::string& s, bool ensure_ascii) {
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = DecodeUtf8One(s, i, &cp);
    char buf[16];
    switch (cp) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          *out += buf;
        } else if (ensure_ascii && cp >= 0x7F) {
          if (cp >= 0x10000) {
            const uint32_t v = cp - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10),
                          0xDC00 + (v & 0x3FF));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          }
          *out += buf;
        } else {
          out->append(s, i, n);
        }
    }
    i += n;
  }
  out->push_back('"');
}

std::string JsonFloat(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return FloatRepr(d);
}

void JsonDump(std::string* out, const Value& v, const JsonOpts& o, int level, Interp& in) {
  in.Step();
  if (level > kMaxValueDepth) FailResource("tojson: value nested too deeply");
  auto newline = [&](int lvl) {
    *out += "\n";
    for (int k = 0; k < lvl; ++k) *out += *o.indent;
  };
  switch (v.kind()) {
    case Kind::kNone:
      *out += "null";
      return;
    case Kind::kBool:
      *out += v.b() ? "true" : "false";
      return;
    case Kind::kInt:
      absl::StrAppend(out, v.i());
      return;
    case Kind::kFloat:
      *out += JsonFloat(v.f());
      return;
    case Kind::kString:
      JsonString(out, v.s(), o.ensure_ascii);
      return;
    case Kind::kList: {
      if (v.flavor() == Flavor::kIter || v.flavor() == Flavor::kView)
        Fail(absl::StrCat("Object of type ", PyTypeName(v), " is not JSON serializable"));
      const auto& items = v.items();
      if (items.empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) *out += o.indent ? std::string(o.item_sep) : o.item_sep;
        if (o.indent) newline(level + 1);
        JsonDump(out, items[i], o, level + 1, in);
      }
      if (o.indent) newline(level);
      out->push_back(']');
      return;
    }
    case Kind::kDict: {
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict().items) items.push_back(&kv);
      if (items.empty()) {
        *out += "{}";
        return;
      }
      auto key_str = [](const Value& k) -> std::string {
        switch (k.kind()) {
          case Kind::kString:
            return k.s();
          case Kind::kInt:
            return absl::StrCat(k.i());
          case Kind::kFloat:
            return JsonFloat(k.f());
          case Kind::kBool:
            return k.b() ? "true" : "false";
          case Kind::kNone:
            return "null";
          default:
            Fail(absl::StrCat("keys must be str, int, float, bool or None, not ", PyTypeName(k)));
        }
      };
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return Less(a->first, b->first); });
      out->push_back('{');
      bool first = true;
      for (const auto* kv : items) {
        if (!first) *out += o.item_sep;
        first = false;
        if (o.indent) newline(level + 1);
        JsonString(out, key_str(kv->first), o.ensure_ascii);
        *out += o.key_sep;
        JsonDump(out, kv->second, o, level + 1, in);
      }
      if (o.indent) newline(level);
      out->push_back('}');
      return;
    }
    default:
      Fail(absl::StrCat("Object of type ", PyTypeName(v), " is not JSON serializable"));
  }
}

// ---------------------------------------------------------------- args

// Positional-or-keyword arguments of a filter / method / test (after the
// input value).
class Args {
 public:
  Args(CallArgs& a, std::string fname, std::vector<std::string> names)
      : a_(a), fname_(std::move(fname)), names_(std::move(names)) {
    if (a_.pos.size() > names_.size())
      Fail(absl::StrCat(fname_, "() takes at most ", names_.size(), " argument(s) (", a_.pos.size(),
                        " given)"));
    for (const auto& kv : a_.kw)
      if (std::find(names_.begin(), names_.end(), kv.first) == names_.end())
        Fail(absl::StrCat(fname_, "() got an unexpected keyword argument '", kv.first, "'"));
  }
  std::optional<Value> Get(size_t i) const {
    if (i < a_.pos.size()) return a_.pos[i];
    for (const auto& kv : a_.kw)
      if (kv.first == names_[i]) return kv.second;
    return std::nullopt;
  }
  Value Or(size_t i, Value def) const {
    auto v = Get(i);
    return v ? *v : def;
  }
  int64_t Int(size_t i, int64_t def) const {
    auto v = Get(i);
    if (!v || v->is_none()) return def;
    if (v->is_undefined()) FailUndefined(*v);
    if (!v->is_int() && !v->is_bool())
      Fail(absl::StrCat(fname_, "(): '", PyTypeName(*v),
                        "' object cannot be interpreted as an integer"));
    return v->i();
  }
  bool Bool(size_t i, bool def) const {
    auto v = Get(i);
    return v ? Truthy(*v) : def;
  }
  std::optional<std::string> OptStr(size_t i) const {
    auto v = Get(i);
    if (!v || v->is_none()) return std::nullopt;
    if (v->is_undefined()) FailUndefined(*v);
    if (!v->is_string())
      Fail(absl::StrCat(fname_, "() argument must be str or None, not ", PyTypeName(*v)));
    return v->s();
  }
  std::string Str(size_t i) const {
    auto v = Get(i);
    if (!v) Fail(absl::StrCat(fname_, "() missing required argument '", names_[i], "'"));
    if (v->is_undefined()) FailUndefined(*v);
    if (!v->is_string())
      Fail(absl::StrCat(fname_, "() argument must be str, not ", PyTypeName(*v)));
    return v->s();
  }

 private:
  CallArgs& a_;
  std::string fname_;
  std::vector<std::string> names_;
};

// Python int(str) / float(str).
std::optional<int64_t> ParsePyInt(const std::string& text, int base) {
  std::string s = StripStr(text, std::nullopt, true, true);
  bool neg = false;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if ((base == 16 || base == 8 || base == 2 || base == 0) && i + 1 < s.size() && s[i] == '0') {
    const char p = static_cast<char>(std::tolower(s[i + 1]));
    const int b = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (b && (base == b || base == 0)) {
      base = b;
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (base == 0) base = 10;
  if (i >= s.size()) return std::nullopt;
  __int128 acc = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {
      if (!prev_digit || i + 1 >= s.size() || s[i + 1] == '_') return std::nullopt;
      prev_digit = false;
      continue;
    }
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (std::isalpha(static_cast<unsigned char>(c)))
      d = std::tolower(c) - 'a' + 10;
    else
      return std::nullopt;
    if (d >= base) return std::nullopt;
    acc = acc * base + d;
    if (acc > static_cast<__int128>(INT64_MAX) + 1)
      Fail("integer overflow (this renderer's integers are 64-bit)");
    prev_digit = true;
  }
  if (neg) acc = -acc;
  if (acc > INT64_MAX) Fail("integer overflow (this renderer's integers are 64-bit)");
  return static_cast<int64_t>(acc);
}

std::optional<double> ParsePyFloat(const std::string& text) {
  std::string s = StripStr(text, std::nullopt, true, true);
  std::string t;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {
      if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[i + 1])))
        return std::nullopt;
      continue;
    }
    t.push_back(s[i]);
  }
  if (t.empty()) return std::nullopt;
  std::string lower = LowerStr(t);
  size_t k = lower[0] == '+' || lower[0] == '-' ? 1 : 0;
  const std::string body = lower.substr(k);
  const bool neg = lower[0] == '-';
  if (body == "inf" || body == "infinity") return neg ? -HUGE_VAL : HUGE_VAL;
  if (body == "nan") return std::nan("");
  // digits [. digits] [e [+-] digits], at least one digit in the mantissa
  size_t i = k;
  bool digits = false;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) i++, digits = true;
  if (i < t.size() && t[i] == '.') {
    ++i;
    while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) i++, digits = true;
  }
  if (!digits) return std::nullopt;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    bool ed = false;
    while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) i++, ed = true;
    if (!ed) return std::nullopt;
  }
  if (i != t.size()) return std::nullopt;
  return std::strtod(t.c_str(), nullptr);
}

// Python round(x, ndigits) for a float (correctly rounded, half to even).
double PyRound(double x, int64_t nd) {
  if (!std::isfinite(x) || x == 0) return x;
  if (nd > 300) return x;
  if (nd >= 0) {
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(nd), x);
    return std::strtod(buf, nullptr);
  }
  if (nd < -308) return 0.0 * x;
  const double p = std::pow(10.0, static_cast<double>(-nd));
  const double y = x / p;
  double r = std::round(y);
  if (std::fabs(y - std::trunc(y)) == 0.5) r = 2.0 * std::round(y / 2.0);
  return r * p;
}

}  // namespace

std::vector<std::string> SplitChars(const std::string& s) {
  std::vector<std::string> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = DecodeUtf8One(s, i, &cp);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// ---------------------------------------------------------------- methods

namespace {

// A filter (`input | name(args)`) or a method (`input.name(args)`). `name` is
// the name it was called by: aliases share a function, and errors name what
// the template wrote.
using BuiltinOp = Value (*)(Interp& in, const std::string& name, const Value& input,
                            CallArgs& args);

Value StrStrip(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"chars"});
  return Value::Str(StripStr(self.s(), p.OptStr(0), name != "rstrip", name != "lstrip"));
}

Value StrSplit(Interp& in, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"sep", "maxsplit"});
  const auto sep = p.OptStr(0);
  const int64_t maxsplit = p.Int(1, -1);
  const std::vector<std::string> parts =
      sep ? SplitSep(self.s(), *sep, maxsplit, name == "rsplit")
          : SplitWhitespace(self.s(), maxsplit, name == "rsplit");
  in.CheckItems(parts.size());
  std::vector<Value> out;
  for (const auto& x : parts) out.push_back(Value::Str(x));
  return Value::List(std::move(out));
}

// startswith / endswith.
Value StrAffixTest(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  const std::string& s = self.s();
  Args p(a, name, {"prefix"});
  const Value arg = p.Or(0, Value());
  std::vector<std::string> cands;
  if (arg.is_string()) {
    cands.push_back(arg.s());
  } else if (arg.is_tuple()) {
    for (const Value& x : arg.items()) {
      if (!x.is_string())
        Fail(absl::StrCat("tuple for ", name, " must only contain str, not ", PyTypeName(x)));
      cands.push_back(x.s());
    }
  } else {
    if (arg.is_undefined() && a.pos.size() + a.kw.size() > 0) FailUndefined(arg);
    Fail(absl::StrCat(name, " first arg must be str or a tuple of str, not ", PyTypeName(arg)));
  }
  for (const std::string& c : cands) {
    if (name == "startswith"
            ? s.compare(0, c.size(), c) == 0 && s.size() >= c.size()
            : s.size() >= c.size() && s.compare(s.size() - c.size(), c.size(), c) == 0)
      return Value::Bool(true);
  }
  return Value::Bool(false);
}

Value StrReplace(Interp& in, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"old", "new", "count"});
  const std::string r = ReplaceStr(self.s(), p.Str(0), p.Str(1), p.Int(2, -1));
  in.CheckString(r.size());
  return Value::Str(r);
}

Value StrUpper(Interp&, const std::string&, const Value& self, CallArgs&) {
  return Value::Str(UpperStr(self.s()));
}

Value StrLower(Interp&, const std::string&, const Value& self, CallArgs&) {
  return Value::Str(LowerStr(self.s()));
}

Value StrTitle(Interp&, const std::string&, const Value& self, CallArgs&) {
  return Value::Str(TitleStr(self.s()));
}

Value StrCapitalize(Interp&, const std::string&, const Value& self, CallArgs&) {
  return Value::Str(CapitalizeStr(self.s()));
}

// find / rfind / index / rindex / count.
Value StrFind(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  const std::string& s = self.s();
  Args p(a, name, {"sub"});
  const std::string sub = p.Str(0);
  if (name == "count") {
    if (sub.empty()) return Value::Int(static_cast<int64_t>(SplitChars(s).size()) + 1);
    int64_t n = 0;
    for (size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++n;
    return Value::Int(n);
  }
  const size_t k = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
  if (k == std::string::npos) {
    if (name == "index" || name == "rindex") Fail("substring not found");
    return Value::Int(-1);
  }
  return Value::Int(static_cast<int64_t>(SplitChars(s.substr(0, k)).size()));
}

Value StrJoin(Interp& in, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"iterable"});
  std::string out;
  size_t i = 0;
  for (const Value& x : in.Iterate(p.Or(0, Value()))) {
    if (!x.is_string())
      Fail(absl::StrCat("sequence item ", i, ": expected str instance, ", PyTypeName(x), " found"));
    if (i++) out += self.s();
    out += x.s();
    in.CheckString(out.size());
  }
  return Value::Str(out);
}

Value StrSplitlines(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"keepends"});
  std::vector<Value> out;
  for (const auto& x : SplitLines(self.s(), p.Bool(0, false))) out.push_back(Value::Str(x));
  return Value::List(std::move(out));
}

// removeprefix / removesuffix.
Value StrRemoveAffix(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  const std::string& s = self.s();
  Args p(a, name, {"affix"});
  const std::string x = p.Str(0);
  if (name == "removeprefix" && s.compare(0, x.size(), x) == 0 && s.size() >= x.size())
    return Value::Str(s.substr(x.size()));
  if (name == "removesuffix" && !x.empty() && s.size() >= x.size() &&
      s.compare(s.size() - x.size(), x.size(), x) == 0)
    return Value::Str(s.substr(0, s.size() - x.size()));
  return self;
}

// isspace / isdigit / isalpha / isalnum / islower / isupper / isascii.
Value StrIsClass(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {});
  const std::vector<uint32_t> cps = Decode(self.s());
  if (name == "isascii")
    return Value::Bool(std::all_of(cps.begin(), cps.end(), [](uint32_t c) { return c < 0x80; }));
  if (cps.empty()) return Value::Bool(false);
  if (name == "islower" || name == "isupper") {
    bool any = false;
    for (uint32_t c : cps) {
      if (!Cased(c)) continue;
      any = true;
      if (name == "islower" ? !IsLowerCp(c) : !IsUpperCp(c)) return Value::Bool(false);
    }
    return Value::Bool(any);
  }
  for (uint32_t c : cps) {
    bool ok;
    if (name == "isspace") {
      ok = IsSpace(c);
    } else if (name == "isdigit") {
      ok = c >= '0' && c <= '9';
    } else {
      const bool alpha = (c < 0x80 && std::isalpha(static_cast<int>(c))) || (c >= 0x80 && Cased(c));
      ok = name == "isalpha" ? alpha : alpha || (c >= '0' && c <= '9');
    }
    if (!ok) return Value::Bool(false);
  }
  return Value::Bool(true);
}

Value DictGet(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"key", "default"});
  const Value key = p.Or(0, Value());
  if (!p.Get(0)) Fail("get expected at least 1 argument, got 0");
  if (key.is_list() || key.is_dict())
    Fail(absl::StrCat("unhashable type: '", PyTypeName(key), "'"));
  const Value* v = self.dict().Find(key);
  return v ? *v : p.Or(1, Value::None());
}

// items / keys / values.
Value DictView(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {});
  std::vector<Value> out;
  for (const auto& kv : self.dict().items) {
    if (name == "items")
      out.push_back(Value::List({kv.first, kv.second}, true));
    else
      out.push_back(name == "keys" ? kv.first : kv.second);
  }
  return Value::Seq(std::move(out), Flavor::kView, absl::StrCat("dict_", name));
}

Value DictCopy(Interp&, const std::string&, const Value& self, CallArgs&) { return self; }

Value ListCopy(Interp&, const std::string&, const Value& self, CallArgs&) {
  return Value::List(self.items(), self.is_tuple());
}

// count / index of a list or tuple.
Value ListFind(Interp&, const std::string& name, const Value& self, CallArgs& a) {
  Args p(a, name, {"value"});
  const Value x = p.Or(0, Value());
  int64_t n = 0;
  for (size_t i = 0; i < self.items().size(); ++i) {
    if (!Equal(self.items()[i], x)) continue;
    if (name == "index") return Value::Int(static_cast<int64_t>(i));
    ++n;
  }
  if (name == "index") Fail(absl::StrCat(Repr(x), " is not in list"));
  return Value::Int(n);
}

// An attribute Python's str / dict / list / tuple has: callable here (kSafe)
// or refused by the sandbox (kUnsafe). `fn` is null where we do not
// implement it: calling it fails as an unsupported construct.
struct MethodEntry {
  MethodKind kind;
  BuiltinOp fn;
};
using MethodTable = absl::flat_hash_map<std::string_view, MethodEntry>;

constexpr MethodEntry Safe(BuiltinOp fn) { return {MethodKind::kSafe, fn}; }
constexpr MethodEntry kSafeMissing = {MethodKind::kSafe, nullptr};
constexpr MethodEntry kUnsafe = {MethodKind::kUnsafe, nullptr};

const MethodTable& StrMethods() {
  static const auto* t = new MethodTable{
      {"capitalize", Safe(StrCapitalize)},
      {"casefold", kSafeMissing},
      {"center", kSafeMissing},
      {"count", Safe(StrFind)},
      {"encode", kSafeMissing},
      {"endswith", Safe(StrAffixTest)},
      {"expandtabs", kSafeMissing},
      {"find", Safe(StrFind)},
      {"format", kSafeMissing},
      {"format_map", kSafeMissing},
      {"index", Safe(StrFind)},
      {"isalnum", Safe(StrIsClass)},
      {"isalpha", Safe(StrIsClass)},
      {"isascii", Safe(StrIsClass)},
      {"isdecimal", kSafeMissing},
      {"isdigit", Safe(StrIsClass)},
      {"isidentifier", kSafeMissing},
      {"islower", Safe(StrIsClass)},
      {"isnumeric", kSafeMissing},
      {"isprintable", kSafeMissing},
      {"isspace", Safe(StrIsClass)},
      {"istitle", kSafeMissing},
      {"isupper", Safe(StrIsClass)},
      {"join", Safe(StrJoin)},
      {"ljust", kSafeMissing},
      {"lower", Safe(StrLower)},
      {"lstrip", Safe(StrStrip)},
      {"maketrans", kSafeMissing},
      {"partition", kSafeMissing},
      {"removeprefix", Safe(StrRemoveAffix)},
      {"removesuffix", Safe(StrRemoveAffix)},
      {"replace", Safe(StrReplace)},
      {"rfind", Safe(StrFind)},
      {"rindex", Safe(StrFind)},
      {"rjust", kSafeMissing},
      {"rpartition", kSafeMissing},
      {"rsplit", Safe(StrSplit)},
      {"rstrip", Safe(StrStrip)},
      {"split", Safe(StrSplit)},
      {"splitlines", Safe(StrSplitlines)},
      {"startswith", Safe(StrAffixTest)},
      {"strip", Safe(StrStrip)},
      {"swapcase", kSafeMissing},
      {"title", Safe(StrTitle)},
      {"translate", kSafeMissing},
      {"upper", Safe(StrUpper)},
      {"zfill", kSafeMissing},
  };
  return *t;
}

const MethodTable& DictMethods() {
  static const auto* t = new MethodTable{
      {"clear", kUnsafe},     {"copy", Safe(DictCopy)},   {"fromkeys", kSafeMissing},
      {"get", Safe(DictGet)}, {"items", Safe(DictView)},  {"keys", Safe(DictView)},
      {"pop", kUnsafe},       {"popitem", kUnsafe},       {"setdefault", kUnsafe},
      {"update", kUnsafe},    {"values", Safe(DictView)},
  };
  return *t;
}

const MethodTable& ListMethods() {
  static const auto* t = new MethodTable{
      {"append", kUnsafe},       {"clear", kUnsafe},  {"copy", Safe(ListCopy)},
      {"count", Safe(ListFind)}, {"extend", kUnsafe}, {"index", Safe(ListFind)},
      {"insert", kUnsafe},       {"pop", kUnsafe},    {"remove", kUnsafe},
      {"reverse", kUnsafe},      {"sort", kUnsafe},
  };
  return *t;
}

const MethodTable& TupleMethods() {
  static const auto* t = new MethodTable{
      {"count", Safe(ListFind)},
      {"index", Safe(ListFind)},
  };
  return *t;
}

// The methods of `v`'s type; null for types without any (iterators, views,
// numbers, objects).
const MethodTable* MethodsOf(const Value& v) {
  switch (v.kind()) {
    case Kind::kString:
      return &StrMethods();
    case Kind::kDict:
      return &DictMethods();
    case Kind::kList:
      if (v.flavor() == Flavor::kList) return &ListMethods();
      if (v.flavor() == Flavor::kTuple) return &TupleMethods();
      return nullptr;
    default:
      return nullptr;
  }
}

}  // namespace

MethodKind Interp::LookupMethod(const Value& obj, const std::string& name) {
  const MethodTable* methods = MethodsOf(obj);
  if (methods == nullptr) return MethodKind::kNone;
  const auto it = methods->find(name);
  return it == methods->end() ? MethodKind::kNone : it->second.kind;
}

Value Interp::CallMethod(const Value& self, const std::string& name, CallArgs& a) {
  if (const MethodTable* methods = MethodsOf(self)) {
    const auto it = methods->find(name);
    if (it != methods->end() && it->second.fn != nullptr)
      return it->second.fn(*this, name, self, a);
  }
  Fail(absl::StrCat("unsupported construct: ", PyTypeName(self), ".", name, "()"));
}

// ---------------------------------------------------------------- filters

namespace {

// make_attrgetter: dotted path, integer parts used as indexes.
Value AttrPath(Interp& in, const Value& item, const Value& attr, const std::optional<Value>& def) {
  std::vector<Value> parts;
  if (attr.is_string()) {
    for (const std::string& part : SplitSep(attr.s(), ".", -1, false)) {
      const bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                       [](char c) { return c >= '0' && c <= '9'; });
      if (digits && part.size() < 18)
        parts.push_back(Value::Int(std::stoll(part)));
      else
        parts.push_back(Value::Str(part));
    }
  } else {
    parts.push_back(attr);
  }
  Value cur = item;
  for (const Value& p : parts) {
    cur = in.GetItem(cur, p);
    if (def && cur.is_undefined()) cur = *def;
  }
  return cur;
}

Value IgnoreCase(const Value& v) { return v.is_string() ? Value::Str(LowerStr(v.s())) : v; }

Value FilterTojson(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOpts o;
  o.ensure_ascii = p.Bool(0, false);
  const Value indent = p.Or(1, Value::None());
  if (indent.is_int() || indent.is_bool()) {
    o.indent = std::string(std::max<int64_t>(0, std::min<int64_t>(indent.i(), 1000)), ' ');
  } else if (indent.is_string()) {
    o.indent = indent.s();
  } else if (!indent.is_none()) {
    Fail(absl::StrCat("tojson: indent must be an int or a string, not ", PyTypeName(indent)));
  }
  if (o.indent) o.item_sep = ",";
  const Value seps = p.Or(2, Value::None());
  if (!seps.is_none()) {
    if (!seps.is_list() || seps.items().size() != 2 || !seps.items()[0].is_string() ||
        !seps.items()[1].is_string())
      Fail("tojson: separators must be a (item_separator, key_separator) pair of strings");
    o.item_sep = seps.items()[0].s();
    o.key_sep = seps.items()[1].s();
  }
  o.sort_keys = p.Bool(3, false);
  std::string out;
  JsonDump(&out, v, o, 0, in);
  in.CheckString(out.size());
  return Value::Str(std::move(out));
}

Value FilterTrim(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"chars"});
  return Value::Str(StripStr(Str(v), p.OptStr(0), true, true));
}

// length / count.
Value FilterLength(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  switch (v.kind()) {
    case Kind::kUndefined:
      return Value::Int(0);
    case Kind::kString:
      return Value::Int(static_cast<int64_t>(SplitChars(v.s()).size()));
    case Kind::kList:
      if (v.flavor() == Flavor::kIter)
        Fail(absl::StrCat("object of type '", PyTypeName(v), "' has no len()"));
      return Value::Int(static_cast<int64_t>(v.items().size()));
    case Kind::kDict:
      return Value::Int(static_cast<int64_t>(v.dict().items.size()));
    default:
      Fail(absl::StrCat("object of type '", PyTypeName(v), "' has no len()"));
  }
}

Value FilterUpper(Interp&, const std::string&, const Value& v, CallArgs&) {
  return Value::Str(UpperStr(Str(v)));
}

Value FilterLower(Interp&, const std::string&, const Value& v, CallArgs&) {
  return Value::Str(LowerStr(Str(v)));
}

Value FilterCapitalize(Interp&, const std::string&, const Value& v, CallArgs&) {
  return Value::Str(CapitalizeStr(Str(v)));
}

Value FilterTitle(Interp&, const std::string&, const Value& v, CallArgs&) {
  return Value::Str(JinjaTitle(Str(v)));
}

// string / safe.
Value FilterString(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  return Value::Str(Str(v));
}

// e / escape / forceescape.
Value FilterEscape(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  return Value::Str(HtmlEscape(Str(v)));
}

Value FilterReplace(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"old", "new", "count"});
  const auto old = p.Get(0), rep = p.Get(1);
  if (!old || !rep) Fail("replace() missing required arguments");
  const std::string r = ReplaceStr(Str(v), Str(*old), Str(*rep), p.Int(2, -1));
  in.CheckString(r.size());
  return Value::Str(r);
}

// default / d.
Value FilterDefault(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"default_value", "boolean"});
  if (v.is_undefined() || (p.Bool(1, false) && !Truthy(v))) return p.Or(0, Value::Str(""));
  return v;
}

Value FilterJoin(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"d", "attribute"});
  const std::string sep = Str(p.Or(0, Value::Str("")));
  const auto attr = p.Get(1);
  std::string out;
  bool first = true;
  for (const Value& x : in.Iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += Str(attr && !attr->is_none() ? AttrPath(in, x, *attr, std::nullopt) : x);
    in.CheckString(out.size());
  }
  return Value::Str(std::move(out));
}

void CheckIterable(const Value& v) {
  if (v.is_none() || v.is_number() || v.is_object())
    Fail(absl::StrCat("'", PyTypeName(v), "' object is not iterable"));
}

Value FilterFirst(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  CheckIterable(v);
  const std::vector<Value> items = in.Iterate(v);
  if (items.empty()) return Value::Undefined("No first item, sequence was empty.");
  return items.front();
}

Value FilterLast(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  CheckIterable(v);
  if (v.is_list() && v.flavor() == Flavor::kIter)
    Fail(absl::StrCat("'", PyTypeName(v), "' object is not reversible"));
  const std::vector<Value> items = in.Iterate(v);
  if (items.empty()) return Value::Undefined("No last item, sequence was empty.");
  return items.back();
}

Value FilterList(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  return Value::List(in.Iterate(v));
}

Value FilterItems(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  if (v.is_undefined()) return Value::Seq({}, Flavor::kIter, "generator");
  if (!v.is_dict()) Fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& kv : v.dict().items) out.push_back(Value::List({kv.first, kv.second}, true));
  return Value::Seq(std::move(out), Flavor::kIter, "generator");
}

Value FilterReverse(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  if (v.is_string()) {
    std::vector<std::string> chars = SplitChars(v.s());
    std::string out;
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
    return Value::Str(out);
  }
  std::vector<Value> items = in.Iterate(v);
  std::reverse(items.begin(), items.end());
  if (v.is_list() && v.flavor() == Flavor::kIter) return Value::List(std::move(items));
  const char* tn = v.is_dict()                   ? "dict_reversekeyiterator"
                   : v.is_tuple()                ? "reversed"
                   : v.is_undefined()            ? "reversed"
                   : v.flavor() == Flavor::kView ? "dict_reverseitemiterator"
                                                 : "list_reverseiterator";
  return Value::Seq(std::move(items), Flavor::kIter, tn);
}

Value FilterInt(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"default", "base"});
  const Value def = p.Or(0, Value::Int(0));
  const int64_t base = p.Int(1, 10);
  if (v.is_undefined()) FailUndefined(v);
  if (v.is_int()) return v;
  if (v.is_bool()) return Value::Int(v.i());
  if (v.is_float()) {
    if (!std::isfinite(v.f())) return def;
    if (std::fabs(v.f()) >= 9.2e18) Fail("integer overflow (this renderer's integers are 64-bit)");
    return Value::Int(static_cast<int64_t>(std::trunc(v.f())));
  }
  if (v.is_string()) {
    if (auto i = ParsePyInt(v.s(), static_cast<int>(base))) return Value::Int(*i);
    if (auto f = ParsePyFloat(v.s())) {
      if (!std::isfinite(*f)) return def;
      if (std::fabs(*f) >= 9.2e18) Fail("integer overflow (this renderer's integers are 64-bit)");
      return Value::Int(static_cast<int64_t>(std::trunc(*f)));
    }
  }
  return def;
}

Value FilterFloat(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"default"});
  const Value def = p.Or(0, Value::Float(0.0));
  if (v.is_undefined()) FailUndefined(v);
  if (v.is_number()) return Value::Float(v.f());
  if (v.is_string()) {
    if (auto f = ParsePyFloat(v.s())) return Value::Float(*f);
  }
  return def;
}

Value FilterAbs(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {});
  if (v.is_undefined()) FailUndefined(v);
  if (!v.is_number()) Fail(absl::StrCat("bad operand type for abs(): '", PyTypeName(v), "'"));
  if (v.is_float()) return Value::Float(std::fabs(v.f()));
  if (v.i() == INT64_MIN) Fail("integer overflow (this renderer's integers are 64-bit)");
  return Value::Int(v.i() < 0 ? -v.i() : v.i());
}

Value FilterRound(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"precision", "method"});
  const int64_t prec = p.Int(0, 0);
  const std::string method = p.Get(1) ? Str(*p.Get(1)) : "common";
  if (method != "common" && method != "ceil" && method != "floor")
    Fail("method must be common, ceil or floor");
  if (v.is_undefined()) FailUndefined(v);
  if (!v.is_number())
    Fail(absl::StrCat("type ", PyTypeName(v), " doesn't define __round__ method"));
  if (method == "common") {
    if (!v.is_float()) {
      if (prec >= 0) return Value::Int(v.i());
      return Value::Int(static_cast<int64_t>(PyRound(static_cast<double>(v.i()), prec)));
    }
    return Value::Float(PyRound(v.f(), prec));
  }
  const double scale = std::pow(10.0, static_cast<double>(prec));
  const double r = method == "ceil" ? std::ceil(v.f() * scale) : std::floor(v.f() * scale);
  return Value::Float(r / scale);
}

Value FilterIndent(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"width", "first", "blank"});
  const Value w = p.Or(0, Value::Int(4));
  std::string ind;
  if (w.is_string()) {
    ind = w.s();
  } else if (w.is_int() || w.is_bool()) {
    if (w.i() > 0) {
      in.CheckString(static_cast<size_t>(w.i()));
      ind = std::string(w.i(), ' ');
    }
  } else {
    Fail("indent: width must be an int or a string");
  }
  const std::string s = Str(v) + "\n";
  std::vector<std::string> lines = SplitLines(s, false);
  std::string rv;
  if (p.Bool(2, false)) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += "\n" + ind;
      rv += lines[i];
      in.CheckString(rv.size());
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += "\n";
      if (!lines[i].empty()) rv += ind;
      rv += lines[i];
      in.CheckString(rv.size());
    }
  }
  if (p.Bool(1, false)) rv = ind + rv;
  return Value::Str(rv);
}

Value FilterCenter(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"width"});
  const int64_t width = p.Int(0, 80);
  const std::string s = Str(v);
  const int64_t len = static_cast<int64_t>(SplitChars(s).size());
  if (width <= len) return Value::Str(s);
  in.CheckString(static_cast<size_t>(width));
  const int64_t marg = width - len;
  const int64_t left = marg / 2 + (marg & width & 1);
  return Value::Str(std::string(left, ' ') + s + std::string(marg - left, ' '));
}

Value FilterAttr(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"name"});
  const std::string attr = Str(p.Or(0, Value::Str("")));
  if (v.is_undefined()) FailUndefined(v);
  if (v.is_dict()) {
    const MethodKind mk = in.LookupMethod(v, attr);
    if (mk == MethodKind::kNone)
      return Value::Undefined(absl::StrCat("'dict object' has no attribute '", attr, "'"));
  }
  return in.GetAttr(v, attr);
}

Value FilterMap(Interp& in, const std::string&, const Value& v, CallArgs& a) {
  std::vector<Value> out;
  const std::vector<Value> items = in.Iterate(v);
  bool by_attr = a.pos.empty();
  for (const auto& kv : a.kw)
    if (kv.first != "attribute" && kv.first != "default" && by_attr)
      Fail(absl::StrCat("Unexpected keyword argument '", kv.first, "'"));
  if (by_attr) {
    std::optional<Value> attr, def;
    for (const auto& kv : a.kw) {
      if (kv.first == "attribute") attr = kv.second;
      if (kv.first == "default") def = kv.second;
    }
    if (!attr) Fail("map requires a filter name or attribute=");
    for (const Value& x : items) out.push_back(AttrPath(in, x, *attr, def));
  } else {
    if (!a.pos[0].is_string()) Fail("map: the filter name must be a string");
    const std::string fname = a.pos[0].s();
    if (!IsFilter(fname)) Fail(absl::StrCat("No filter named '", fname, "'."));
    CallArgs rest;
    rest.pos.assign(a.pos.begin() + 1, a.pos.end());
    rest.kw = a.kw;
    for (const Value& x : items) {
      CallArgs copy = rest;
      out.push_back(in.ApplyFilter(fname, x, copy));
    }
  }
  return Value::Seq(std::move(out), Flavor::kIter, "generator");
}

// select / reject / selectattr / rejectattr: the items whose test (or truth),
// of the item or of its attribute (`by_attr`), is `keep`.
Value SelectItems(Interp& in, const std::string& n, const Value& v, CallArgs& a, bool by_attr,
                  bool keep) {
  size_t off = 0;
  std::optional<Value> attr;
  if (by_attr) {
    if (a.pos.empty()) Fail("Missing parameter for attribute name");
    attr = a.pos[0];
    off = 1;
  }
  std::optional<std::string> test;
  CallArgs rest;
  if (a.pos.size() > off) {
    if (!a.pos[off].is_string()) Fail(absl::StrCat(n, ": the test name must be a string"));
    test = a.pos[off].s();
    rest.pos.assign(a.pos.begin() + off + 1, a.pos.end());
    rest.kw = a.kw;
  }
  std::vector<Value> out;
  for (const Value& x : in.Iterate(v)) {
    const Value probe = attr ? AttrPath(in, x, *attr, std::nullopt) : x;
    bool r;
    if (test) {
      CallArgs copy = rest;
      r = in.ApplyTest(*test, probe, copy);
    } else {
      r = Truthy(probe);
    }
    if (r == keep) out.push_back(x);
  }
  return Value::Seq(std::move(out), Flavor::kIter, "generator");
}

Value FilterSelect(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  return SelectItems(in, n, v, a, /*by_attr=*/false, /*keep=*/true);
}

Value FilterReject(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  return SelectItems(in, n, v, a, /*by_attr=*/false, /*keep=*/false);
}

Value FilterSelectattr(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  return SelectItems(in, n, v, a, /*by_attr=*/true, /*keep=*/true);
}

Value FilterRejectattr(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  return SelectItems(in, n, v, a, /*by_attr=*/true, /*keep=*/false);
}

Value FilterUnique(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"case_sensitive", "attribute"});
  const bool cs = p.Bool(0, false);
  const auto attr = p.Get(1);
  std::vector<Value> out, seen;
  for (const Value& x : in.Iterate(v)) {
    Value key = attr && !attr->is_none() ? AttrPath(in, x, *attr, std::nullopt) : x;
    if (!cs) key = IgnoreCase(key);
    if (key.is_list() || key.is_dict())
      Fail(absl::StrCat("unhashable type: '", PyTypeName(key), "'"));
    bool dup = false;
    for (const Value& s : seen)
      if (Equal(s, key)) dup = true;
    if (dup) continue;
    seen.push_back(key);
    out.push_back(x);
  }
  return Value::Seq(std::move(out), Flavor::kIter, "generator");
}

// (sort key, item) pairs.
using Keyed = std::vector<std::pair<Value, Value>>;

// The key sort / min / max order `x` by: its attribute (a dotted path; with
// `several`, also a comma-separated list of them) or `x` itself, lowercased
// unless case-sensitive.
Value SortKey(Interp& in, const Value& x, const std::optional<Value>& attr, bool cs, bool several) {
  Value k;
  if (attr) {
    if (several && attr->is_string() && attr->s().find(',') != std::string::npos) {
      std::vector<Value> ks;
      for (const std::string& part : SplitSep(attr->s(), ",", -1, false)) {
        Value kk = AttrPath(in, x, Value::Str(part), std::nullopt);
        ks.push_back(cs ? kk : IgnoreCase(kk));
      }
      return Value::List(std::move(ks));
    }
    k = AttrPath(in, x, *attr, std::nullopt);
  } else {
    k = x;
  }
  return cs ? k : IgnoreCase(k);
}

// The items of `keyed` as a list, stably sorted by key.
Value SortedItems(Keyed keyed, bool reverse) {
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? Less(y.first, x.first) : Less(x.first, y.first);
  });
  std::vector<Value> out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return Value::List(std::move(out));
}

// An attribute argument; none is no attribute.
std::optional<Value> AttrArg(std::optional<Value> attr) {
  if (attr && attr->is_none()) attr.reset();
  return attr;
}

Value FilterSort(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = p.Bool(0, false);
  const bool cs = p.Bool(1, false);
  const std::optional<Value> attr = AttrArg(p.Get(2));
  std::vector<Value> items = in.Iterate(v);
  Keyed keyed;
  for (Value& x : items) keyed.emplace_back(SortKey(in, x, attr, cs, true), std::move(x));
  return SortedItems(std::move(keyed), reverse);
}

Value FilterDictsort(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"case_sensitive", "by", "reverse"});
  const bool cs = p.Bool(0, false);
  const std::string b = p.Get(1) ? Str(*p.Get(1)) : "key";
  if (b != "key" && b != "value") Fail("You can only sort by either \"key\" or \"value\"");
  const int by = b == "key" ? 0 : 1;
  const bool reverse = p.Bool(2, false);
  if (!v.is_dict()) Fail("dictsort: value must be a mapping");
  Keyed keyed;
  for (const auto& kv : v.dict().items) {
    const Value& k = by == 0 ? kv.first : kv.second;
    keyed.emplace_back(cs ? k : IgnoreCase(k), Value::List({kv.first, kv.second}, true));
  }
  return SortedItems(std::move(keyed), reverse);
}

// min / max.
Value FilterMinMax(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"case_sensitive", "attribute"});
  const bool cs = p.Bool(0, false);
  const std::optional<Value> attr = AttrArg(p.Get(1));
  std::vector<Value> items = in.Iterate(v);
  Keyed keyed;
  for (Value& x : items) keyed.emplace_back(SortKey(in, x, attr, cs, false), std::move(x));
  if (keyed.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < keyed.size(); ++i) {
    if (n == "min" ? Less(keyed[i].first, keyed[best].first)
                   : Less(keyed[best].first, keyed[i].first))
      best = i;
  }
  return keyed[best].second;
}

Value FilterSum(Interp& in, const std::string& n, const Value& v, CallArgs& a) {
  Args p(a, n, {"attribute", "start"});
  const auto attr = p.Get(0);
  Value acc = p.Or(1, Value::Int(0));
  for (const Value& x : in.Iterate(v)) {
    const Value y = attr && !attr->is_none() ? AttrPath(in, x, *attr, std::nullopt) : x;
    if (acc.is_string()) Fail("sum() can't sum strings [use ''.join(seq) instead]");
    if (!acc.is_number() || !y.is_number()) {
      if (y.is_undefined()) FailUndefined(y);
      Fail(absl::StrCat("unsupported operand type(s) for +: '", PyTypeName(acc), "' and '",
                        PyTypeName(y), "'"));
    }
    if (acc.is_float() || y.is_float()) {
      acc = Value::Float(acc.f() + y.f());
    } else {
      int64_t r;
      if (__builtin_add_overflow(acc.i(), y.i(), &r))
        Fail("integer overflow (this renderer's integers are 64-bit)");
      acc = Value::Int(r);
    }
  }
  return acc;
}

// Every filter we implement, by the names jinja2 gives it.
const absl::flat_hash_map<std::string_view, BuiltinOp>& Filters() {
  static const auto* t = new absl::flat_hash_map<std::string_view, BuiltinOp>{
      {"abs", FilterAbs},
      {"attr", FilterAttr},
      {"capitalize", FilterCapitalize},
      {"center", FilterCenter},
      {"count", FilterLength},
      {"d", FilterDefault},
      {"default", FilterDefault},
      {"dictsort", FilterDictsort},
      {"e", FilterEscape},
      {"escape", FilterEscape},
      {"first", FilterFirst},
      {"float", FilterFloat},
      {"forceescape", FilterEscape},
      {"indent", FilterIndent},
      {"int", FilterInt},
      {"items", FilterItems},
      {"join", FilterJoin},
      {"last", FilterLast},
      {"length", FilterLength},
      {"list", FilterList},
      {"lower", FilterLower},
      {"map", FilterMap},
      {"max", FilterMinMax},
      {"min", FilterMinMax},
      {"reject", FilterReject},
      {"rejectattr", FilterRejectattr},
      {"replace", FilterReplace},
      {"reverse", FilterReverse},
      {"round", FilterRound},
      {"safe", FilterString},
      {"select", FilterSelect},
      {"selectattr", FilterSelectattr},
      {"sort", FilterSort},
      {"string", FilterString},
      {"sum", FilterSum},
      {"title", FilterTitle},
      {"tojson", FilterTojson},
      {"trim", FilterTrim},
      {"unique", FilterUnique},
      {"upper", FilterUpper},
  };
  return *t;
}

}  // namespace

bool IsFilter(std::string_view name) { return Filters().contains(name); }

Value Interp::ApplyFilterExpr(const Expr& f, Value input, const std::shared_ptr<Scope>& scope) {
  CallArgs args = EvalArgs(f, scope);
  return ApplyFilter(f.name, input, args);
}

Value Interp::ApplyFilter(const std::string& name, const Value& v, CallArgs& a) {
  Step();
  const auto it = Filters().find(name);
  if (it == Filters().end()) Fail(absl::StrCat("No filter named '", name, "'."));
  return it->second(*this, name, v, a);
}

// ---------------------------------------------------------------- tests

namespace {

// A test (`value is name(args)`); `name` as for BuiltinOp.
using TestOp = bool (*)(Interp& in, const std::string& name, const Value& v, CallArgs& args);

// The one argument of a test that takes one.
Value TestArg(const std::string& n, CallArgs& a, const char* pname) {
  Args p(a, n, {pname});
  auto x = p.Get(0);
  if (!x) Fail(absl::StrCat("test '", n, "' requires an argument"));
  return *x;
}

bool TestDefined(Interp&, const std::string&, const Value& v, CallArgs&) {
  return !v.is_undefined();
}
bool TestUndefined(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_undefined();
}
bool TestNone(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_none(); }
bool TestBoolean(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_bool(); }
bool TestTrue(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_bool() && v.b();
}
bool TestFalse(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_bool() && !v.b();
}
bool TestInteger(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_int(); }
bool TestFloat(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_float(); }
bool TestNumber(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_number(); }
bool TestString(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_string(); }
bool TestMapping(Interp&, const std::string&, const Value& v, CallArgs&) { return v.is_dict(); }
bool TestIterable(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool TestSequence(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_dict() ||
         (v.is_list() && (v.flavor() == Flavor::kList || v.flavor() == Flavor::kTuple));
}
bool TestCallable(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_undefined() || (v.is_object() && v.obj()->callable());
}
bool TestEscaped(Interp&, const std::string&, const Value&, CallArgs&) { return false; }

// lower / upper: str(v).islower() / .isupper().
bool TestCase(Interp& in, const std::string& n, const Value& v, CallArgs&) {
  CallArgs none;
  Value s = Value::Str(Str(v));
  return Truthy(in.CallMethod(s, n == "lower" ? "islower" : "isupper", none));
}

// even / odd / divisibleby.
bool TestDivisible(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  if (v.is_undefined()) FailUndefined(v);
  if (!v.is_number())
    Fail(absl::StrCat("unsupported operand type(s) for %: '", PyTypeName(v), "' and 'int'"));
  Value d = n == "divisibleby" ? TestArg(n, a, "num") : Value::Int(2);
  if (d.is_undefined()) FailUndefined(d);
  if (!d.is_number())
    Fail(absl::StrCat("unsupported operand type(s) for %: '", PyTypeName(v), "' and '",
                      PyTypeName(d), "'"));
  double r;
  if (v.is_float() || d.is_float()) {
    if (d.f() == 0) Fail("float modulo");
    r = std::fmod(v.f(), d.f());
  } else {
    if (d.i() == 0) Fail("integer division or modulo by zero");
    r = d.i() == -1 ? 0 : static_cast<double>(v.i() % d.i());
  }
  if (n == "odd") return r != 0;
  return r == 0;
}

// eq / equalto / ==, ne / !=, lt / lessthan / <, le / <=, gt / greaterthan / >, ge / >=.
bool TestEq(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return Equal(v, TestArg(n, a, "other"));
}
bool TestNe(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return !Equal(v, TestArg(n, a, "other"));
}
bool TestLt(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return Less(v, TestArg(n, a, "other"), "<");
}
bool TestLe(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return !Less(TestArg(n, a, "other"), v, "<=");
}
bool TestGt(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return Less(TestArg(n, a, "other"), v, ">");
}
bool TestGe(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  return !Less(v, TestArg(n, a, "other"), ">=");
}

bool TestIn(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  const Value seq = TestArg(n, a, "seq");
  if (seq.is_undefined()) return false;
  if (seq.is_string()) {
    if (!v.is_string())
      Fail(absl::StrCat("'in <string>' requires string as left operand, not ", PyTypeName(v)));
    return seq.s().find(v.s()) != std::string::npos;
  }
  if (seq.is_dict()) return seq.dict().Find(v) != nullptr;
  if (!seq.is_list())
    Fail(absl::StrCat("argument of type '", PyTypeName(seq), "' is not iterable"));
  for (const Value& x : seq.items())
    if (Equal(x, v)) return true;
  return false;
}

bool TestSameas(Interp&, const std::string& n, const Value& v, CallArgs& a) {
  const Value o = TestArg(n, a, "other");
  if (v.is_object() || o.is_object()) return v.is_object() && o.is_object() && v.obj() == o.obj();
  if (v.is_list() && o.is_list()) return v.list_ptr() == o.list_ptr();
  if (v.is_dict() && o.is_dict()) return &v.dict() == &o.dict();
  if (v.is_none() || v.is_bool() || v.is_undefined()) return v.kind() == o.kind() && Equal(v, o);
  return false;
}

bool TestFilter(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_string() && IsFilter(v.s());
}

bool TestTest(Interp&, const std::string&, const Value& v, CallArgs&) {
  return v.is_string() && IsTest(v.s());
}

// Every test we implement, by the names jinja2 gives it.
const absl::flat_hash_map<std::string_view, TestOp>& Tests() {
  static const auto* t = new absl::flat_hash_map<std::string_view, TestOp>{
      {"!=", TestNe},
      {"<", TestLt},
      {"<=", TestLe},
      {"==", TestEq},
      {">", TestGt},
      {">=", TestGe},
      {"boolean", TestBoolean},
      {"callable", TestCallable},
      {"defined", TestDefined},
      {"divisibleby", TestDivisible},
      {"eq", TestEq},
      {"equalto", TestEq},
      {"escaped", TestEscaped},
      {"even", TestDivisible},
      {"false", TestFalse},
      {"filter", TestFilter},
      {"float", TestFloat},
      {"ge", TestGe},
      {"greaterthan", TestGt},
      {"gt", TestGt},
      {"in", TestIn},
      {"integer", TestInteger},
      {"iterable", TestIterable},
      {"le", TestLe},
      {"lessthan", TestLt},
      {"lower", TestCase},
      {"lt", TestLt},
      {"mapping", TestMapping},
      {"ne", TestNe},
      {"none", TestNone},
      {"number", TestNumber},
      {"odd", TestDivisible},
      {"sameas", TestSameas},
      {"sequence", TestSequence},
      {"string", TestString},
      {"test", TestTest},
      {"true", TestTrue},
      {"undefined", TestUndefined},
      {"upper", TestCase},
  };
  return *t;
}

}  // namespace

bool IsTest(std::string_view name) { return Tests().contains(name); }

bool Interp::ApplyTest(const std::string& name, const Value& v, CallArgs& a) {
  Step();
  const auto it = Tests().find(name);
  if (it == Tests().end()) Fail(absl::StrCat("No test named '", name, "' found."));
  return it->second(*this, name, v, a);
}

}  // namespace hmoe::jinja::internal
