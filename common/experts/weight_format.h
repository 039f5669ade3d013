// Weight formats by name (host side of common/experts/format_codes.h): the
// one place a format is printed or parsed. Names come from the traits
// table; a grouped format's name may carry its group ("int4g32").
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/experts/format_codes.h"

namespace hmoe {

// The table's name: "bf16" | "int8" | "int4".
std::string_view WeightFormatName(WeightFormat f);
// With the group for grouped formats ("int4g64"), else the bare name: the
// name ParseWeightFormat(name, &group) reads back.
std::string WeightFormatName(WeightFormat f, int group);

// Every name a --format flag takes, grouped formats with each group
// ("bf16|int8|int4g32|...|mxfp8"): a flag's value placeholder.
std::string WeightFormatChoices();

// A bare table name ("int4"); INVALID_ARGUMENT naming `name` and the names
// taken otherwise (a name with a group among them: the caller would lose it).
absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name);
// A bare name or, for grouped formats, name + "g" + a group the format takes
// ("int4g32"); a bare grouped name means its default group. Sets *group for
// grouped formats and leaves it alone otherwise. INVALID_ARGUMENT naming
// `name` and the names taken otherwise.
absl::StatusOr<WeightFormat> ParseWeightFormat(std::string_view name, int* group);

// A --format flag's name (the one parser of every program's --format): as
// ParseWeightFormat(name, &group), except that a bare grouped name ("int4")
// means `bare_group` where the format takes it, else the default group.
// {format, group}; group 0 for formats without groups.
absl::StatusOr<std::pair<WeightFormat, int>> ParseFormatFlag(std::string_view name,
                                                             int bare_group = 0);

// OK when grouped `f` takes `group` or `f` has no groups; INVALID_ARGUMENT
// naming the format, the groups it takes and `group` otherwise.
absl::Status CheckGroup(WeightFormat f, int group);

}  // namespace hmoe
