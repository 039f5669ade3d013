// Values of the Jinja interpreter and Python's semantics for them.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/text/jinja/jinja_internal.h"

namespace hmoe::jinja::internal {

void Fail(std::string message) {
  throw Error{absl::StatusCode::kInvalidArgument, std::move(message)};
}
void FailResource(std::string message) {
  throw Error{absl::StatusCode::kResourceExhausted, std::move(message)};
}

namespace {
const std::vector<Value>& EmptyItems() {
  static const auto* v = new std::vector<Value>();
  return *v;
}
int DepthOf(const Value& v) { return v.depth(); }
}  // namespace

Value Value::Undefined(std::string message, bool unsafe) {
  Value v(Kind::kUndefined);
  v.u_ = std::make_shared<const UndefInfo>(UndefInfo{std::move(message), unsafe});
  return v;
}
Value Value::Bool(bool b) {
  Value v(Kind::kBool);
  v.b_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v(Kind::kInt);
  v.i_ = i;
  return v;
}
Value Value::Float(double f) {
  Value v(Kind::kFloat);
  v.f_ = f;
  return v;
}
Value Value::Str(std::string s) {
  Value v(Kind::kString);
  v.s_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::List(std::vector<Value> items, bool tuple) {
  return Seq(std::move(items), tuple ? Flavor::kTuple : Flavor::kList, "");
}
Value Value::Seq(std::vector<Value> items, Flavor flavor, std::string type_name) {
  int depth = 0;
  for (const Value& x : items) depth = std::max(depth, DepthOf(x));
  if (depth + 1 > kMaxValueDepth) FailResource("value nesting deeper than 200 levels");
  Value v(Kind::kList);
  auto data = std::make_shared<ListData>();
  data->items = std::move(items);
  data->flavor = flavor;
  data->type_name = std::move(type_name);
  data->depth = depth + 1;
  v.l_ = std::move(data);
  return v;
}
Value Value::Dict(std::vector<std::pair<Value, Value>> items) {
  int depth = 0;
  for (const auto& kv : items) depth = std::max({depth, DepthOf(kv.first), DepthOf(kv.second)});
  if (depth + 1 > kMaxValueDepth) FailResource("value nesting deeper than 200 levels");
  Value v(Kind::kDict);
  auto data = std::make_shared<DictData>();
  data->items = std::move(items);
  data->depth = depth + 1;
  v.d_ = std::move(data);
  return v;
}
Value Value::Obj(std::shared_ptr<Object> o) {
  Value v(Kind::kObject);
  v.o_ = std::move(o);
  return v;
}

bool Value::is_tuple() const { return kind_ == Kind::kList && l_->flavor == Flavor::kTuple; }
Flavor Value::flavor() const { return kind_ == Kind::kList ? l_->flavor : Flavor::kList; }
const std::vector<Value>& Value::items() const {
  return kind_ == Kind::kList ? l_->items : EmptyItems();
}
int Value::depth() const {
  if (kind_ == Kind::kList) return l_->depth;
  if (kind_ == Kind::kDict) return d_->depth;
  return 0;
}

const Value* DictData::Find(const Value& key) const {
  for (const auto& kv : items)
    if (Equal(kv.first, key)) return &kv.second;
  return nullptr;
}

void FailUndefined(const Value& v) {
  if (v.undef().unsafe) Fail(v.undef().message);
  Fail(v.undef().message);
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b();
    case Kind::kInt:
      return v.i() != 0;
    case Kind::kFloat:
      return v.f() != 0.0;
    case Kind::kString:
      return !v.s().empty();
    case Kind::kList:
      return v.flavor() == Flavor::kIter || !v.items().empty();
    case Kind::kDict:
      return !v.dict().items.empty();
    case Kind::kObject:
      return true;
  }
  return false;
}

bool Equal(const Value& a, const Value& b, int depth) {
  if (depth > kMaxValueDepth) FailResource("comparison nested too deeply");
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.f() == b.f();
    return a.i() == b.i();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.s() == b.s();
    case Kind::kList: {
      if (a.flavor() != b.flavor() || a.flavor() == Flavor::kIter) return false;
      const auto& x = a.items();
      const auto& y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!Equal(x[i], y[i], depth + 1)) return false;
      return true;
    }
    case Kind::kDict: {
      const auto& x = a.dict().items;
      const auto& y = b.dict();
      if (x.size() != y.items.size()) return false;
      for (const auto& kv : x) {
        const Value* other = y.Find(kv.first);
        if (other == nullptr || !Equal(kv.second, *other, depth + 1)) return false;
      }
      return true;
    }
    case Kind::kObject:
      return a.obj() == b.obj();
    default:
      return false;
  }
}

bool Less(const Value& a, const Value& b, const char* op, int depth) {
  if (depth > kMaxValueDepth) FailResource("comparison nested too deeply");
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.f() < b.f();
    return a.i() < b.i();
  }
  if (a.is_string() && b.is_string()) return a.s() < b.s();  // UTF-8 order = code point order
  if (a.is_list() && b.is_list() && a.flavor() == b.flavor() &&
      (a.flavor() == Flavor::kList || a.flavor() == Flavor::kTuple)) {
    const auto& x = a.items();
    const auto& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Equal(x[i], y[i], depth + 1)) continue;
      return Less(x[i], y[i], op, depth + 1);
    }
    return x.size() < y.size();
  }
  Fail(absl::StrCat("'", op, "' not supported between instances of '", PyTypeName(a), "' and '",
                    PyTypeName(b), "'"));
}

std::string PyTypeName(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      switch (v.flavor()) {
        case Flavor::kList:
          return "list";
        case Flavor::kTuple:
          return "tuple";
        default:
          return v.list_ptr()->type_name;
      }
    case Kind::kDict:
      return "dict";
    case Kind::kObject:
      return v.obj()->TypeName();
  }
  return "object";
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  // sci: [-]D[.DDD]e[+-]XX
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::atoi(sci.c_str() + e + 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits.push_back(c);
  int decpt = exp + 1;  // digits d1 d2 ... with the point after decpt digits
  std::string out = neg ? "-" : "";
  if (decpt > 16 || decpt <= -4) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) absl::StrAppend(&out, ".", digits.substr(1));
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
    return out;
  }
  if (decpt <= 0) {
    absl::StrAppend(&out, "0.", std::string(-decpt, '0'), digits);
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    absl::StrAppend(&out, digits, std::string(decpt - digits.size(), '0'), ".0");
  } else {
    absl::StrAppend(&out, digits.substr(0, decpt), ".", digits.substr(decpt));
  }
  return out;
}

namespace {

// Python's str.isprintable() for one code point (approximation outside the
// common ranges: everything else counts as printable).
bool Printable(uint32_t cp) {
  if (cp < 0x20 || cp == 0x7F) return false;
  if (cp >= 0x80 && cp <= 0xA0) return false;
  if (cp == 0xAD) return false;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F))
    return false;
  if ((cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF) return false;
  if ((cp >= 0xD800 && cp <= 0xF8FF) || (cp >= 0xFFF9 && cp <= 0xFFFB)) return false;
  if (cp >= 0xF0000) return false;
  return true;
}

}  // namespace

std::string ReprString(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t n = DecodeUtf8One(s, i, &cp);
    char buf[16];
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp >= 0xDC80 && cp <= 0xDCFF && n == 1) {
      std::snprintf(buf, sizeof(buf), "\\udc%02x", cp & 0xFF);
      out += buf;
    } else if (!Printable(cp)) {
      if (cp < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      } else if (cp < 0x10000) {
        std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      } else {
        std::snprintf(buf, sizeof(buf), "\\U%08x", cp);
      }
      out += buf;
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out.push_back(quote);
  return out;
}

namespace {
void AppendRepr(std::string* out, const Value& v, int depth);

// Printing depth across nested containers and namespaces (one render runs
// on one thread).
thread_local int print_depth = 0;
struct PrintDepth {
  PrintDepth() {
    if (++print_depth > kMaxValueDepth) {
      --print_depth;
      FailResource("value nested too deeply to print");
    }
  }
  ~PrintDepth() { --print_depth; }
};

void AppendStr(std::string* out, const Value& v, int depth) {
  PrintDepth guard;
  switch (v.kind()) {
    case Kind::kUndefined:
      return;
    case Kind::kNone:
      *out += "None";
      return;
    case Kind::kBool:
      *out += v.b() ? "True" : "False";
      return;
    case Kind::kInt:
      absl::StrAppend(out, v.i());
      return;
    case Kind::kFloat:
      *out += FloatRepr(v.f());
      return;
    case Kind::kString:
      *out += v.s();
      return;
    case Kind::kList: {
      if (v.flavor() == Flavor::kIter)
        Fail(absl::StrCat("unsupported construct: printing a ", v.list_ptr()->type_name,
                          " object (Python prints its address); convert it with |list"));
      const bool view = v.flavor() == Flavor::kView;
      if (view) absl::StrAppend(out, v.list_ptr()->type_name, "(");
      const bool tuple = v.is_tuple();
      out->push_back(tuple ? '(' : '[');
      const auto& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) *out += ", ";
        AppendRepr(out, items[i], depth + 1);
      }
      if (tuple && items.size() == 1) out->push_back(',');
      out->push_back(tuple ? ')' : ']');
      if (view) out->push_back(')');
      return;
    }
    case Kind::kDict: {
      out->push_back('{');
      bool first = true;
      for (const auto& kv : v.dict().items) {
        if (!first) *out += ", ";
        first = false;
        AppendRepr(out, kv.first, depth + 1);
        *out += ": ";
        AppendRepr(out, kv.second, depth + 1);
      }
      out->push_back('}');
      return;
    }
    case Kind::kObject:
      *out += v.obj()->Repr();
      return;
  }
}

void AppendRepr(std::string* out, const Value& v, int depth) {
  if (v.is_string()) {
    *out += ReprString(v.s());
  } else if (v.is_undefined()) {
    *out += "Undefined";
  } else {
    AppendStr(out, v, depth);
  }
}
}  // namespace

std::string Str(const Value& v) {
  if (v.is_string()) return v.s();
  std::string out;
  AppendStr(&out, v, 0);
  return out;
}

std::string Repr(const Value& v) {
  std::string out;
  AppendRepr(&out, v, 0);
  return out;
}

std::string Object::Repr() const { return absl::StrCat("<", TypeName(), " object>"); }
Value Object::GetAttr(const std::string& name) {
  return Value::Undefined(absl::StrCat("'", TypeName(), " object' has no attribute '", name, "'"));
}
Value Object::Call(Interp&, CallArgs&) {
  Fail(absl::StrCat("'", TypeName(), "' object is not callable"));
}

std::string Namespace::Repr() const {
  std::string out = "<Namespace {";
  bool first = true;
  for (const auto& kv : attrs_) {
    if (!first) out += ", ";
    first = false;
    absl::StrAppend(&out, ReprString(kv.first), ": ", internal::Repr(kv.second));
  }
  out += "}>";
  return out;
}

Value Namespace::GetAttr(const std::string& name) {
  for (const auto& kv : attrs_)
    if (kv.first == name) return kv.second;
  return Value::Undefined(absl::StrCat("'Namespace object' has no attribute '", name, "'"));
}

void Namespace::Set(const std::string& name, Value v) {
  if (!name.empty() && name[0] == '_')
    Fail(absl::StrCat(
        "Chat templates cannot store underscore-prefixed attributes on a namespace, but got ",
        ReprString(name), ". Please rename the attribute."));
  for (auto& kv : attrs_) {
    if (kv.first == name) {
      kv.second = std::move(v);
      return;
    }
  }
  attrs_.emplace_back(name, std::move(v));
}

void AppendUtf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t DecodeUtf8One(const std::string& s, size_t i, uint32_t* cp) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  const int n = c >= 0xF0 && c <= 0xF4  ? 4
                : c >= 0xE0 && c < 0xF0 ? 3
                : c >= 0xC2 && c < 0xE0 ? 2
                                        : 0;
  if (n == 0 || i + n > s.size()) {
    *cp = 0xDC00 + c;
    return 1;
  }
  uint32_t v = c & (0xFF >> (n + 1));
  for (int k = 1; k < n; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) {
      *cp = 0xDC00 + c;
      return 1;
    }
    v = (v << 6) | (d & 0x3F);
  }
  if ((n == 3 && (v < 0x800 || (v >= 0xD800 && v < 0xE000))) ||
      (n == 4 && (v < 0x10000 || v > 0x10FFFF))) {
    *cp = 0xDC00 + c;
    return 1;
  }
  *cp = v;
  return n;
}

}  // namespace hmoe::jinja::internal
