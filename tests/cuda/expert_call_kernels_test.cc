// The expert-call kernels (gpu_worker/cuda/expert_call_kernels.h): the device's wait on a host word
// and the one-kernel send of a call, against a plain CPU reference (hmoe::cpu ops where one exists,
// a scalar loop here otherwise), on many shapes, odd ones included. Skips without a usable CUDA
// device.
#include "gpu_worker/cuda/expert_call_kernels.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/transport/moe_call.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

// The device-side wait on a word in mapped host memory: ends when a host
// thread moves the word out of the busy range (not before), when the abort
// word is set, or at the timeout (which then sets abort); the data the host
// wrote before the word is what the stream reads after the wait.
TEST(GpuKernelTest, WaitHostWord) {
  SKIP_WITHOUT_GPU();
  struct Shared {
    uint32_t word, abort, pad[2];
    unsigned long long waited;
    float data[64];
  };
  Shared* h = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&h), sizeof(Shared), cudaHostAllocMapped),
            cudaSuccess);
  Shared* d = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), h, 0), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  DeviceBuffer<float> got(64);
  auto reset = [&](uint32_t word) {
    std::memset(static_cast<void*>(h), 0, sizeof(Shared));
    reinterpret_cast<std::atomic<uint32_t>*>(&h->word)->store(word);
  };
  // 1. Released by the host after 20 ms: the wait takes about that long,
  // and the copy after it sees what the host wrote before the release.
  for (uint32_t done_value : {0u, 3u}) {
    reset(2);
    ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(got.get(), h->data, sizeof(h->data), cudaMemcpyHostToDevice, s),
              cudaSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the wait ended while the word was busy";
    for (int i = 0; i < 64; ++i) h->data[i] = static_cast<float>(i) + 0.5f;
    reinterpret_cast<std::atomic<uint32_t>*>(&h->word)->store(done_value);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::vector<float> v = got.Download();
    for (int i = 0; i < 64; ++i) ASSERT_EQ(v[i], static_cast<float>(i) + 0.5f) << i;
    EXPECT_GE(h->waited, 15'000'000ull);
    EXPECT_LT(h->waited, 5'000'000'000ull);
    EXPECT_EQ(h->abort, 0u);
  }
  // 2. A word outside the busy range: no wait at all.
  reset(0);
  Check(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s));
  EXPECT_LT(h->waited, 100'000'000ull);
  // 3. Abort set by the host ends the wait; the word stays busy.
  reset(1);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, nullptr, s), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  reinterpret_cast<std::atomic<uint32_t>*>(&h->abort)->store(1);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  // 4. The timeout ends it and sets abort; a second wait then ends at once.
  reset(2);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 30'000'000ull, &d->waited, s), cudaSuccess);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(h->abort, 1u);
  EXPECT_GE(h->waited, 25'000'000ull);
  EXPECT_LT(h->waited, 2'000'000'000ull);
  EXPECT_EQ(WaitHostWord(nullptr, 1, 2, &d->abort, 1, nullptr, s), cudaErrorInvalidValue);
  EXPECT_EQ(WaitHostWord(&d->word, 3, 2, &d->abort, 1, nullptr, s), cudaErrorInvalidValue);
  cudaStreamDestroy(s);
  cudaFreeHost(h);
}

// SendExpertCall: the request lands in mapped host memory exactly (odd and
// large shapes: one block and many, vector and scalar copies), the state
// word is set only when armed, and the block counter is back at 0.
TEST(GpuKernelTest, SendExpertCall) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  DeviceBuffer<unsigned int> counter(std::vector<unsigned int>{0});
  for (int64_t T : {1, 3, 33}) {
    for (int64_t H : {7, 8, 2048, 7168}) {
      for (int64_t k : {1, 8}) {
        SCOPED_TRACE(::testing::Message() << "T " << T << " H " << H << " k " << k);
        std::vector<uint16_t> hid(static_cast<size_t>(T * H));
        for (auto& v : hid) v = static_cast<uint16_t>(rng());
        std::vector<int32_t> ids(static_cast<size_t>(T * k));
        for (auto& v : ids) v = static_cast<int32_t>(rng() % 1000);
        const std::vector<float> w = Random(static_cast<size_t>(T * k), rng);
        DeviceBuffer<uint16_t> dh(hid);
        DeviceBuffer<int32_t> di(ids);
        DeviceBuffer<float> dw(w);
        // Host side: hidden | ids | weights | state, armed; 64-aligned as in
        // a slot, with a spare byte after the hidden rows.
        auto align64 = [](size_t n) { return (n + 63) / 64 * 64; };
        const size_t hb = align64(hid.size() * 2 + 1), ib = align64(ids.size() * 4);
        uint8_t* host = nullptr;
        const size_t total = hb + 2 * ib + 64;
        ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), total, cudaHostAllocMapped),
                  cudaSuccess);
        uint8_t* dev = nullptr;
        ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
        for (uint32_t armed : {0u, 1u}) {
          std::memset(host, 0xff, total);
          auto* state = reinterpret_cast<uint32_t*>(host + hb + 2 * ib);
          state[0] = 0;
          state[1] = armed;
          Check(SendExpertCall(
              dh.get(), T, H, di.get(), dw.get(), k, reinterpret_cast<uint16_t*>(dev),
              reinterpret_cast<int32_t*>(dev + hb), reinterpret_cast<float*>(dev + hb + ib),
              reinterpret_cast<uint32_t*>(dev + hb + 2 * ib), 5,
              reinterpret_cast<uint32_t*>(dev + hb + 2 * ib) + 1, nullptr, counter.get(), s));
          ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
          EXPECT_EQ(std::memcmp(host, hid.data(), hid.size() * 2), 0);
          EXPECT_EQ(std::memcmp(host + hb, ids.data(), ids.size() * 4), 0);
          EXPECT_EQ(std::memcmp(host + hb + ib, w.data(), w.size() * 4), 0);
          EXPECT_EQ(host[hid.size() * 2], 0xff) << "wrote past the hidden rows";
          EXPECT_EQ(state[0], armed ? 5u : 0u);
          EXPECT_EQ(counter.Download()[0], 0u);
        }
        cudaFreeHost(host);
      }
    }
  }
  // An aborted pass sends nothing more, armed or not.
  {
    uint32_t* host = nullptr;
    ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), 4096, cudaHostAllocMapped),
              cudaSuccess);
    uint32_t* dev = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
    std::memset(host, 0, 4096);
    host[1] = 1;  // armed
    host[2] = 1;  // aborted
    DeviceBuffer<uint16_t> dh(std::vector<uint16_t>(8, 1));
    DeviceBuffer<int32_t> di(std::vector<int32_t>{3});
    DeviceBuffer<float> dw(std::vector<float>{0.5f});
    Check(SendExpertCall(dh.get(), 1, 8, di.get(), dw.get(), 1,
                         reinterpret_cast<uint16_t*>(dev + 64),
                         reinterpret_cast<int32_t*>(dev + 128), reinterpret_cast<float*>(dev + 192),
                         dev, 5, dev + 1, dev + 2, counter.get(), s));
    EXPECT_EQ(host[0], 0u) << "sent although aborted";
    host[2] = 0;
    Check(SendExpertCall(dh.get(), 1, 8, di.get(), dw.get(), 1,
                         reinterpret_cast<uint16_t*>(dev + 64),
                         reinterpret_cast<int32_t*>(dev + 128), reinterpret_cast<float*>(dev + 192),
                         dev, 5, dev + 1, dev + 2, counter.get(), s));
    EXPECT_EQ(host[0], 5u);
    cudaFreeHost(host);
  }
  EXPECT_EQ(SendExpertCall(nullptr, 1, 8, nullptr, nullptr, 1, nullptr, nullptr, nullptr, nullptr,
                           1, nullptr, nullptr, counter.get(), s),
            cudaErrorInvalidValue);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace hmoe::cuda
