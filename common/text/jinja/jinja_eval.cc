// Evaluator of the Jinja subset (common/text/jinja/jinja.h): statements, expressions,
// Python-style operators, attribute lookup as jinja2's sandbox does it, and
// the public Template API.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/text/jinja/jinja.h"
#include "common/text/jinja/jinja_internal.h"
#include "common/text/jinja/jinja_runtime.h"

namespace hmoe::jinja {

namespace internal {

// ---------------------------------------------------------------- scopes

Value* Scope::Find(const std::string& name) {
  for (Scope* s = this; s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return &it->second;
  }
  return nullptr;
}

// ---------------------------------------------------------------- objects

namespace {

class LoopObj final : public Object {
 public:
  explicit LoopObj(std::vector<Value> items) : items_(std::move(items)) {}
  std::string TypeName() const override { return "LoopContext"; }
  std::string Repr() const override {
    return absl::StrCat("<LoopContext ", index_ + 1, "/", items_.size(), ">");
  }
  void set_index(size_t i) { index_ = i; }
  Value GetAttr(const std::string& name) override {
    const int64_t n = static_cast<int64_t>(items_.size());
    const int64_t i = static_cast<int64_t>(index_);
    if (name == "index") return Value::Int(i + 1);
    if (name == "index0") return Value::Int(i);
    if (name == "revindex") return Value::Int(n - i);
    if (name == "revindex0") return Value::Int(n - i - 1);
    if (name == "first") return Value::Bool(i == 0);
    if (name == "last") return Value::Bool(i == n - 1);
    if (name == "length") return Value::Int(n);
    if (name == "depth") return Value::Int(1);
    if (name == "depth0") return Value::Int(0);
    if (name == "previtem")
      return i > 0 ? items_[i - 1] : Value::Undefined("there is no previous item");
    if (name == "nextitem")
      return i + 1 < n ? items_[i + 1] : Value::Undefined("there is no next item");
    if (name == "cycle") {
      auto self = std::static_pointer_cast<LoopObj>(shared_from_this_());
      return MakeBuiltin("cycle", [self](Interp&, CallArgs& a) -> Value {
        if (a.pos.empty()) Fail("no items for cycling given");
        return a.pos[self->index_ % a.pos.size()];
      });
    }
    if (name == "changed") {
      return MakeBuiltin("changed", [](Interp&, CallArgs&) -> Value {
        Fail("unsupported construct: loop.changed()");
      });
    }
    return Object::GetAttr(name);
  }
  std::shared_ptr<Object> shared_from_this_() { return self_.lock(); }
  std::weak_ptr<Object> self_;

 private:
  std::vector<Value> items_;
  size_t index_ = 0;
};

}  // namespace

Value MakeBuiltin(std::string name, BuiltinFn fn) {
  return Value::Obj(std::make_shared<Builtin>(std::move(name), std::move(fn)));
}

// ---------------------------------------------------------------- interp

Interp::Interp(const Program& program, const RenderOptions& options)
    : options_(options), limits_(options.limits), program_(program) {}

Interp::~Interp() {
  // Break reference cycles (namespace <-> values, macro <-> scope) in two
  // phases so that nothing is destroyed recursively.
  std::vector<std::vector<std::pair<std::string, Value>>> ns_graveyard;
  for (auto& ns : namespaces_) ns_graveyard.push_back(ns->Take());
  std::vector<absl::flat_hash_map<std::string, Value>> scope_graveyard;
  for (auto& sc : captured_) {
    scope_graveyard.push_back(std::move(sc->vars));
    sc->vars.clear();
  }
  ns_graveyard.clear();
  scope_graveyard.clear();
  for (auto& sc : captured_) sc->parent.reset();
}

void Interp::Step() {
  if (++steps_ > limits_.max_steps)
    FailResource(absl::StrCat("template exceeded ", limits_.max_steps, " evaluation steps"));
}

void Interp::Emit(std::string* out, std::string_view s) {
  out_bytes_ += s.size();
  if (out_bytes_ > limits_.max_output_bytes)
    FailResource(absl::StrCat("template output exceeded ", limits_.max_output_bytes, " bytes"));
  out->append(s.data(), s.size());
}

Interp::DepthGuard::DepthGuard(Interp* in) : in_(in) {
  if (++in_->depth_ > in_->limits_.max_eval_depth)
    FailResource(
        absl::StrCat("template evaluation nested deeper than ", in_->limits_.max_eval_depth));
}

void Interp::CheckString(size_t n) const {
  if (n > limits_.max_string_bytes)
    FailResource(absl::StrCat("string value exceeded ", limits_.max_string_bytes, " bytes"));
}
void Interp::CheckItems(size_t n) const {
  if (n > limits_.max_container_items)
    FailResource(absl::StrCat("container exceeded ", limits_.max_container_items, " items"));
}

std::shared_ptr<Namespace> Interp::NewNamespace() {
  auto ns = std::make_shared<Namespace>();
  namespaces_.push_back(ns);
  return ns;
}

void Interp::Capture(const std::shared_ptr<Scope>& scope) {
  if (scope->captured) return;
  scope->captured = true;
  captured_.push_back(scope);
}

Value Interp::FromJson(const nlohmann::ordered_json& j, int depth) {
  if (depth > kMaxValueDepth) FailResource("context JSON nested deeper than 200 levels");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        Fail("unsupported construct: context integer beyond 64 bits");
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::Str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      CheckItems(j.size());
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(FromJson(x, depth + 1));
      return Value::List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      CheckItems(j.size());
      std::vector<std::pair<Value, Value>> items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it)
        items.emplace_back(Value::Str(it.key()), FromJson(it.value(), depth + 1));
      return Value::Dict(std::move(items));
    }
    default:
      Fail("unsupported JSON value in the context (binary)");
  }
}

std::string Interp::Run(const nlohmann::ordered_json& context) {
  auto root = std::make_shared<Scope>();
  InstallGlobals(root.get());
  if (!context.is_object()) Fail("the render context must be a JSON object");
  for (auto it = context.begin(); it != context.end(); ++it)
    root->vars[it.key()] = FromJson(it.value(), 0);
  auto top = std::make_shared<Scope>();
  top->parent = root;
  std::string out;
  Exec(program_.body, top, &out);
  return out;
}

// ---------------------------------------------------------------- statements

Flow Interp::Exec(const Body& body, const std::shared_ptr<Scope>& scope, std::string* out) {
  for (const StmtP& s : body) {
    const Flow f = ExecOne(*s, scope, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

void Interp::Assign(const Target& t, Value v, const std::shared_ptr<Scope>& scope) {
  if (!t.attr.empty()) {
    Value* ns = scope->Find(t.names[0]);
    if (ns == nullptr || !ns->is_object() || dynamic_cast<Namespace*>(ns->obj().get()) == nullptr)
      Fail("cannot assign attribute on non-namespace object");
    static_cast<Namespace*>(ns->obj().get())->Set(t.attr, std::move(v));
    return;
  }
  if (!t.tuple) {
    scope->vars[t.names[0]] = std::move(v);
    return;
  }
  std::vector<Value> items = Iterate(v);
  if (items.size() > t.names.size())
    Fail(absl::StrCat("too many values to unpack (expected ", t.names.size(), ")"));
  if (items.size() < t.names.size())
    Fail(absl::StrCat("not enough values to unpack (expected ", t.names.size(), ", got ",
                      items.size(), ")"));
  for (size_t i = 0; i < items.size(); ++i) scope->vars[t.names[i]] = std::move(items[i]);
}

Flow Interp::ExecOne(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string* out) {
  Step();
  DepthGuard guard(this);
  switch (s.kind) {
    case StmtKind::kText:
      Emit(out, s.text);
      return Flow::kNormal;
    case StmtKind::kOutput: {
      const Value v = Eval(*s.expr, scope);
      Emit(out, Str(v));
      return Flow::kNormal;
    }
    case StmtKind::kIf:
      for (const auto& br : s.branches)
        if (Truthy(Eval(*br.first, scope))) return Exec(br.second, scope, out);
      return Exec(s.else_body, scope, out);
    case StmtKind::kFor:
      return ExecFor(s, scope, out);
    case StmtKind::kSet:
      Assign(s.target, Eval(*s.expr, scope), scope);
      return Flow::kNormal;
    case StmtKind::kSetBlock: {
      std::string buf;
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      Exec(s.body, inner, &buf);
      Value v = Value::Str(std::move(buf));
      for (const ExprP& f : s.filters) v = ApplyFilterExpr(*f, std::move(v), scope);
      Assign(s.target, std::move(v), scope);
      return Flow::kNormal;
    }
    case StmtKind::kFilterBlock: {
      std::string buf;
      const Flow f = Exec(s.body, scope, &buf);
      Value v = Value::Str(std::move(buf));
      for (const ExprP& fe : s.filters) v = ApplyFilterExpr(*fe, std::move(v), scope);
      Emit(out, Str(v));
      return f;
    }
    case StmtKind::kMacro: {
      Capture(scope);
      scope->vars[s.name] = Value::Obj(std::make_shared<Macro>(&s, s.name, scope));
      return Flow::kNormal;
    }
    case StmtKind::kCallBlock: {
      Capture(scope);
      auto caller = std::make_shared<Macro>(&s, "caller", scope);
      const Expr& call = *s.expr;
      Value callee = EvalCallee(call, scope);
      CallArgs args = EvalArgs(call, scope);
      args.kw.emplace_back("caller", Value::Obj(caller));
      Emit(out, Str(CallValue(callee, args)));
      return Flow::kNormal;
    }
    case StmtKind::kWith: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      for (const auto& a : s.assigns) Assign(a.first, Eval(*a.second, scope), inner);
      return Exec(s.body, inner, out);
    }
    case StmtKind::kBreak:
      return Flow::kBreak;
    case StmtKind::kContinue:
      return Flow::kContinue;
    case StmtKind::kGeneration:
      return Exec(s.body, scope, out);
  }
  return Flow::kNormal;
}

Flow Interp::ExecFor(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string* out) {
  std::vector<Value> items = Iterate(Eval(*s.expr, scope));
  if (s.cond) {
    std::vector<Value> kept;
    for (Value& item : items) {
      Step();
      auto probe = std::make_shared<Scope>();
      probe->parent = scope;
      Assign(s.target, item, probe);
      if (Truthy(Eval(*s.cond, probe))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) return Exec(s.else_body, scope, out);
  auto loop = std::make_shared<LoopObj>(items);
  loop->self_ = loop;
  const Value loop_value = Value::Obj(loop);
  for (size_t i = 0; i < items.size(); ++i) {
    Step();
    loop->set_index(i);
    auto iter = std::make_shared<Scope>();
    iter->parent = scope;
    iter->vars["loop"] = loop_value;
    Assign(s.target, items[i], iter);
    const Flow f = Exec(s.body, iter, out);
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

// ---------------------------------------------------------------- macros

Value Macro::Call(Interp& in, CallArgs& args) {
  if (++in.call_depth_ > in.limits_.max_call_depth) {
    --in.call_depth_;
    FailResource(absl::StrCat("macro calls nested deeper than ", in.limits_.max_call_depth));
  }
  struct Dec {
    Interp& in;
    ~Dec() { --in.call_depth_; }
  } dec{in};
  const auto& params = def_->params;
  if (args.pos.size() > params.size())
    Fail(absl::StrCat("macro '", name_, "' takes not more than ", params.size(), " argument(s)"));
  auto scope = std::make_shared<Scope>();
  scope->parent = closure_;
  std::vector<bool> set(params.size(), false);
  for (size_t i = 0; i < args.pos.size(); ++i) {
    scope->vars[params[i].first] = args.pos[i];
    set[i] = true;
  }
  for (auto& kv : args.kw) {
    if (kv.first == "caller") {
      scope->vars["caller"] = kv.second;
      continue;
    }
    size_t k = 0;
    while (k < params.size() && params[k].first != kv.first) ++k;
    if (k == params.size())
      Fail(absl::StrCat("macro '", name_, "' takes no keyword argument '", kv.first, "'"));
    if (set[k])
      Fail(absl::StrCat("macro '", name_, "' got multiple values for argument '", kv.first, "'"));
    scope->vars[kv.first] = kv.second;
    set[k] = true;
  }
  for (size_t k = 0; k < params.size(); ++k) {
    if (set[k]) continue;
    scope->vars[params[k].first] =
        params[k].second
            ? in.Eval(*params[k].second, scope)
            : Value::Undefined(absl::StrCat("parameter '", params[k].first, "' was not provided"));
  }
  std::string buf;
  in.Exec(def_->body, scope, &buf);
  return Value::Str(std::move(buf));
}

// ---------------------------------------------------------------- expressions

std::vector<Value> Interp::Iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return {};
    case Kind::kList:
      return v.items();
    case Kind::kDict: {
      std::vector<Value> keys;
      keys.reserve(v.dict().items.size());
      for (const auto& kv : v.dict().items) keys.push_back(kv.first);
      return keys;
    }
    case Kind::kString: {
      std::vector<Value> chars;
      for (const std::string& c : SplitChars(v.s())) chars.push_back(Value::Str(c));
      return chars;
    }
    default:
      Fail(absl::StrCat("'", PyTypeName(v), "' object is not iterable"));
  }
}

Value Interp::Eval(const Expr& e, const std::shared_ptr<Scope>& scope) {
  Step();
  DepthGuard guard(this);
  switch (e.kind) {
    case ExprKind::kLiteral:
      return e.literal;
    case ExprKind::kName: {
      const Value* v = scope->Find(e.name);
      if (v != nullptr) return *v;
      return Value::Undefined(absl::StrCat("'", e.name, "' is undefined"));
    }
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.items.size());
      for (const ExprP& x : e.items) items.push_back(Eval(*x, scope));
      return Value::List(std::move(items), e.kind == ExprKind::kTuple);
    }
    case ExprKind::kDict: {
      std::vector<std::pair<Value, Value>> items;
      for (const auto& kv : e.pairs) {
        Value k = Eval(*kv.first, scope);
        Value v = Eval(*kv.second, scope);
        DictSet(&items, std::move(k), std::move(v));
      }
      return Value::Dict(std::move(items));
    }
    case ExprKind::kGetAttr:
      return GetAttr(Eval(*e.a, scope), e.name);
    case ExprKind::kGetItem:
      return GetItem(Eval(*e.a, scope), Eval(*e.b, scope));
    case ExprKind::kSlice: {
      const Value obj = Eval(*e.items[0], scope);
      const Value start = e.a ? Eval(*e.a, scope) : Value::None();
      const Value stop = e.b ? Eval(*e.b, scope) : Value::None();
      const Value step = e.c ? Eval(*e.c, scope) : Value::None();
      return SliceValue(obj, start, stop, step);
    }
    case ExprKind::kCall: {
      if (e.a->kind == ExprKind::kGetAttr) {
        const Value obj = Eval(*e.a->a, scope);
        CallArgs args = EvalArgs(e, scope);
        return CallAttr(obj, e.a->name, args);
      }
      Value callee = Eval(*e.a, scope);
      CallArgs args = EvalArgs(e, scope);
      return CallValue(callee, args);
    }
    case ExprKind::kFilter:
      return ApplyFilterExpr(e, Eval(*e.a, scope), scope);
    case ExprKind::kTest: {
      const Value v = Eval(*e.a, scope);
      CallArgs args = EvalArgs(e, scope);
      const bool r = ApplyTest(e.name, v, args);
      return Value::Bool(e.negated ? !r : r);
    }
    case ExprKind::kNot:
      return Value::Bool(!Truthy(Eval(*e.a, scope)));
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = Eval(*e.a, scope);
      if (v.is_undefined()) FailUndefined(v);
      if (!v.is_number())
        Fail(absl::StrCat("bad operand type for unary ", e.kind == ExprKind::kNeg ? "-" : "+",
                          ": '", PyTypeName(v), "'"));
      if (e.kind == ExprKind::kPos) return v.is_bool() ? Value::Int(v.i()) : v;
      if (v.is_float()) return Value::Float(-v.f());
      if (v.i() == INT64_MIN) Fail("integer overflow (this renderer's integers are 64-bit)");
      return Value::Int(-v.i());
    }
    case ExprKind::kBinary:
      return BinaryOp(e.bin, Eval(*e.a, scope), Eval(*e.b, scope));
    case ExprKind::kAnd: {
      Value l = Eval(*e.a, scope);
      if (!Truthy(l)) return l;
      return Eval(*e.b, scope);
    }
    case ExprKind::kOr: {
      Value l = Eval(*e.a, scope);
      if (Truthy(l)) return l;
      return Eval(*e.b, scope);
    }
    case ExprKind::kConcat: {
      std::string s;
      for (const ExprP& x : e.items) {
        s += Str(Eval(*x, scope));
        CheckString(s.size());
      }
      return Value::Str(std::move(s));
    }
    case ExprKind::kCompare: {
      Value left = Eval(*e.a, scope);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = Eval(*e.items[i], scope);
        if (!Compare(e.ops[i], left, right)) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case ExprKind::kCond:
      if (Truthy(Eval(*e.a, scope))) return Eval(*e.b, scope);
      if (e.c) return Eval(*e.c, scope);
      return Value::Undefined(absl::StrCat("the inline if-expression on line ", e.pos.line,
                                           " evaluated to false and no else section was defined."));
  }
  return Value();
}

CallArgs Interp::EvalArgs(const Expr& e, const std::shared_ptr<Scope>& scope) {
  CallArgs args;
  for (const ExprP& x : e.items) args.pos.push_back(Eval(*x, scope));
  for (const auto& kv : e.kwargs) args.kw.emplace_back(kv.first, Eval(*kv.second, scope));
  return args;
}

Value Interp::EvalCallee(const Expr& call, const std::shared_ptr<Scope>& scope) {
  if (call.a->kind == ExprKind::kGetAttr) return GetAttr(Eval(*call.a->a, scope), call.a->name);
  return Eval(*call.a, scope);
}

Value Interp::CallValue(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) FailUndefined(callee);
  if (callee.is_object() && callee.obj()->callable()) return callee.obj()->Call(*this, args);
  Fail(absl::StrCat("'", PyTypeName(callee), "' object is not callable"));
}

bool Interp::Compare(CmpOp op, const Value& a, const Value& b) {
  switch (op) {
    case CmpOp::kEq:
      return Equal(a, b);
    case CmpOp::kNe:
      return !Equal(a, b);
    case CmpOp::kLt:
      return Less(a, b, "<");
    case CmpOp::kLe:
      return !Less(b, a, "<=");
    case CmpOp::kGt:
      return Less(b, a, ">");
    case CmpOp::kGe:
      return !Less(a, b, ">=");
    case CmpOp::kIn:
      return Contains(b, a);
    case CmpOp::kNotIn:
      return !Contains(b, a);
  }
  return false;
}

bool Interp::Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (item.is_undefined()) FailUndefined(item);
      if (!item.is_string())
        Fail(absl::StrCat("'in <string>' requires string as left operand, not ", PyTypeName(item)));
      return container.s().find(item.s()) != std::string::npos;
    case Kind::kList:
      for (const Value& x : container.items())
        if (Equal(x, item)) return true;
      return false;
    case Kind::kDict:
      if (item.is_list() || item.is_dict())
        Fail(absl::StrCat("unhashable type: '", PyTypeName(item), "'"));
      return container.dict().Find(item) != nullptr;
    default:
      Fail(absl::StrCat("argument of type '", PyTypeName(container), "' is not iterable"));
  }
}

void Interp::DictSet(std::vector<std::pair<Value, Value>>* items, Value key, Value value) {
  if (key.is_list() || key.is_dict())
    Fail(absl::StrCat("unhashable type: '", PyTypeName(key), "'"));
  for (auto& kv : *items) {
    if (Equal(kv.first, key)) {
      kv.second = std::move(value);
      return;
    }
  }
  CheckItems(items->size() + 1);
  items->emplace_back(std::move(key), std::move(value));
}

namespace {

bool MulOverflow(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

int64_t FloorDivInt(int64_t a, int64_t b) {
  if (b == 0) Fail("integer division or modulo by zero");
  if (a == INT64_MIN && b == -1) Fail("integer overflow (this renderer's integers are 64-bit)");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t ModInt(int64_t a, int64_t b) {
  if (b == 0) Fail("integer division or modulo by zero");
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

double ModFloat(double a, double b) {
  if (b == 0) Fail("float modulo");
  double r = std::fmod(a, b);
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

[[noreturn]] void Unsupported(const char* op, const Value& a, const Value& b) {
  Fail(absl::StrCat("unsupported operand type(s) for ", op, ": '", PyTypeName(a), "' and '",
                    PyTypeName(b), "'"));
}

}  // namespace

Value Interp::Repeat(const Value& seq, int64_t n) {
  if (n <= 0) return seq.is_string() ? Value::Str("") : Value::List({}, seq.is_tuple());
  if (seq.is_string()) {
    if (seq.s().size() != 0 && static_cast<uint64_t>(n) > limits_.max_string_bytes / seq.s().size())
      CheckString(limits_.max_string_bytes + 1);
    std::string out;
    out.reserve(seq.s().size() * n);
    for (int64_t i = 0; i < n; ++i) out += seq.s();
    return Value::Str(std::move(out));
  }
  const auto& items = seq.items();
  if (!items.empty() && static_cast<uint64_t>(n) > limits_.max_container_items / items.size())
    CheckItems(limits_.max_container_items + 1);
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
  return Value::List(std::move(out), seq.is_tuple());
}

Value Interp::BinaryOp(BinOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  const bool nums = a.is_number() && b.is_number();
  const bool fl = nums && (a.is_float() || b.is_float());
  switch (op) {
    case BinOp::kAdd:
      if (nums) {
        if (fl) return Value::Float(a.f() + b.f());
        int64_t r;
        if (__builtin_add_overflow(a.i(), b.i(), &r))
          Fail("integer overflow (this renderer's integers are 64-bit)");
        return Value::Int(r);
      }
      if (a.is_string() && b.is_string()) {
        CheckString(a.s().size() + b.s().size());
        return Value::Str(a.s() + b.s());
      }
      if (a.is_list() && b.is_list() && a.flavor() == b.flavor() &&
          (a.flavor() == Flavor::kList || a.flavor() == Flavor::kTuple)) {
        CheckItems(a.items().size() + b.items().size());
        std::vector<Value> out = a.items();
        out.insert(out.end(), b.items().begin(), b.items().end());
        return Value::List(std::move(out), a.is_tuple());
      }
      if (a.is_string() || a.is_plain_list() || a.is_tuple())
        Fail(absl::StrCat("can only concatenate ", PyTypeName(a), " (not \"", PyTypeName(b),
                          "\") to ", PyTypeName(a)));
      Unsupported("+", a, b);
    case BinOp::kSub:
      if (!nums) Unsupported("-", a, b);
      if (fl) return Value::Float(a.f() - b.f());
      {
        int64_t r;
        if (__builtin_sub_overflow(a.i(), b.i(), &r))
          Fail("integer overflow (this renderer's integers are 64-bit)");
        return Value::Int(r);
      }
    case BinOp::kMul:
      if (nums) {
        if (fl) return Value::Float(a.f() * b.f());
        int64_t r;
        if (MulOverflow(a.i(), b.i(), &r))
          Fail("integer overflow (this renderer's integers are 64-bit)");
        return Value::Int(r);
      }
      if ((a.is_string() || a.is_plain_list() || a.is_tuple()) && (b.is_int() || b.is_bool()))
        return Repeat(a, b.i());
      if ((b.is_string() || b.is_plain_list() || b.is_tuple()) && (a.is_int() || a.is_bool()))
        return Repeat(b, a.i());
      if (a.is_string() || b.is_string() || a.is_list() || b.is_list())
        Fail(absl::StrCat("can't multiply sequence by non-int of type '",
                          PyTypeName(a.is_string() || a.is_list() ? b : a), "'"));
      Unsupported("*", a, b);
    case BinOp::kDiv:
      if (!nums) Unsupported("/", a, b);
      if (b.f() == 0) Fail("division by zero");
      return Value::Float(a.f() / b.f());
    case BinOp::kFloorDiv:
      if (!nums) Unsupported("//", a, b);
      if (fl) {
        if (b.f() == 0) Fail("float floor division by zero");
        return Value::Float(std::floor(a.f() / b.f()));
      }
      return Value::Int(FloorDivInt(a.i(), b.i()));
    case BinOp::kMod:
      if (a.is_string()) Fail("unsupported construct: printf-style string formatting with %");
      if (!nums) Unsupported("%", a, b);
      if (fl) return Value::Float(ModFloat(a.f(), b.f()));
      return Value::Int(ModInt(a.i(), b.i()));
    case BinOp::kPow:
      if (!nums) Unsupported("** or pow()", a, b);
      if (!fl && b.i() >= 0) {
        int64_t base = a.i(), e = b.i(), r = 1;
        while (e > 0) {
          if (e & 1)
            if (MulOverflow(r, base, &r))
              Fail("integer overflow (this renderer's integers are 64-bit)");
          e >>= 1;
          if (e > 0 && MulOverflow(base, base, &base))
            Fail("integer overflow (this renderer's integers are 64-bit)");
        }
        return Value::Int(r);
      }
      if (a.f() == 0 && b.f() < 0) Fail("0.0 cannot be raised to a negative power");
      {
        const double r = std::pow(a.f(), b.f());
        if (std::isnan(r) && !std::isnan(a.f()) && !std::isnan(b.f()))
          Fail("unsupported construct: complex result of **");
        return Value::Float(r);
      }
  }
  return Value();
}

Value Interp::SliceValue(const Value& obj, const Value& start, const Value& stop,
                         const Value& step) {
  if (obj.is_undefined()) FailUndefined(obj);
  auto idx = [](const Value& v) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (v.is_undefined()) FailUndefined(v);
    if (!v.is_int() && !v.is_bool())
      Fail("slice indices must be integers or None or have an __index__ method");
    return v.i();
  };
  const auto a = idx(start), b = idx(stop), c = idx(step);
  const int64_t st = c.value_or(1);
  if (st == 0) Fail("slice step cannot be zero");
  std::vector<std::string> chars;
  const std::vector<Value>* items = nullptr;
  int64_t n;
  if (obj.is_string()) {
    chars = SplitChars(obj.s());
    n = static_cast<int64_t>(chars.size());
  } else if (obj.is_list() && (obj.flavor() == Flavor::kList || obj.flavor() == Flavor::kTuple)) {
    items = &obj.items();
    n = static_cast<int64_t>(items->size());
  } else {
    return Value::Undefined(absl::StrCat("'", PyTypeName(obj), " object' has no element slice"));
  }
  auto clamp = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t lo = clamp(a, st < 0 ? n - 1 : 0);
  const int64_t hi = clamp(b, st < 0 ? -1 : n);
  std::vector<int64_t> picks;
  if (st > 0) {
    for (int64_t i = lo; i < hi; i += st) picks.push_back(i);
  } else {
    for (int64_t i = lo; i > hi; i += st) picks.push_back(i);
  }
  if (obj.is_string()) {
    std::string out;
    for (int64_t i : picks) out += chars[i];
    return Value::Str(std::move(out));
  }
  std::vector<Value> out;
  for (int64_t i : picks) out.push_back((*items)[i]);
  return Value::List(std::move(out), obj.is_tuple());
}

namespace {
std::string ObjectTypeRepr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_object()) return absl::StrCat(v.obj()->TypeName(), " object");
  return absl::StrCat(PyTypeName(v), " object");
}
}  // namespace

Value Interp::MissingAttr(const Value& obj, const std::string& name) {
  return Value::Undefined(
      absl::StrCat("'", ObjectTypeRepr(obj), "' has no attribute '", name, "'"));
}

Value Interp::GetAttr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) FailUndefined(obj);
  if (!name.empty() && name[0] == '_')
    return Value::Undefined(absl::StrCat("access to attribute '", name, "' of '", PyTypeName(obj),
                                         "' object is unsafe."),
                            true);
  if (obj.is_object()) return obj.obj()->GetAttr(name);
  const MethodKind mk = LookupMethod(obj, name);
  if (mk == MethodKind::kUnsafe)
    return Value::Undefined(absl::StrCat("access to attribute '", name, "' of '", PyTypeName(obj),
                                         "' object is unsafe."),
                            true);
  if (mk != MethodKind::kNone) return BoundMethod(obj, name);
  if (obj.is_dict()) {
    const Value* v = obj.dict().Find(Value::Str(name));
    if (v != nullptr) return *v;
  }
  return MissingAttr(obj, name);
}

Value Interp::GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) FailUndefined(obj);
  if (obj.is_dict()) {
    if (!key.is_list() && !key.is_dict()) {
      const Value* v = obj.dict().Find(key);
      if (v != nullptr) return *v;
    }
  } else if (obj.is_list() && (obj.flavor() == Flavor::kList || obj.flavor() == Flavor::kTuple) &&
             (key.is_int() || key.is_bool())) {
    int64_t i = key.i();
    const int64_t n = static_cast<int64_t>(obj.items().size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return obj.items()[i];
  } else if (obj.is_string() && (key.is_int() || key.is_bool())) {
    const std::vector<std::string> chars = SplitChars(obj.s());
    int64_t i = key.i();
    const int64_t n = static_cast<int64_t>(chars.size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return Value::Str(chars[i]);
  }
  if (key.is_string()) {
    if (obj.is_dict()) {
      // Python attribute first failed (no method of that name): missing.
      if (LookupMethod(obj, key.s()) == MethodKind::kNone) return MissingAttr(obj, key.s());
    }
    return GetAttr(obj, key.s());
  }
  if (key.is_undefined()) FailUndefined(key);
  return Value::Undefined(absl::StrCat("'", ObjectTypeRepr(obj), "' has no element ", Repr(key)));
}

Value Interp::BoundMethod(const Value& self, const std::string& name) {
  return Value::Obj(std::make_shared<Method>(self, name));
}

Value Method::Call(Interp& in, CallArgs& args) { return in.CallMethod(self_, name_, args); }
std::string Method::Repr() const {
  Fail(absl::StrCat("unsupported construct: printing the method ", PyTypeName(self_), ".", name_,
                    " (Python prints its address)"));
}

Value Interp::CallAttr(const Value& obj, const std::string& name, CallArgs& args) {
  Value callee = GetAttr(obj, name);
  return CallValue(callee, args);
}

// ---------------------------------------------------------------- globals

void Interp::InstallGlobals(Scope* root) {
  root->vars["raise_exception"] = MakeBuiltin("raise_exception", [](Interp&, CallArgs& a) -> Value {
    const std::string msg = a.pos.empty() ? "" : Str(a.pos[0]);
    throw Error{absl::StatusCode::kInvalidArgument, absl::StrCat("chat template raised: ", msg)};
  });
  root->vars["strftime_now"] = MakeBuiltin("strftime_now", [](Interp& in, CallArgs& a) -> Value {
    if (a.pos.size() != 1 || !a.pos[0].is_string())
      Fail("strftime_now() takes one string argument");
    const std::time_t t = in.options_.now ? in.options_.now() : std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    const std::string& fmt = a.pos[0].s();
    if (fmt.empty()) return Value::Str("");
    std::vector<char> buf(fmt.size() * 8 + 256);
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
    if (n == 0) Fail("strftime_now: format produced no output or is too long");
    return Value::Str(std::string(buf.data(), n));
  });
  root->vars["namespace"] = MakeBuiltin("namespace", [](Interp& in, CallArgs& a) -> Value {
    auto ns = in.NewNamespace();
    if (a.pos.size() > 1) Fail("namespace expected at most 1 argument");
    if (!a.pos.empty()) {
      for (const auto& kv : in.DictFromArg(a.pos[0])) {
        if (!kv.first.is_string()) Fail("keywords must be strings");
        ns->Set(kv.first.s(), kv.second);
      }
    }
    for (auto& kv : a.kw) ns->Set(kv.first, kv.second);
    return Value::Obj(ns);
  });
  root->vars["dict"] = MakeBuiltin("dict", [](Interp& in, CallArgs& a) -> Value {
    if (a.pos.size() > 1) Fail("dict expected at most 1 argument");
    std::vector<std::pair<Value, Value>> items;
    if (!a.pos.empty())
      for (auto& kv : in.DictFromArg(a.pos[0])) in.DictSet(&items, kv.first, kv.second);
    for (auto& kv : a.kw) in.DictSet(&items, Value::Str(kv.first), kv.second);
    return Value::Dict(std::move(items));
  });
  root->vars["range"] = MakeBuiltin("range", [](Interp& in, CallArgs& a) -> Value {
    if (a.pos.empty() || a.pos.size() > 3 || !a.kw.empty()) Fail("range expected 1 to 3 arguments");
    for (const Value& v : a.pos) {
      if (v.is_undefined()) FailUndefined(v);
      if (!v.is_int() && !v.is_bool())
        Fail(absl::StrCat("'", PyTypeName(v), "' object cannot be interpreted as an integer"));
    }
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = a.pos[0].i();
    } else {
      start = a.pos[0].i();
      stop = a.pos[1].i();
      if (a.pos.size() == 3) step = a.pos[2].i();
    }
    if (step == 0) Fail("range() arg 3 must not be zero");
    std::vector<Value> out;
    const __int128 span = step > 0 ? (__int128)stop - start : (__int128)start - stop;
    const __int128 count =
        span <= 0 ? 0 : (span + (step > 0 ? step : -step) - 1) / (step > 0 ? step : -step);
    if (count > 100000)
      Fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    in.CheckItems(static_cast<size_t>(count));
    for (__int128 k = 0; k < count; ++k)
      out.push_back(Value::Int(static_cast<int64_t>(start + k * step)));
    return Value::List(std::move(out));
  });
}

std::vector<std::pair<Value, Value>> Interp::DictFromArg(const Value& v) {
  if (v.is_dict()) return v.dict().items;
  std::vector<std::pair<Value, Value>> out;
  for (const Value& item : Iterate(v)) {
    std::vector<Value> kv = Iterate(item);
    if (kv.size() != 2)
      Fail("dictionary update sequence element has the wrong length; 2 is required");
    out.emplace_back(kv[0], kv[1]);
  }
  return out;
}

}  // namespace internal

// ---------------------------------------------------------------- public API

absl::StatusOr<Template> Template::Parse(std::string_view source, std::string_view name) {
  try {
    std::shared_ptr<const internal::Program> program = internal::ParseProgram(source, name);
    return Template(std::move(program));
  } catch (const internal::Error& e) {
    return absl::Status(e.code, e.message);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(std::string(name), ": out of memory while parsing"));
  }
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context,
                                             const RenderOptions& options) const {
  try {
    internal::Interp interp(*program_, options);
    return interp.Run(context);
  } catch (const internal::Error& e) {
    if (absl::StartsWith(e.message, "chat template raised: "))
      return absl::Status(e.code, e.message);
    return absl::Status(e.code, absl::StrCat(program_->name, ": ", e.message));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(program_->name, ": out of memory while rendering"));
  }
}

}  // namespace hmoe::jinja
