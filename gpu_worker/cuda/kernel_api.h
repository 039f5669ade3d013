// The launcher interface every CUDA kernel family of the backend follows (one
// header per family: elementwise_kernels.h, paged_attention_kernels.h, ...).
// GPU-only: public headers never include these.
//
// Every launcher takes device pointers, sizes and a stream (last), enqueues its
// work, allocates nothing, and returns the launch's cudaGetLastError() (or
// cudaErrorInvalidValue for arguments it cannot run). Zero-size work (T = 0,
// n = 0, ...) is a no-op returning cudaSuccess. Shapes are validated one layer
// up. bf16 values are uint16_t bit patterns: bf16 -> f32 is bits << 16, f32 ->
// bf16 rounds to nearest even and keeps NaN a (quiet) NaN. All math is fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_quant.h"

namespace hmoe::cuda {

// A paged KV cache's storage for the cache writers (common/kv_quant.h's
// encodings): rows of `row` elements of type `elem`, row i at data + i * row
// elements. kFp8: `scale` holds `parts` f32 per row, element e of a row
// belonging to part min(e / part_len, parts - 1); otherwise scale is unused.
struct KvRows {
  void* data = nullptr;
  float* scale = nullptr;
  KvElem elem = KvElem::kF32;
  int64_t row = 0;
  int64_t part_len = 0;
  int64_t parts = 1;
};

}  // namespace hmoe::cuda
