// Expert calls through host-mapped slot words: the device's wait for the
// host and the one-kernel send of a call. Launcher conventions:
// gpu_worker/cuda/kernel_api.h.
#pragma once

#include "gpu_worker/cuda/kernel_api.h"

namespace hmoe::cuda {

// A wait for the host without a host node (one thread): spins until *word
// leaves [busy_lo, busy_hi] or *abort != 0, or timeout_ns have passed (then
// sets *abort = 1, so the pass's later waits end at once); then a system
// fence, so the host data the word guards is read after it. *wait_ns (if not
// null) += the nanoseconds waited. word, abort and wait_ns are device
// pointers to mapped host memory (or device memory). busy_lo <= busy_hi.
cudaError_t WaitHostWord(const uint32_t* word, uint32_t busy_lo, uint32_t busy_hi, uint32_t* abort,
                         uint64_t timeout_ns, unsigned long long* wait_ns, cudaStream_t s);

// An expert call sent to the host in one kernel: copies hidden (bf16 [T, H])
// and ids / weights ([T, k]) into a slot's request regions (device pointers
// to mapped host memory), then, once every block's writes are fenced at
// system scope, the last block stores `request` into *state (release,
// system scope) if *armed != 0 and *abort == 0 (abort may be null: never). *counter is a device
// word, 0 between calls (the last block resets it); calls on one stream may share it. dst_ids,
// dst_weights and state are 4-byte aligned (hidden rows are copied 16 bytes at a time when both
// sides are 16-byte aligned).
cudaError_t SendExpertCall(const uint16_t* hidden, int64_t T, int64_t H, const int32_t* ids,
                           const float* weights, int64_t k, uint16_t* dst_hidden, int32_t* dst_ids,
                           float* dst_weights, uint32_t* state, uint32_t request,
                           const uint32_t* armed, const uint32_t* abort, unsigned int* counter,
                           cudaStream_t s);

}  // namespace hmoe::cuda
