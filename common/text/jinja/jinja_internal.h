// Internals of the Jinja interpreter (common/text/jinja/jinja.h): values, the syntax
// tree, and the error type thrown inside the library (caught at
// Template::Parse / Render, never crossing the public API).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace hmoe::jinja::internal {

// Thrown inside the interpreter only.
struct Error {
  absl::StatusCode code;
  std::string message;
};
[[noreturn]] void Fail(std::string message);          // INVALID_ARGUMENT
[[noreturn]] void FailResource(std::string message);  // RESOURCE_EXHAUSTED

// Deepest list / dict / tuple nesting a value may have (guards recursion in
// printing, comparison and destruction).
inline constexpr int kMaxValueDepth = 200;

class Value;
class Object;
struct ListData;
struct DictData;

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kDict,
  kObject
};

// What a kList value stands for in Python: a list, a tuple, a one-shot
// iterator (generator: always truthy, no len(), no indexing, not
// printable here), or a dict view (dict_items / dict_keys / dict_values).
enum class Flavor : uint8_t { kList, kTuple, kIter, kView };

// Why a value is undefined: the message jinja2 raises when it is misused.
struct UndefInfo {
  std::string message;
  bool unsafe = false;  // the sandbox refused the attribute (SecurityError)
};

class Value {
 public:
  Value() = default;
  static Value Undefined(std::string message, bool unsafe = false);
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  static Value Str(std::string s);
  static Value List(std::vector<Value> items, bool tuple = false);
  // An iterator or view; `type_name` as Python names its type ("generator").
  static Value Seq(std::vector<Value> items, Flavor flavor, std::string type_name);
  static Value Dict(std::vector<std::pair<Value, Value>> items);  // keys unique
  static Value Obj(std::shared_ptr<Object> o);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }  // not bool
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || is_float(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }  // any Flavor
  bool is_tuple() const;
  Flavor flavor() const;
  bool is_plain_list() const { return is_list() && flavor() == Flavor::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool b() const { return b_; }
  int64_t i() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }  // bool or int
  double f() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(i()); }
  const std::string& s() const { return *s_; }
  const std::vector<Value>& items() const;  // list / tuple
  const DictData& dict() const { return *d_; }
  const std::shared_ptr<Object>& obj() const { return o_; }
  const UndefInfo& undef() const { return *u_; }
  const std::shared_ptr<const ListData>& list_ptr() const { return l_; }
  int depth() const;  // container nesting (scalars 0)

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<const ListData> l_;
  std::shared_ptr<const DictData> d_;
  std::shared_ptr<Object> o_;
  std::shared_ptr<const UndefInfo> u_;
};

struct ListData {
  std::vector<Value> items;
  Flavor flavor = Flavor::kList;
  std::string type_name;  // kIter / kView
  int depth = 1;
};

struct DictData {
  std::vector<std::pair<Value, Value>> items;
  int depth = 1;
  const Value* Find(const Value& key) const;
};

// Python semantics shared by the evaluator and the filters.
bool Truthy(const Value& v);
bool Equal(const Value& a, const Value& b, int depth = 0);
// a < b as Python orders them; other type pairs -> Fail("'<' not supported ...").
bool Less(const Value& a, const Value& b, const char* op = "<", int depth = 0);
std::string Str(const Value& v);         // Python str()
std::string Repr(const Value& v);        // Python repr()
std::string PyTypeName(const Value& v);  // "str", "int", "NoneType", ...
std::string FloatRepr(double d);
std::string ReprString(const std::string& s);
// Raises the error an undefined value raises when misused.
[[noreturn]] void FailUndefined(const Value& v);

class Interp;
struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

// Namespaces, macros, methods, loop objects, ...
class Object {
 public:
  virtual ~Object() = default;
  virtual std::string TypeName() const = 0;  // as Python's type(x).__name__
  virtual std::string Repr() const;
  // Attribute lookup; an undefined Value when missing.
  virtual Value GetAttr(const std::string& name);
  virtual bool callable() const { return false; }
  virtual Value Call(Interp& interp, CallArgs& args);
};

class Namespace final : public Object {
 public:
  std::string TypeName() const override { return "Namespace"; }
  std::string Repr() const override;
  Value GetAttr(const std::string& name) override;
  void Set(const std::string& name, Value v);
  // Moves the attributes out (to break reference cycles after a render).
  std::vector<std::pair<std::string, Value>> Take() { return std::move(attrs_); }

 private:
  std::vector<std::pair<std::string, Value>> attrs_;
};

// ---- syntax tree ----

struct Pos {
  int line = 1;
  int column = 1;
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;
struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

enum class ExprKind {
  kLiteral,
  kName,
  kList,
  kTuple,
  kDict,
  kGetAttr,
  kGetItem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNot,
  kNeg,
  kPos,
  kBinary,
  kAnd,
  kOr,
  kConcat,
  kCompare,
  kCond,
};

enum class BinOp { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CmpOp { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  ExprKind kind;
  Pos pos;
  int depth = 1;             // tree height (bounded by the parser)
  Value literal;             // kLiteral
  std::string name;          // kName, kGetAttr attribute, filter / test name
  std::vector<ExprP> items;  // list / tuple / concat operands / call positional args
  std::vector<std::pair<ExprP, ExprP>> pairs;         // dict
  std::vector<std::pair<std::string, ExprP>> kwargs;  // call / filter / test keywords
  ExprP a, b, c;  // operands: object, index, slice parts, cond parts
  BinOp bin = BinOp::kAdd;
  std::vector<CmpOp> ops;  // kCompare: a ops[0] items[0] ops[1] items[1] ...
  bool negated = false;    // kTest: `is not`
};

enum class StmtKind {
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kSetBlock,
  kMacro,
  kCallBlock,
  kFilterBlock,
  kWith,
  kBreak,
  kContinue,
  kGeneration,
};

// An assignment target: a name, `ns.attr`, or a tuple of names.
struct Target {
  std::vector<std::string> names;  // one entry, or several for tuple unpacking
  bool tuple = false;
  std::string attr;  // non-empty: names[0].attr
};

struct Stmt {
  StmtKind kind;
  Pos pos;
  std::string text;                                   // kText
  ExprP expr;                                         // output / set value / for iter / call
  ExprP cond;                                         // for filter
  std::vector<std::pair<ExprP, Body>> branches;       // kIf (cond, body)
  Body body;                                          // for / set block / macro / call / ...
  Body else_body;                                     // if else / for else
  Target target;                                      // for / set
  std::string name;                                   // macro name
  std::vector<std::pair<std::string, ExprP>> params;  // macro / caller params (default or null)
  std::vector<ExprP> filters;                         // set block / filter block: filter chain
  std::vector<std::pair<Target, ExprP>> assigns;      // with
};

struct Program {
  std::string name;
  Body body;
};

// Parses a template (jinja_parser.cc); throws Error.
std::unique_ptr<Program> ParseProgram(std::string_view source, std::string_view name);

// Decodes one UTF-8 sequence at s[i]; returns its length (1 for an invalid
// byte, with *cp = 0xDC00 + byte, as Python's surrogateescape would).
size_t DecodeUtf8One(const std::string& s, size_t i, uint32_t* cp);
// Whether the interpreter implements the filter / the test `name`
// (jinja_builtins.cc); the parser refuses other tests.
bool IsFilter(std::string_view name);
bool IsTest(std::string_view name);

// Appends code point `cp` (<= 0x10FFFF) as UTF-8.
void AppendUtf8(std::string* out, uint32_t cp);

}  // namespace hmoe::jinja::internal
