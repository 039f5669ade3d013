#include "common/json_depth.h"

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::Status CheckJsonDepth(absl::string_view text, int max_depth, absl::string_view what) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": JSON nested deeper than ", max_depth, " levels"));
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;  // unbalanced: the parser refuses it
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::ordered_json> ParseClientJson(absl::string_view text,
                                                       absl::string_view what, int max_depth) {
  if (absl::Status s = CheckJsonDepth(text, max_depth, what); !s.ok()) return s;
  nlohmann::ordered_json j =
      nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON"));
  return j;
}

}  // namespace hmoe
