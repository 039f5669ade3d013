#include "common/experts/weight_format.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace hmoe {
namespace {

std::vector<int> Groups(const WeightFormatTraits& t) {
  std::vector<int> out;
  for (int g : t.groups)
    if (g != 0) out.push_back(g);
  return out;
}

// Every name ParseWeightFormat takes: with groups ("int4g32", ...) or bare.
std::vector<std::string> Names(bool with_groups) {
  std::vector<std::string> names;
  for (const WeightFormatTraits& t : kWeightFormatTraits) {
    if (!with_groups || !IsGrouped(t.format) || TakesOneGroup(t.format)) {
      names.push_back(t.name);
      continue;
    }
    for (int g : Groups(t)) names.push_back(absl::StrCat(t.name, "g", g));
  }
  return names;
}
std::string NameList(bool with_groups) { return absl::StrJoin(Names(with_groups), ", "); }

}  // namespace

std::string WeightFormatChoices() { return absl::StrJoin(Names(true), "|"); }

std::string_view WeightFormatName(WeightFormat f) {
  return IsWeightFormat(f) ? Traits(f).name : "?";
}

std::string WeightFormatName(WeightFormat f, int group) {
  return IsWeightFormat(f) && IsGrouped(f) && !TakesOneGroup(f)
             ? absl::StrCat(Traits(f).name, "g", group)
             : std::string(WeightFormatName(f));
}

absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name) {
  const absl::string_view quoted(name.data(), name.size());
  for (const WeightFormatTraits& t : kWeightFormatTraits)
    if (name == t.name) return t.format;
  return absl::InvalidArgumentError(
      absl::StrCat("format: \"", quoted, "\" is not one of ", NameList(false)));
}

absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name, int* group) {
  const absl::string_view quoted(name.data(), name.size());
  for (const WeightFormatTraits& t : kWeightFormatTraits) {
    const std::string_view base = t.name;
    if (!IsGrouped(t.format)) {
      if (name == base) return t.format;
      continue;
    }
    // base, or base + "g" + digits ("int4g32"; "int4bf16" is another row's).
    if (name.substr(0, base.size()) != base) continue;
    int g = t.default_group;
    if (name.size() > base.size()) {
      const absl::string_view rest = quoted.substr(base.size());
      if (rest[0] != 'g') continue;
      if (!absl::SimpleAtoi(rest.substr(1), &g) || !TakesGroup(t.format, g)) {
        std::vector<std::string> names;
        for (int ok : Groups(t)) names.push_back(WeightFormatName(t.format, ok));
        return absl::InvalidArgumentError(absl::StrCat("format: \"", quoted, "\"; ", t.name,
                                                       " groups are ", absl::StrJoin(names, ", ")));
      }
    }
    if (group) *group = g;
    return t.format;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("format: \"", quoted, "\" is not one of ", NameList(true)));
}

absl::StatusOr<std::pair<WeightFormat, int>> ParseFormatFlag(std::string_view name,
                                                             int bare_group) {
  int group = 0;
  ASSIGN_OR_RETURN(const WeightFormat f, ParseWeightFormat(name, &group));
  if (name == Traits(f).name && TakesGroup(f, bare_group)) group = bare_group;
  return std::make_pair(f, group);
}

absl::Status CheckGroup(WeightFormat f, int group) {
  if (!IsGrouped(f) || TakesGroup(f, group)) return absl::OkStatus();
  const std::vector<int> groups = Groups(Traits(f));
  std::string list;
  for (size_t i = 0; i < groups.size(); ++i)
    absl::StrAppend(&list, i == 0 ? "" : i + 1 == groups.size() ? " or " : ", ", groups[i]);
  return absl::InvalidArgumentError(
      absl::StrCat(Traits(f).name, " group must be ", list, ", got ", group));
}

}  // namespace hmoe
