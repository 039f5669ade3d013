// CUDA kernels behind gpu_worker/cuda/expert_call_kernels.h. Layout notes live with each
// kernel; contracts live in the header.
#include <cstdint>

#include "gpu_worker/cuda/common.cuh"
#include "gpu_worker/cuda/expert_call_kernels.h"

namespace hmoe::cuda {
namespace {

__device__ uint64_t GlobalNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Grid-stride copies (16-byte vectors for the hidden rows when aligned),
// each thread's writes fenced, then the last block to finish sends.
__global__ void SendExpertCallKernel(const uint16_t* hidden, int64_t hidden_elems, bool vec16,
                                     const int32_t* ids, const float* weights, int64_t tk,
                                     uint16_t* dst_hidden, int32_t* dst_ids, float* dst_weights,
                                     uint32_t* state, uint32_t request, const uint32_t* armed,
                                     const uint32_t* abort, unsigned int* counter) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (vec16) {
    const int64_t n = hidden_elems / 8;
    const uint4* src = reinterpret_cast<const uint4*>(hidden);
    uint4* dst = reinterpret_cast<uint4*>(dst_hidden);
    for (int64_t i = tid; i < n; i += stride) dst[i] = src[i];
  } else {
    for (int64_t i = tid; i < hidden_elems; i += stride) dst_hidden[i] = hidden[i];
  }
  for (int64_t i = tid; i < tk; i += stride) {
    dst_ids[i] = ids[i];
    dst_weights[i] = weights[i];
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(counter, 1u) != gridDim.x - 1) return;
  __threadfence_system();
  if (LoadAcquireSys(armed) != 0 && (abort == nullptr || LoadAcquireSys(abort) == 0))
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(state), "r"(request) : "memory");
  *reinterpret_cast<volatile unsigned int*>(counter) = 0;
}

__global__ void WaitHostWordKernel(const uint32_t* word, uint32_t lo, uint32_t hi, uint32_t* abort,
                                   uint64_t timeout_ns, unsigned long long* wait_ns) {
  const uint64_t t0 = GlobalNs();
  for (;;) {
    const uint32_t v = LoadAcquireSys(word);
    if (v < lo || v > hi) break;
    if (LoadAcquireSys(abort) != 0) break;
    if (GlobalNs() - t0 >= timeout_ns) {
      *reinterpret_cast<volatile uint32_t*>(abort) = 1;
      break;
    }
    __nanosleep(100);
  }
  __threadfence_system();
  if (wait_ns != nullptr)
    *reinterpret_cast<volatile unsigned long long*>(wait_ns) += GlobalNs() - t0;
}

}  // namespace

cudaError_t WaitHostWord(const uint32_t* word, uint32_t busy_lo, uint32_t busy_hi, uint32_t* abort,
                         uint64_t timeout_ns, unsigned long long* wait_ns, cudaStream_t s) {
  if (word == nullptr || abort == nullptr || busy_lo > busy_hi) return cudaErrorInvalidValue;
  WaitHostWordKernel<<<1, 1, 0, s>>>(word, busy_lo, busy_hi, abort, timeout_ns, wait_ns);
  return cudaGetLastError();
}

cudaError_t SendExpertCall(const uint16_t* hidden, int64_t T, int64_t H, const int32_t* ids,
                           const float* weights, int64_t k, uint16_t* dst_hidden, int32_t* dst_ids,
                           float* dst_weights, uint32_t* state, uint32_t request,
                           const uint32_t* armed, const uint32_t* abort, unsigned int* counter,
                           cudaStream_t s) {
  if (T < 0 || H <= 0 || k <= 0 || state == nullptr || armed == nullptr || counter == nullptr)
    return cudaErrorInvalidValue;
  const int64_t elems = T * H, tk = T * k;
  const bool vec16 = elems % 8 == 0 && reinterpret_cast<uintptr_t>(hidden) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst_hidden) % 16 == 0;
  // About 16 KiB of request per block, at most 64 blocks.
  const int64_t bytes = elems * 2 + tk * 8;
  const unsigned blocks =
      static_cast<unsigned>(std::clamp<int64_t>((bytes + 16383) / 16384, 1, 64));
  SendExpertCallKernel<<<blocks, kThreads, 0, s>>>(hidden, elems, vec16, ids, weights, tk,
                                                   dst_hidden, dst_ids, dst_weights, state, request,
                                                   armed, abort, counter);
  return cudaGetLastError();
}

}  // namespace hmoe::cuda
