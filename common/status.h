// Status helpers: Abseil 2022-06 has absl::Status(Or) but no status macros.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define HMOE_STATUS_CONCAT_INNER(a, b) a##b
#define HMOE_STATUS_CONCAT(a, b) HMOE_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    ::absl::Status hmoe_status_ = (expr);        \
    if (!hmoe_status_.ok()) return hmoe_status_; \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status if not OK.
// `lhs` may be a declaration: ASSIGN_OR_RETURN(auto x, Foo());
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  HMOE_ASSIGN_OR_RETURN_IMPL(HMOE_STATUS_CONCAT(hmoe_statusor_, __LINE__), lhs, rexpr)

#define HMOE_ASSIGN_OR_RETURN_IMPL(statusor, lhs, rexpr)   \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace hmoe {

// Prefixes a non-OK status's message with `context` (keeps the code).
inline absl::Status Annotate(const absl::Status& s, std::string_view context) {
  if (s.ok()) return s;
  return absl::Status(
      s.code(), absl::StrCat(absl::string_view(context.data(), context.size()), ": ", s.message()));
}

}  // namespace hmoe
