// Helpers shared by the libFuzzer targets (tests/fuzz/README.md).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace hmoe::fuzz {

// Takes bytes off the front of a fuzz input.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  template <class T>
  T Take() {
    T v{};
    const size_t k = n_ < sizeof(T) ? n_ : sizeof(T);
    if (k > 0) std::memcpy(&v, p_, k);
    p_ += k;
    n_ -= k;
    return v;
  }
  std::string Rest() {
    std::string s(reinterpret_cast<const char*>(p_), n_);
    p_ += n_;
    n_ = 0;
    return s;
  }
  const uint8_t* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  const uint8_t* p_;
  size_t n_;
};

// A fixture under the source tree (tests/fixtures/...), at the path the
// build was configured from.
inline std::string Fixture(const std::string& rel) {
  return std::string(HMOE_SOURCE_DIR) + "/tests/fixtures/" + rel;
}

}  // namespace hmoe::fuzz
