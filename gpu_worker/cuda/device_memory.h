// Device and pinned host memory owned by RAII buffers, the --gpu-mem-gb
// accounting, and the CUDA / cuBLAS error helpers of the CUDA backend's
// files. Internal to gpu_worker/cuda/ (includes CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hmoe::cuda {

// Out of device memory is RESOURCE_EXHAUSTED saying so; any other error
// INTERNAL.
inline absl::Status CudaError(cudaError_t e, const char* what) {
  if (e == cudaErrorMemoryAllocation)
    return absl::ResourceExhaustedError(
        absl::StrCat("CUDA ", what, ": out of GPU memory (", cudaGetErrorString(e), ")"));
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(e)));
}
inline absl::Status CublasError(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_ALLOC_FAILED)
    return absl::ResourceExhaustedError(
        absl::StrCat("cuBLAS ", what, ": out of GPU memory (", cublasGetStatusString(s), ")"));
  return absl::InternalError(absl::StrCat("cuBLAS ", what, ": ", cublasGetStatusString(s)));
}
#define HMOE_CUDA_TRY(expr, what)                                \
  do {                                                           \
    cudaError_t hmoe_e_ = (expr);                                \
    if (hmoe_e_ != cudaSuccess) return CudaError(hmoe_e_, what); \
  } while (0)
#define HMOE_CUBLAS_TRY(expr, what)                                          \
  do {                                                                       \
    cublasStatus_t hmoe_s_ = (expr);                                         \
    if (hmoe_s_ != CUBLAS_STATUS_SUCCESS) return CublasError(hmoe_s_, what); \
  } while (0)

inline std::string Gib(double bytes) {
  return absl::StrFormat("%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
}

// Device memory accounting against the --gpu-mem-gb bound.
class Budget {
 public:
  explicit Budget(int64_t limit) : limit_(limit) {}
  absl::Status Take(int64_t bytes, const std::string& what) {
    if (used_ + bytes > limit_)
      return absl::ResourceExhaustedError(
          absl::StrCat(what, " needs ", Gib(static_cast<double>(bytes)), " of GPU memory; ",
                       Gib(static_cast<double>(used_)), " is in use (", Describe(),
                       ") and the bound is ", Gib(static_cast<double>(limit_))));
    used_ += bytes;
    parts_[what] += bytes;
    return absl::OkStatus();
  }
  void Give(int64_t bytes, const std::string& what) {
    used_ -= bytes;
    parts_[what] -= bytes;
  }
  int64_t used() const { return used_; }
  int64_t limit() const { return limit_; }
  std::string Describe() const {
    std::string s;
    for (const auto& [k, v] : parts_)
      if (v > 0) absl::StrAppend(&s, s.empty() ? "" : ", ", k, " ", Gib(static_cast<double>(v)));
    return s.empty() ? "nothing" : s;
  }

 private:
  int64_t limit_;
  int64_t used_ = 0;
  std::map<std::string, int64_t> parts_;
};

// An owned device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  absl::Status Allocate(int64_t bytes) {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
    if (bytes == 0) return absl::OkStatus();
    HMOE_CUDA_TRY(cudaMalloc(&p_, static_cast<size_t>(bytes)), "cudaMalloc");
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  int64_t bytes_ = 0;
};

// Pinned host memory.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  absl::Status Allocate(int64_t bytes) {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    if (bytes == 0) return absl::OkStatus();
    HMOE_CUDA_TRY(cudaMallocHost(&p_, static_cast<size_t>(bytes)), "cudaMallocHost");
    return absl::OkStatus();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

}  // namespace hmoe::cuda
