// Our own interpreter of the Jinja2 subset that Hugging Face chat templates
// use, rendering as Python jinja2 does in transformers' apply_chat_template
// environment: ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True, extensions=[loopcontrols]) plus the globals
// raise_exception, strftime_now, namespace, dict and transformers' tojson.
//
// Supported (see jinja_parser.cc for the grammar):
//   statements  if/elif/else, for (else, `if` filter, tuple targets, loop.*),
//               set (also tuple targets, ns.attr, and the block form),
//               macro, call, filter blocks, with, raw, break/continue,
//               generation (transformers' extension; renders its body),
//               comments and all whitespace control ({%- -%} {%+ +%}).
//   expressions literals, lists, tuples, dicts, attribute / item access,
//               slices, calls (positional + keyword), + - * / // % ** ~,
//               comparisons (chained), in / not in, and/or/not, a if c else b,
//               `is` tests, filters.
//   values      none / bool / int (64-bit; overflow is an error) / float /
//               str (UTF-8, indexed by code point) / list / tuple /
//               dict (insertion-ordered) / namespace / macro / method /
//               undefined, printed as Python's str() prints them.
// Anything else (an unknown statement, filter or test, extends / include /
// import, recursive loops, *args, ...) fails at parse time with
// INVALID_ARGUMENT naming the construct and its line:column. Runtime errors
// (type errors, undefined misuse, raise_exception, sandbox refusals) are
// INVALID_ARGUMENT; exceeding a Limits bound is RESOURCE_EXHAUSTED.
// Known divergences from Python (documented, not silent in practice):
// integers are 64-bit; str.upper/lower/title cover ASCII, Latin-1, Latin
// Extended-A, Greek and Cyrillic only; `safe` returns a plain string (no
// Markup escaping on later concatenation).
#pragma once

#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace hmoe::jinja {

namespace internal {
struct Program;
}  // namespace internal

// Bounds for one Render(); exceeding one returns RESOURCE_EXHAUSTED.
struct Limits {
  uint64_t max_steps = 20'000'000;        // expressions + statements evaluated
  size_t max_output_bytes = 64u << 20;    // all text produced (incl. captured blocks)
  int max_call_depth = 32;                // nested macro / caller() calls
  int max_eval_depth = 1500;              // nested evaluation (C++ recursion)
  size_t max_string_bytes = 64u << 20;    // one string value (e.g. 'x' * n)
  size_t max_container_items = 1u << 20;  // one list / dict value
};

struct RenderOptions {
  Limits limits;
  // Clock behind strftime_now (local time, as Python's datetime.now()).
  // Empty: the system clock.
  std::function<std::time_t()> now;
};

class Template {
 public:
  // Lexes and parses `source`. Syntax errors and unsupported constructs ->
  // INVALID_ARGUMENT "<name>:<line>:<column>: ..."; nesting deeper than the
  // parser allows -> RESOURCE_EXHAUSTED.
  static absl::StatusOr<Template> Parse(std::string_view source,
                                        std::string_view name = "template");

  // Renders with `context` (a JSON object; each member a variable). JSON
  // null is Python None. Objects keep their member order.
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context,
                                     const RenderOptions& options = {}) const;

 private:
  explicit Template(std::shared_ptr<const internal::Program> program)
      : program_(std::move(program)) {}
  std::shared_ptr<const internal::Program> program_;
};

}  // namespace hmoe::jinja
