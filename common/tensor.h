// Tensor: a typed, shaped view of memory that may own it (heap buffer) or
// share ownership of a file mapping. Copying a Tensor copies the view, not the data.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/dtype.h"

namespace hmoe {

using Shape = std::vector<int64_t>;

std::string ShapeString(absl::Span<const int64_t> shape);  // "[2, 3]"
int64_t NumElements(absl::Span<const int64_t> shape);

class Tensor {
 public:
  Tensor() = default;
  // A view of `data` (not owned unless `owner` keeps it alive). Strides are
  // in elements; empty strides mean row-major contiguous.
  Tensor(DType dtype, Shape shape, void* data, std::shared_ptr<const void> owner = nullptr,
         std::vector<int64_t> strides = {});

  // Zero-filled, 64-byte-aligned, owning.
  static Tensor Empty(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[static_cast<size_t>(i < 0 ? i + rank() : i)]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const { return NumElements(shape_); }
  int64_t nbytes() const { return DTypeBytes(dtype_, numel()); }
  bool contiguous() const;
  bool empty() const { return data_ == nullptr; }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

  // Contiguous copy converted to f32 (f32, bf16, f16, fp8, int types).
  std::vector<float> ToF32() const;

 private:
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::vector<int64_t> strides_;
  void* data_ = nullptr;
  std::shared_ptr<const void> owner_;
};

}  // namespace hmoe
