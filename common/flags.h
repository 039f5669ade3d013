// Command-line flags, the one way every binary and `hmoe` subcommand parses
// them: a FlagSet object (no globals) on which a main registers typed flags,
// each bound to a field of its options struct, with help text; the field's
// value at registration is the default --help shows.
//
// Spellings: --name=value and --name value (a value flag takes the next
// argument whatever it is, so `--timeout -5` is -5); a boolean flag alone is
// on, --name=true|1 / --name=false|0 set it, and --no-NAME (alone or =true|1)
// turns it off (a flag registered as "no-shm" is itself --no-shm). A flag
// given twice keeps the last value, except repeatable ones, which append.
// -h / --help anywhere asks for the usage. Anything not starting with '-'
// (and "-" itself) is positional.
//
// Errors are INVALID_ARGUMENT naming the flag and the value:
//   --max-batch must be an integer in [1, 4096], got 0
//   --backend must be cpu, cuda or auto, got gpu
//   --ids is true or false, got "2"
//   unknown flag --bogus;  --listen needs a value
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace hmoe {

class FlagSet {
 public:
  // `program` starts the usage and every error a main prints ("hmoe-gpu-worker",
  // "hmoe generate"); `synopsis` follows it on the usage line ("--model DIR
  // [flags]"), `about` is printed after that line.
  FlagSet(std::string program, std::string synopsis, std::string about = "");
  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;
  ~FlagSet();

  // Flags registered after this are listed under `title` in the usage.
  void Group(std::string title);

  // `name` is the long name without the dashes ("max-batch"); `help` one or
  // more sentences. Each returns the set, for chaining Alias.
  FlagSet& Bool(std::string_view name, bool* out, std::string_view help);
  // An integer in [lo, hi] (for an int field, [lo, hi] within int's range).
  FlagSet& Int(std::string_view name, int64_t* out, int64_t lo, int64_t hi, std::string_view help);
  FlagSet& Int(std::string_view name, int* out, int64_t lo, int64_t hi, std::string_view help);
  FlagSet& Uint64(std::string_view name, uint64_t* out, std::string_view help);
  // A number (strtod's syntax, whole argument); `ok` (default: any) limits
  // it, `what` says to what in errors ("a number of GiB > 0").
  FlagSet& Double(std::string_view name, double* out, std::string_view help,
                  std::function<bool(double)> ok = nullptr, std::string what = "a number");
  // `value_name` stands for the value in the usage ("PATH", "HOST:PORT").
  FlagSet& String(std::string_view name, std::string* out, std::string_view value_name,
                  std::string_view help);
  // Repeatable: each use appends.
  FlagSet& Strings(std::string_view name, std::vector<std::string>* out,
                   std::string_view value_name, std::string_view help);
  // One of `choices` (exact words), mapped to the value stored.
  template <typename T>
  FlagSet& Enum(std::string_view name, T* out, std::vector<std::pair<std::string, T>> choices,
                std::string_view help);
  FlagSet& Choice(std::string_view name, std::string* out, std::vector<std::string> choices,
                  std::string_view help);
  // Any other syntax: `set` parses the value (its error is reported as
  // "--name: <message>"); `shown_default` is what --help says ("" none).
  FlagSet& Custom(std::string_view name, std::string_view value_name, std::string_view help,
                  std::function<absl::Status(std::string_view)> set,
                  std::string shown_default = "");

  // Another spelling of the flag registered last, with its dashes ("-p").
  FlagSet& Alias(std::string_view spelling);

  // Parses `args` (no program name) into the bound fields, left to right.
  // Positional arguments go to `positional`; with nullptr each is an error
  // (UnexpectedArgument). On -h / --help nothing is parsed and
  // help_requested() turns true.
  absl::Status Parse(const std::vector<std::string>& args,
                     std::vector<std::string>* positional = nullptr);

  // For a main: Parse, then `check` (the checks across flags; may be null).
  // --help prints Usage() to stdout and gives 0; an error prints
  // "PROGRAM: message" to stderr and gives 2; nullopt: carry on.
  std::optional<int> ParseOrExit(const std::vector<std::string>& args,
                                 std::vector<std::string>* positional = nullptr,
                                 const std::function<absl::Status()>& check = nullptr);
  std::optional<int> ParseOrExit(int argc, char** argv,
                                 const std::function<absl::Status()>& check = nullptr);

  bool help_requested() const { return help_requested_; }
  // Whether `name` (no dashes) was given on the command line.
  bool seen(std::string_view name) const;
  const std::string& program() const { return program_; }

  // The generated usage: the synopsis, `about`, then each group's flags
  // with value, help and default.
  std::string Usage() const;

 private:
  struct Flag;
  Flag& Add(std::string_view name, std::string value_name, std::string_view help,
            std::string shown_default, std::function<absl::Status(std::string_view)> set);
  FlagSet& AddInt(std::string_view name, int64_t lo, int64_t hi, std::string shown,
                  std::string_view help, std::function<void(int64_t)> store);
  FlagSet& AddEnum(std::string_view name, std::vector<std::string> words,
                   std::function<void(size_t)> store, std::string shown_default,
                   std::string_view help);
  Flag* Find(std::string_view spelling, bool* negated);

  std::string program_, synopsis_, about_, group_;
  std::vector<std::unique_ptr<Flag>> flags_;
  bool help_requested_ = false;
};

// INVALID_ARGUMENT for a positional argument a command does not take.
absl::Status UnexpectedArgument(std::string_view arg);

template <typename T>
FlagSet& FlagSet::Enum(std::string_view name, T* out,
                       std::vector<std::pair<std::string, T>> choices, std::string_view help) {
  std::vector<std::string> words;
  std::string shown;
  for (const auto& [word, value] : choices) {
    words.push_back(word);
    if (shown.empty() && value == *out) shown = word;
  }
  return AddEnum(
      name, std::move(words),
      [out, choices = std::move(choices)](size_t i) { *out = choices[i].second; }, shown, help);
}

}  // namespace hmoe
