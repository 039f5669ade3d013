#include "common/tensor.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "absl/strings/str_join.h"

namespace hmoe {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return "[" + absl::StrJoin(shape, ", ") + "]";
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor::Tensor(DType dtype, Shape shape, void* data, std::shared_ptr<const void> owner,
               std::vector<int64_t> strides)
    : dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      data_(data),
      owner_(std::move(owner)) {
  if (strides_.empty()) {
    strides_.assign(shape_.size(), 1);
    for (int i = static_cast<int>(shape_.size()) - 2; i >= 0; --i)
      strides_[static_cast<size_t>(i)] =
          strides_[static_cast<size_t>(i) + 1] * shape_[static_cast<size_t>(i) + 1];
  }
}

Tensor Tensor::Empty(DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(DTypeBytes(dtype, NumElements(shape)));
  const size_t rounded = (bytes + 63) / 64 * 64 + 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  std::shared_ptr<const void> owner(p, [](const void* q) { std::free(const_cast<void*>(q)); });
  return Tensor(dtype, std::move(shape), p, std::move(owner));
}

bool Tensor::contiguous() const {
  int64_t expect = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (shape_[static_cast<size_t>(i)] != 1 && strides_[static_cast<size_t>(i)] != expect)
      return false;
    expect *= shape_[static_cast<size_t>(i)];
  }
  return true;
}

std::vector<float> Tensor::ToF32() const {
  const int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  // Walk elements in row-major logical order, honoring strides.
  std::vector<int64_t> idx(shape_.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (size_t d = 0; d < shape_.size(); ++d) off += idx[d] * strides_[d];
    const char* base = static_cast<const char*>(data_);
    float v = 0.0f;
    switch (dtype_) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, base + off * 4, 4);
        v = f;
        break;
      }
      case DType::kF64: {
        double f;
        std::memcpy(&f, base + off * 8, 8);
        // Past float's range is +-inf (as numpy casts), not undefined.
        v = std::isnan(f) || std::fabs(f) <= std::numeric_limits<float>::max()
                ? static_cast<float>(f)
                : (f > 0 ? std::numeric_limits<float>::infinity()
                         : -std::numeric_limits<float>::infinity());
        break;
      }
      case DType::kBF16: {
        uint16_t h;
        std::memcpy(&h, base + off * 2, 2);
        v = Bf16ToF32(h);
        break;
      }
      case DType::kF16: {
        uint16_t h;
        std::memcpy(&h, base + off * 2, 2);
        v = F16ToF32(h);
        break;
      }
      case DType::kF8E4M3:
        v = Fp8E4M3ToF32(static_cast<uint8_t>(base[off]));
        break;
      case DType::kF8E5M2:
        v = Fp8E5M2ToF32(static_cast<uint8_t>(base[off]));
        break;
      case DType::kF8E8M0:
        v = E8M0ToF32(static_cast<uint8_t>(base[off]));
        break;
      case DType::kI64: {
        int64_t x;
        std::memcpy(&x, base + off * 8, 8);
        v = static_cast<float>(x);
        break;
      }
      case DType::kI32: {
        int32_t x;
        std::memcpy(&x, base + off * 4, 4);
        v = static_cast<float>(x);
        break;
      }
      case DType::kI16: {
        int16_t x;
        std::memcpy(&x, base + off * 2, 2);
        v = x;
        break;
      }
      case DType::kI8:
        v = static_cast<int8_t>(base[off]);
        break;
      case DType::kU8:
      case DType::kBool:
        v = static_cast<uint8_t>(base[off]);
        break;
      case DType::kU16: {
        uint16_t x;
        std::memcpy(&x, base + off * 2, 2);
        v = x;
        break;
      }
      case DType::kU32: {
        uint32_t x;
        std::memcpy(&x, base + off * 4, 4);
        v = static_cast<float>(x);
        break;
      }
      case DType::kU64: {
        uint64_t x;
        std::memcpy(&x, base + off * 8, 8);
        v = static_cast<float>(x);
        break;
      }
      case DType::kI4:
        v = UnpackI4(reinterpret_cast<const uint8_t*>(base), off);
        break;
    }
    out[static_cast<size_t>(i)] = v;
    for (int d = rank() - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < shape_[static_cast<size_t>(d)]) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  return out;
}

}  // namespace hmoe
