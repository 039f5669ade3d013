// Multi-head latent attention (MLA) kernels: the latent cache write, query
// absorption and output expansion. Launcher conventions:
// gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// MLA cache write: for t < T with slot[t] >= 0 (negative slots are skipped),
// row = cache + slot[t] * (r + rope): row[0, r) = RmsNorm(kva[t*(r+rope), +r),
// norm_w, eps); row[r, r + rope) = kva's rope part rotated with cs[t*rope, +rope).
cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          float* cache, cudaStream_t s);
// The same into a cache of any element type (cache.row == r + rope; kFp8
// parts as the caller lays them out, MLA's: the latent and the rope part),
// each row rounded as StoreKvRow does (common/kv_quant.h).
cudaError_t WriteMlaCache(const float* kva, int64_t T, int64_t r, int64_t rope, const float* norm_w,
                          float eps, const float* cs, bool interleaved, const int32_t* slot,
                          const KvRows& cache, cudaStream_t s);

// MLA query absorption, qk = nope + rope, out [T, nh, r + rope]:
//   out[t, h, c] = sum_{j<nope} q[t*nh*qk + h*qk + j] * wkv[(h*(nope+vd) + j)*r + c], c < r;
//   out[t, h, r + i] = q[t, h, nope + i], i < rope (copied; roped later).
// wkv is bf16 [nh*(nope+vd), r] (kv_b_proj's weight). Each weight element is
// read once per call for T <= 32.
cudaError_t MlaAbsorbQuery(const float* q, const uint16_t* wkv, int64_t T, int64_t nh, int64_t nope,
                           int64_t rope, int64_t vd, int64_t r, float* out, cudaStream_t s);

// MLA output expansion:
//   out[t*nh*vd + h*vd + d] = sum_{c<r} wkv[(h*(nope+vd) + nope + d)*r + c] * olat[t*nh*r + h*r +
//   c].
// out_bf16 (nullable) also gets bf16(out); out may be nullptr if only out_bf16
// is wanted.
cudaError_t MlaExpandOutput(const float* olat, const uint16_t* wkv, int64_t T, int64_t nh,
                            int64_t nope, int64_t vd, int64_t r, float* out, uint16_t* out_bf16,
                            cudaStream_t s);

}  // namespace hmoe::cuda
