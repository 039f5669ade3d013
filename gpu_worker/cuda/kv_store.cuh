// Device reads and writes of the paged KV cache in its stored element type
// (KvRows, kernel_api.h; encodings: common/kv_quant.h). Included by .cu files
// only, after common.cuh.
#pragma once

#include <cstdint>

#include "common/kv_quant.h"
#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {
namespace {

// Part of element e of a row (kFp8's scale index within the row); rows are
// far shorter than 2^31 elements.
__device__ __forceinline__ int64_t KvPart(int64_t e, int64_t part_len, int64_t parts) {
  return min(static_cast<int>(e) / static_cast<int>(part_len), static_cast<int>(parts) - 1);
}

// Stores src[0, c.row) (f32, any memory space) as cache row `slot` of c.
// Every thread of the block calls it; src must be fully written before.
__device__ void StoreKvRow(const float* src, const KvRows& c, int64_t slot) {
  if (c.elem == KvElem::kF32) {
    float* dst = static_cast<float*>(c.data) + slot * c.row;
    for (int64_t i = threadIdx.x; i < c.row; i += blockDim.x) dst[i] = src[i];
  } else if (c.elem == KvElem::kBf16) {
    uint16_t* dst = static_cast<uint16_t*>(c.data) + slot * c.row;
    for (int64_t i = threadIdx.x; i < c.row; i += blockDim.x) dst[i] = KvToBf16(src[i]);
  } else {
    uint8_t* dst = static_cast<uint8_t*>(c.data) + slot * c.row;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t p = warp; p < c.parts; p += nw) {  // a warp per part
      const int64_t lo = p * c.part_len, hi = p == c.parts - 1 ? c.row : lo + c.part_len;
      float amax = 0.0f;
      for (int64_t i = lo + lane; i < hi; i += 32) amax = fmaxf(amax, fabsf(src[i]));
      amax = WarpMax(amax);
      const float scale = KvFp8Scale(amax);
      if (lane == 0) c.scale[slot * c.parts + p] = scale;
      for (int64_t i = lo + lane; i < hi; i += 32) dst[i] = KvFp8Code(src[i], scale);
    }
  }
}

// Element e of cache row `row` as f32 (the stored value, decoded).
template <KvElem E>
__device__ __forceinline__ float KvLoad(const void* data, const float* scale, int64_t row_len,
                                        int64_t part_len, int64_t parts, int64_t row, int64_t e) {
  const int64_t i = row * row_len + e;
  if constexpr (E == KvElem::kF32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (E == KvElem::kBf16) {
    return KvFromBf16(static_cast<const uint16_t*>(data)[i]);
  } else {
    return KvFp8Value(static_cast<const uint8_t*>(data)[i],
                      scale[row * parts + KvPart(e, part_len, parts)]);
  }
}

// Elements e .. e + 3 of cache row `row` as f32; e and the row's start must
// be 4-element aligned (for kFp8, part_len a multiple of 4 too).
template <KvElem E>
__device__ __forceinline__ float4 KvLoad4(const void* data, const float* scale, int64_t row_len,
                                          int64_t part_len, int64_t parts, int64_t row, int64_t e) {
  const int64_t i = row * row_len + e;
  if constexpr (E == KvElem::kF32) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(data) + i);
  } else if constexpr (E == KvElem::kBf16) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(data) + i);
    return make_float4(KvFromBf16(static_cast<uint16_t>(u.x & 0xffffu)),
                       KvFromBf16(static_cast<uint16_t>(u.x >> 16)),
                       KvFromBf16(static_cast<uint16_t>(u.y & 0xffffu)),
                       KvFromBf16(static_cast<uint16_t>(u.y >> 16)));
  } else {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(data) + i);
    const float s = scale[row * parts + KvPart(e, part_len, parts)];
    return make_float4(KvFp8Value(static_cast<uint8_t>(u & 0xffu), s),
                       KvFp8Value(static_cast<uint8_t>((u >> 8) & 0xffu), s),
                       KvFp8Value(static_cast<uint8_t>((u >> 16) & 0xffu), s),
                       KvFp8Value(static_cast<uint8_t>(u >> 24), s));
  }
}

}  // namespace
}  // namespace hmoe::cuda
