// Sets an environment variable for one scope and restores the old value (or
// its absence) on exit. Tests only: setenv is not thread-safe, so use it
// where no other thread reads the environment.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace hmoe::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace hmoe::testing
