#include "common/flags.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hmoe {

struct FlagSet::Flag {
  std::string name;                  // without dashes
  std::vector<std::string> aliases;  // with dashes
  std::string value_name;            // empty: a boolean
  std::string help, shown_default, group;
  std::function<absl::Status(std::string_view)> set;
  bool seen = false;
};

namespace {

// The value as errors show it: as given, "" when empty.
std::string Shown(std::string_view v) { return v.empty() ? "\"\"" : std::string(v); }

absl::Status MustBe(std::string_view name, std::string_view what, std::string_view v) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", std::string(name), " must be ", std::string(what), ", got ", Shown(v)));
}

// "a", "a or b", "a, b or c".
std::string Either(const std::vector<std::string>& words) {
  if (words.size() <= 1) return words.empty() ? "" : words[0];
  return absl::StrCat(absl::StrJoin(std::vector<std::string>(words.begin(), words.end() - 1), ", "),
                      " or ", words.back());
}

std::optional<bool> ParseBool(std::string_view v) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  return std::nullopt;
}

std::optional<int64_t> ParseInt(std::string_view v) {
  const std::string s(v);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end == s.c_str() || *end != '\0' || errno == ERANGE) return std::nullopt;
  return x;
}

}  // namespace

FlagSet::FlagSet(std::string program, std::string synopsis, std::string about)
    : program_(std::move(program)), synopsis_(std::move(synopsis)), about_(std::move(about)) {}
FlagSet::~FlagSet() = default;

void FlagSet::Group(std::string title) { group_ = std::move(title); }

FlagSet::Flag& FlagSet::Add(std::string_view name, std::string value_name, std::string_view help,
                            std::string shown_default,
                            std::function<absl::Status(std::string_view)> set) {
  auto f = std::make_unique<Flag>();
  f->name = std::string(name);
  f->value_name = std::move(value_name);
  f->help = std::string(help);
  f->shown_default = std::move(shown_default);
  f->group = group_;
  f->set = std::move(set);
  flags_.push_back(std::move(f));
  return *flags_.back();
}

FlagSet& FlagSet::Bool(std::string_view name, bool* out, std::string_view help) {
  const std::string n(name);
  Add(name, "", help, *out ? "on" : "off", [out, n](std::string_view v) {
    const std::optional<bool> b = ParseBool(v);
    if (!b)
      return absl::InvalidArgumentError(
          absl::StrCat("--", n, " is true or false, got \"", std::string(v), "\""));
    *out = *b;
    return absl::OkStatus();
  });
  return *this;
}

FlagSet& FlagSet::AddInt(std::string_view name, int64_t lo, int64_t hi, std::string shown,
                         std::string_view help, std::function<void(int64_t)> store) {
  const std::string n(name);
  Add(name, "N", help, std::move(shown), [n, lo, hi, store = std::move(store)](std::string_view v) {
    const std::optional<int64_t> x = ParseInt(v);
    if (!x || *x < lo || *x > hi)
      return MustBe(n, absl::StrCat("an integer in [", lo, ", ", hi, "]"), v);
    store(*x);
    return absl::OkStatus();
  });
  return *this;
}

FlagSet& FlagSet::Int(std::string_view name, int64_t* out, int64_t lo, int64_t hi,
                      std::string_view help) {
  return AddInt(name, lo, hi, absl::StrCat(*out), help, [out](int64_t x) { *out = x; });
}

FlagSet& FlagSet::Int(std::string_view name, int* out, int64_t lo, int64_t hi,
                      std::string_view help) {
  return AddInt(name, std::max<int64_t>(lo, INT_MIN), std::min<int64_t>(hi, INT_MAX),
                absl::StrCat(*out), help, [out](int64_t x) { *out = static_cast<int>(x); });
}

FlagSet& FlagSet::Uint64(std::string_view name, uint64_t* out, std::string_view help) {
  const std::string n(name);
  Add(name, "N", help, absl::StrCat(*out), [out, n](std::string_view v) {
    const std::string s(v);
    char* end = nullptr;
    errno = 0;
    const unsigned long long x = std::strtoull(s.c_str(), &end, 10);
    if (s.empty() || s[0] == '-' || s[0] == '+' || end == s.c_str() || *end != '\0' ||
        errno == ERANGE)
      return MustBe(n, "an integer in [0, 2^64)", v);
    *out = x;
    return absl::OkStatus();
  });
  return *this;
}

FlagSet& FlagSet::Double(std::string_view name, double* out, std::string_view help,
                         std::function<bool(double)> ok, std::string what) {
  const std::string n(name);
  Add(name, "X", help, absl::StrCat(*out),
      [out, n, ok = std::move(ok), what = std::move(what)](std::string_view v) {
        const std::string s(v);
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end == s.c_str() || *end != '\0' || (ok && !ok(x)))
          return MustBe(n, what, v);
        *out = x;
        return absl::OkStatus();
      });
  return *this;
}

FlagSet& FlagSet::String(std::string_view name, std::string* out, std::string_view value_name,
                         std::string_view help) {
  Add(name, std::string(value_name), help, *out, [out](std::string_view v) {
    *out = std::string(v);
    return absl::OkStatus();
  });
  return *this;
}

FlagSet& FlagSet::Strings(std::string_view name, std::vector<std::string>* out,
                          std::string_view value_name, std::string_view help) {
  Add(name, std::string(value_name), absl::StrCat(std::string(help), " (repeatable)"), "",
      [out](std::string_view v) {
        out->emplace_back(v);
        return absl::OkStatus();
      });
  return *this;
}

FlagSet& FlagSet::AddEnum(std::string_view name, std::vector<std::string> words,
                          std::function<void(size_t)> store, std::string shown_default,
                          std::string_view help) {
  const std::string n(name);
  const std::string value_name = absl::StrJoin(words, "|");
  Add(name, value_name, help, std::move(shown_default),
      [n, words = std::move(words), store = std::move(store)](std::string_view v) {
        for (size_t i = 0; i < words.size(); ++i) {
          if (words[i] == v) {
            store(i);
            return absl::OkStatus();
          }
        }
        return MustBe(n, Either(words), v);
      });
  return *this;
}

FlagSet& FlagSet::Choice(std::string_view name, std::string* out, std::vector<std::string> choices,
                         std::string_view help) {
  return AddEnum(
      name, choices, [out, choices](size_t i) { *out = choices[i]; }, *out, help);
}

FlagSet& FlagSet::Custom(std::string_view name, std::string_view value_name, std::string_view help,
                         std::function<absl::Status(std::string_view)> set,
                         std::string shown_default) {
  const std::string n(name);
  Add(name, std::string(value_name), help, std::move(shown_default),
      [n, set = std::move(set)](std::string_view v) -> absl::Status {
        absl::Status st = set(v);
        if (st.ok()) return st;
        return absl::Status(st.code(), absl::StrCat("--", n, ": ", st.message()));
      });
  return *this;
}

FlagSet& FlagSet::Alias(std::string_view spelling) {
  flags_.back()->aliases.emplace_back(spelling);
  return *this;
}

FlagSet::Flag* FlagSet::Find(std::string_view spelling, bool* negated) {
  *negated = false;
  for (const auto& f : flags_) {
    if (spelling.size() == f->name.size() + 2 && spelling.substr(0, 2) == "--" &&
        spelling.substr(2) == f->name)
      return f.get();
    for (const std::string& a : f->aliases)
      if (a == spelling) return f.get();
  }
  // --no-NAME for a boolean NAME.
  if (spelling.substr(0, 5) == "--no-") {
    for (const auto& f : flags_) {
      if (f->value_name.empty() && spelling.substr(5) == f->name) {
        *negated = true;
        return f.get();
      }
    }
  }
  return nullptr;
}

absl::Status UnexpectedArgument(std::string_view arg) {
  return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", std::string(arg),
                                                 "\" (boolean flags take --flag=false)"));
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args,
                            std::vector<std::string>* positional) {
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") {
      help_requested_ = true;
      return absl::OkStatus();
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 2 || a[0] != '-') {
      if (positional == nullptr) return UnexpectedArgument(a);
      positional->push_back(a);
      continue;
    }
    const size_t eq = a.find('=');
    const std::string spelling = a.substr(0, eq);
    bool negated = false;
    Flag* f = Find(spelling, &negated);
    if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag ", spelling));
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else if (f->value_name.empty()) {
      value = "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat(spelling, " needs a value"));
    }
    if (negated) {
      // --no-NAME=true is NAME off; --no-NAME=false is NAME on.
      const std::optional<bool> b = ParseBool(value);
      if (!b)
        return absl::InvalidArgumentError(
            absl::StrCat(spelling, " is true or false, got \"", value, "\""));
      value = *b ? "false" : "true";
    }
    if (absl::Status st = f->set(value); !st.ok()) return st;
    f->seen = true;
  }
  return absl::OkStatus();
}

std::optional<int> FlagSet::ParseOrExit(const std::vector<std::string>& args,
                                        std::vector<std::string>* positional,
                                        const std::function<absl::Status()>& check) {
  absl::Status st = Parse(args, positional);
  if (st.ok() && help_requested_) {
    std::fputs(Usage().c_str(), stdout);
    return 0;
  }
  if (st.ok() && check) st = check();
  if (st.ok()) return std::nullopt;
  std::fprintf(stderr, "%s: %s\n", program_.c_str(), std::string(st.message()).c_str());
  return 2;
}

std::optional<int> FlagSet::ParseOrExit(int argc, char** argv,
                                        const std::function<absl::Status()>& check) {
  return ParseOrExit(std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + argc), nullptr,
                     check);
}

bool FlagSet::seen(std::string_view name) const {
  for (const auto& f : flags_)
    if (f->name == name) return f->seen;
  return false;
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: ", program_, " ", synopsis_, "\n");
  if (!about_.empty()) absl::StrAppend(&out, about_, about_.back() == '\n' ? "" : "\n");
  // Groups in the order they were first used.
  std::vector<std::string> groups;
  for (const auto& f : flags_)
    if (std::find(groups.begin(), groups.end(), f->group) == groups.end())
      groups.push_back(f->group);
  for (const std::string& g : groups) {
    absl::StrAppend(&out, "\n", g.empty() ? "flags" : g, ":\n");
    for (const auto& f : flags_) {
      if (f->group != g) continue;
      std::string head = f->value_name.empty() ? absl::StrCat("--[no-]", f->name)
                                               : absl::StrCat("--", f->name, " ", f->value_name);
      for (const std::string& a : f->aliases) absl::StrAppend(&head, ", ", a);
      absl::StrAppend(&out, "  ", head, "\n      ", f->help);
      if (!f->shown_default.empty()) absl::StrAppend(&out, " (default ", f->shown_default, ")");
      absl::StrAppend(&out, "\n");
    }
  }
  return out;
}

}  // namespace hmoe
