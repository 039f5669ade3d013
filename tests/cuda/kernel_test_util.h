// Helpers of the CUDA kernel tests (tests/cuda/*_kernels_test.cc): device
// buffers, host bf16 conversions, error measures and the GPU skip.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_worker/cuda/device_status.h"

namespace hmoe::cuda {

#define SKIP_WITHOUT_GPU() \
  if (std::string why; !hmoe::cuda::CudaDeviceUsable(&why)) GTEST_SKIP() << why

// Device memory for n values of T, freed on destruction.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0 && cudaMalloc(&p_, n_ * sizeof(T)) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << n_ * sizeof(T) << " bytes failed";
      p_ = nullptr;
    }
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { Upload(v); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    if (n_ > 0) {
      ASSERT_EQ(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    if (n_ > 0) {
      const cudaError_t e = cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
      EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    }
    return v;
  }

 private:
  size_t n_ = 0;
  T* p_ = nullptr;
};

// Checks a launch and waits for it.
inline void Check(cudaError_t launch) {
  ASSERT_EQ(launch, cudaSuccess) << cudaGetErrorString(launch);
  const cudaError_t e = cudaDeviceSynchronize();
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}

inline std::vector<float> Random(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline uint16_t HostBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float HostBf16ToF(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::vector<uint16_t> v(n);
  std::uniform_real_distribution<float> d(lo, hi);
  for (uint16_t& x : v) x = HostBf16(d(rng));
  return v;
}

inline double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? num / den : num;
}

// Distance in bf16 steps (sign-magnitude order).
inline int Bf16Ulps(uint16_t a, uint16_t b) {
  const auto ord = [](uint16_t v) {
    return (v & 0x8000) != 0 ? -static_cast<int>(v & 0x7fff) : static_cast<int>(v);
  };
  return std::abs(ord(a) - ord(b));
}

// got (bf16) within 1 step of bf16(want), or within atol of want, everywhere.
inline void ExpectBf16Near(const std::vector<uint16_t>& got, const std::vector<float>& want,
                           const std::string& what, double atol = 0.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = Bf16Ulps(got[i], HostBf16(want[i]));
    if (d > 1 && std::fabs(double{HostBf16ToF(got[i])} - want[i]) <= atol) continue;
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, 1) << what << ": at " << at << " got " << HostBf16ToF(got[at]) << " want "
                      << want[at];
}

inline constexpr double kNmse = 1e-5;

// RopeCosSin rows [T, dim] for positions: cs[2i] = cos(p f_i) af, cs[2i+1] = sin(p f_i) af,
// f_i = 10000^(-2i/dim).
inline std::vector<float> CosSinRows(const std::vector<int64_t>& pos, int64_t dim, float af) {
  std::vector<float> cs(pos.size() * dim);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float f = static_cast<float>(std::pow(10000.0, -2.0 * i / dim));
      const float a = static_cast<float>(pos[t]) * f;
      cs[t * dim + 2 * i] = std::cos(a) * af;
      cs[t * dim + 2 * i + 1] = std::sin(a) * af;
    }
  return cs;
}

}  // namespace hmoe::cuda
