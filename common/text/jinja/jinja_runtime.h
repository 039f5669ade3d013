// Internals of the Jinja evaluator (common/text/jinja/jinja.h): scopes, the
// interpreter state, callables. Filters, tests and methods live in
// jinja_builtins.cc; statements and expressions in jinja_eval.cc.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/text/jinja/jinja.h"
#include "common/text/jinja/jinja_internal.h"
#include "nlohmann/json.hpp"

namespace hmoe::jinja::internal {

struct Scope {
  std::shared_ptr<Scope> parent;
  absl::flat_hash_map<std::string, Value> vars;
  bool captured = false;  // a macro closes over it (cleared after the render)
  Value* Find(const std::string& name);
};

enum class Flow { kNormal, kBreak, kContinue };

using BuiltinFn = std::function<Value(Interp&, CallArgs&)>;

class Builtin final : public Object {
 public:
  Builtin(std::string name, BuiltinFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string TypeName() const override { return "builtin_function_or_method"; }
  std::string Repr() const override { return "<built-in function " + name_ + ">"; }
  bool callable() const override { return true; }
  Value Call(Interp& in, CallArgs& args) override { return fn_(in, args); }

 private:
  std::string name_;
  BuiltinFn fn_;
};
Value MakeBuiltin(std::string name, BuiltinFn fn);

// A method of a str / dict / list value, bound to it.
class Method final : public Object {
 public:
  Method(Value self, std::string name) : self_(std::move(self)), name_(std::move(name)) {}
  std::string TypeName() const override { return "builtin_function_or_method"; }
  std::string Repr() const override;
  bool callable() const override { return true; }
  Value Call(Interp& in, CallArgs& args) override;

 private:
  Value self_;
  std::string name_;
};

// A {% macro %} or the `caller` of a {% call %} block.
class Macro final : public Object {
 public:
  Macro(const Stmt* def, std::string name, std::shared_ptr<Scope> closure)
      : def_(def), name_(std::move(name)), closure_(std::move(closure)) {}
  std::string TypeName() const override { return "Macro"; }
  std::string Repr() const override { return "<Macro '" + name_ + "'>"; }
  bool callable() const override { return true; }
  Value Call(Interp& in, CallArgs& args) override;

 private:
  const Stmt* def_;
  std::string name_;
  std::shared_ptr<Scope> closure_;
};

enum class MethodKind { kNone, kSafe, kUnsafe };

// Splits UTF-8 text into code points (an invalid byte is one unit).
std::vector<std::string> SplitChars(const std::string& s);

class Interp {
 public:
  Interp(const Program& program, const RenderOptions& options);
  ~Interp();
  std::string Run(const nlohmann::ordered_json& context);

  Flow Exec(const Body& body, const std::shared_ptr<Scope>& scope, std::string* out);
  Value Eval(const Expr& e, const std::shared_ptr<Scope>& scope);
  Value CallValue(const Value& callee, CallArgs& args);
  Value CallMethod(const Value& self, const std::string& name, CallArgs& args);  // builtins.cc
  std::vector<Value> Iterate(const Value& v);
  Value GetAttr(const Value& obj, const std::string& name);
  Value GetItem(const Value& obj, const Value& key);
  std::shared_ptr<Namespace> NewNamespace();
  std::vector<std::pair<Value, Value>> DictFromArg(const Value& v);
  void DictSet(std::vector<std::pair<Value, Value>>* items, Value key, Value value);
  void CheckString(size_t n) const;
  void CheckItems(size_t n) const;
  void Step();

  // Filters and tests (jinja_builtins.cc).
  Value ApplyFilterExpr(const Expr& f, Value input, const std::shared_ptr<Scope>& scope);
  Value ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
  bool ApplyTest(const std::string& name, const Value& v, CallArgs& args);
  // Whether `obj`'s type has the method `name`, and whether the sandbox
  // allows it (jinja_builtins.cc).
  MethodKind LookupMethod(const Value& obj, const std::string& name);

  const RenderOptions& options_;
  const Limits limits_;
  int call_depth_ = 0;

 private:
  struct DepthGuard {
    explicit DepthGuard(Interp* in);
    ~DepthGuard() { --in_->depth_; }
    Interp* in_;
  };

  Flow ExecOne(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string* out);
  Flow ExecFor(const Stmt& s, const std::shared_ptr<Scope>& scope, std::string* out);
  void Assign(const Target& t, Value v, const std::shared_ptr<Scope>& scope);
  void Emit(std::string* out, std::string_view s);
  void Capture(const std::shared_ptr<Scope>& scope);
  void InstallGlobals(Scope* root);
  Value FromJson(const nlohmann::ordered_json& j, int depth);
  CallArgs EvalArgs(const Expr& e, const std::shared_ptr<Scope>& scope);
  Value EvalCallee(const Expr& call, const std::shared_ptr<Scope>& scope);
  Value CallAttr(const Value& obj, const std::string& name, CallArgs& args);
  bool Compare(CmpOp op, const Value& a, const Value& b);
  bool Contains(const Value& container, const Value& item);
  Value BinaryOp(BinOp op, const Value& a, const Value& b);
  Value Repeat(const Value& seq, int64_t n);
  Value SliceValue(const Value& obj, const Value& start, const Value& stop, const Value& step);
  Value MissingAttr(const Value& obj, const std::string& name);
  Value BoundMethod(const Value& self, const std::string& name);

  const Program& program_;
  uint64_t steps_ = 0;
  size_t out_bytes_ = 0;
  int depth_ = 0;
  std::vector<std::shared_ptr<Namespace>> namespaces_;
  std::vector<std::shared_ptr<Scope>> captured_;
};

}  // namespace hmoe::jinja::internal
