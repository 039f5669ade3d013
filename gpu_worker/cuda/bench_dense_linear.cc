// hmoe-bench-dense-linear: the dense linear kernels (gpu_worker/cuda/
// dense_linear_kernels.h) on DeepSeek-V3's dense shapes at T = 1, 8, 32
// tokens: per format (fp8 128x128 blocks, int8 per row, int4 group 128; bf16
// by cuBLAS beside), the time per call, the weight bytes read per second
// (codes + scales) and that as a share of the device-to-device copy
// bandwidth measured in the same run (bytes read + written per second).
// Each timed call reads a different copy of the matrix (at least 256 MiB of
// copies, so that no call finds its weights in L2). Codes are random (fp8
// without NaN), scales constant: the kernels' speed does not depend on them.
//
// Usage: hmoe-bench-dense-linear [--iters N] [--only NAME]  (GPU only)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/experts/format_codes.h"
#include "gpu_worker/cuda/dense_linear_kernels.h"

namespace hmoe::cuda {
namespace {

#define BENCH_CUDA(x)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Shape {
  const char* name;
  int64_t rows, cols;  // out x in
};
// DeepSeek-V3 (hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 128 heads).
constexpr Shape kShapes[] = {
    {"q_a", 1536, 7168},
    {"q_b", 24576, 1536},
    {"kv_a", 576, 7168},
    {"o", 7168, 16384},
    {"shared gate|up", 2048, 7168},
    {"shared down", 7168, 2048},
    {"dense gate|up", 18432, 7168},
    {"dense down", 7168, 18432},
    {"lm_head", 129280, 7168},
};

uint64_t Next(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

// Device-to-device copy bandwidth: 2 x bytes per second over a 1 GiB copy.
double CopyBandwidth(cudaStream_t st) {
  const size_t n = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  BENCH_CUDA(cudaMalloc(&a, n));
  BENCH_CUDA(cudaMalloc(&b, n));
  BENCH_CUDA(cudaMemsetAsync(a, 1, n, st));
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < 2; ++i) BENCH_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st));
  const int reps = 10;
  BENCH_CUDA(cudaEventRecord(e0, st));
  for (int i = 0; i < reps; ++i)
    BENCH_CUDA(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, n, cudaMemcpyDeviceToDevice, st));
  BENCH_CUDA(cudaEventRecord(e1, st));
  BENCH_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * static_cast<double>(n) * reps / (ms * 1e-3);
}

// Weight bytes of one matrix: codes and scales (bf16: 2 bytes a weight).
int64_t CodeBytes(WeightFormat f, const Shape& s) {
  return f == WeightFormat::kBf16 ? 2 * s.rows * s.cols
                                  : s.rows * ((s.cols * Traits(f).bits + 7) / 8);
}
int64_t ScaleCount(WeightFormat f, int group, const Shape& s) {
  return ScaleRows(f, group, s.rows) * ScalesPerRow(f, group, s.cols);
}

int Main(int argc, char** argv) {
  int iters = 20;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--only SHAPE]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t st;
  BENCH_CUDA(cudaStreamCreate(&st));
  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(blas, st);
  const double copy = CopyBandwidth(st);
  std::printf("device: %s; device-to-device copy %.1f GB/s (read + write)\n", prop.name,
              copy / 1e9);
  std::printf("%-15s %-13s %-5s %3s %10s %9s %8s\n", "matrix", "rows x cols", "fmt", "T", "us/call",
              "GB/s", "% copy");
  struct Fmt {
    WeightFormat f;
    int group;
  };
  const Fmt fmts[] = {{WeightFormat::kBf16, 0},
                      {WeightFormat::kFp8, 128},
                      {WeightFormat::kInt8, 0},
                      {WeightFormat::kInt4, 128}};
  uint64_t seed = 88172645463325252ull;
  for (const Shape& s : kShapes) {
    if (!only.empty() && only != s.name) continue;
    for (const Fmt& f : fmts) {
      const int64_t cb = CodeBytes(f.f, s), sc = ScaleCount(f.f, f.group, s);
      const int64_t bytes = cb + 4 * sc;
      const int copies = static_cast<int>(std::max<int64_t>(1, ((256 << 20) + bytes - 1) / bytes));
      std::vector<uint8_t> host(static_cast<size_t>(cb));
      for (size_t i = 0; i + 8 <= host.size(); i += 8) {
        const uint64_t v = Next(seed);
        std::memcpy(&host[i], &v, 8);
      }
      if (f.f == WeightFormat::kFp8)
        for (uint8_t& b : host)
          if ((b & 0x7f) == 0x7f) b ^= 1;  // no NaN codes
      if (f.f == WeightFormat::kBf16)      // finite bf16 in [-2, 2]
        for (size_t i = 1; i < host.size(); i += 2) host[i] = (host[i] & 0x80) | 0x3f;
      std::vector<void*> w(static_cast<size_t>(copies));
      std::vector<float*> scale(static_cast<size_t>(copies), nullptr);
      const std::vector<float> hs(static_cast<size_t>(sc), 1e-3f);
      for (int c = 0; c < copies; ++c) {
        BENCH_CUDA(cudaMalloc(&w[static_cast<size_t>(c)], static_cast<size_t>(cb)));
        BENCH_CUDA(cudaMemcpy(w[static_cast<size_t>(c)], host.data(), static_cast<size_t>(cb),
                              cudaMemcpyHostToDevice));
        if (sc > 0) {
          BENCH_CUDA(cudaMalloc(&scale[static_cast<size_t>(c)], static_cast<size_t>(4 * sc)));
          BENCH_CUDA(cudaMemcpy(scale[static_cast<size_t>(c)], hs.data(),
                                static_cast<size_t>(4 * sc), cudaMemcpyHostToDevice));
        }
      }
      for (int64_t T : {1, 8, 32}) {
        uint16_t* x = nullptr;
        float* y = nullptr;
        BENCH_CUDA(cudaMalloc(&x, static_cast<size_t>(T * s.cols * 2)));
        BENCH_CUDA(cudaMemsetAsync(x, 0x3c, static_cast<size_t>(T * s.cols * 2), st));
        BENCH_CUDA(cudaMalloc(&y, static_cast<size_t>(T * s.rows * 4)));
        auto call = [&](int c) {
          if (f.f == WeightFormat::kBf16) {
            const float one = 1.0f, zero = 0.0f;
            cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.rows),
                         static_cast<int>(T), static_cast<int>(s.cols), &one,
                         w[static_cast<size_t>(c)], CUDA_R_16BF, static_cast<int>(s.cols), x,
                         CUDA_R_16BF, static_cast<int>(s.cols), &zero, y, CUDA_R_32F,
                         static_cast<int>(s.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            return;
          }
          const DevQuantMatrix m{f.f,
                                 f.group,
                                 s.rows,
                                 s.cols,
                                 w[static_cast<size_t>(c)],
                                 scale[static_cast<size_t>(c)]};
          BENCH_CUDA(DenseGemv(m, x, T, y, s.rows, st));
        };
        for (int c = 0; c < copies; ++c) call(c);  // warm-up
        cudaEvent_t e0, e1;
        BENCH_CUDA(cudaEventCreate(&e0));
        BENCH_CUDA(cudaEventCreate(&e1));
        BENCH_CUDA(cudaEventRecord(e0, st));
        for (int i = 0; i < iters; ++i) call(i % copies);
        BENCH_CUDA(cudaEventRecord(e1, st));
        BENCH_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        const double sec = ms * 1e-3 / iters, gbs = static_cast<double>(bytes) / sec;
        std::printf("%-15s %6lldx%-6lld %-5s %3lld %10.1f %9.1f %7.1f%%\n", s.name,
                    static_cast<long long>(s.rows), static_cast<long long>(s.cols),
                    Traits(f.f).name, static_cast<long long>(T), sec * 1e6, gbs / 1e9,
                    100.0 * gbs / copy);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaFree(x);
        cudaFree(y);
      }
      for (int c = 0; c < copies; ++c) {
        cudaFree(w[static_cast<size_t>(c)]);
        if (scale[static_cast<size_t>(c)] != nullptr) cudaFree(scale[static_cast<size_t>(c)]);
      }
    }
  }
  cublasDestroy(blas);
  cudaStreamDestroy(st);
  return 0;
}

}  // namespace
}  // namespace hmoe::cuda

int main(int argc, char** argv) { return hmoe::cuda::Main(argc, argv); }
