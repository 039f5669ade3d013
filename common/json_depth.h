// Bounded JSON parsing for input from clients: nesting is checked on the
// bytes, iteratively, before any tree is built, so a deeply nested body is
// refused instead of overflowing the stack of the recursive code that later
// copies, compares or prints the tree.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace hmoe {

// How deep a client's JSON (a request body, a field holding JSON) may nest
// arrays and objects: far beyond any chat request or tool schema, far below
// what recursion over the tree can take.
inline constexpr int kMaxClientJsonDepth = 128;

// OK when the arrays and objects in `text` nest at most `max_depth` deep
// (brackets inside strings do not count); else INVALID_ARGUMENT
// "<what>: JSON nested deeper than <max_depth> levels". Nothing else about
// the text is checked. Linear in the bytes, constant stack.
absl::Status CheckJsonDepth(absl::string_view text, int max_depth, absl::string_view what);

// CheckJsonDepth, then nlohmann's parser (which is iterative).
// INVALID_ARGUMENT "<what>: not valid JSON" for text that does not parse.
absl::StatusOr<nlohmann::ordered_json> ParseClientJson(absl::string_view text,
                                                       absl::string_view what,
                                                       int max_depth = kMaxClientJsonDepth);

}  // namespace hmoe
