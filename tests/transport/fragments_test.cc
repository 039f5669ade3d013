// BufferPool and Assembly (common/transport/fragments.h): the UCX data
// plane's reusable buffers and fragment reassembly.
#include "common/transport/fragments.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace hmoe {
namespace {

TEST(BufferPool, AlignedNeverNullAndReusedWithItsPages) {
  auto pool = std::make_shared<BufferPool>(2);
  uint8_t* first;
  {
    BufferPool::Bytes empty = BufferPool::Get(pool, 0);
    EXPECT_NE(empty.data(), nullptr);
    EXPECT_EQ(empty.size(), 0u);
    BufferPool::Bytes b = BufferPool::Get(pool, 1000);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    EXPECT_EQ(b.size(), 1000u);
    first = b.data();
    b.Truncate(10);
    EXPECT_EQ(b.size(), 10u);
    b.Truncate(20);  // never grows
    EXPECT_EQ(b.size(), 10u);
  }
  EXPECT_EQ(pool->free_buffers(), 2u);
  // The smallest free buffer that holds the request comes back.
  BufferPool::Bytes again = BufferPool::Get(pool, 900);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(again.size(), 900u);
  BufferPool::Bytes bigger = BufferPool::Get(pool, 5000);
  EXPECT_NE(bigger.data(), first);
  // Moves hand the buffer over; it goes back once.
  BufferPool::Bytes moved = std::move(bigger);
  EXPECT_EQ(bigger.data(), nullptr);
  EXPECT_EQ(moved.size(), 5000u);
}

TEST(BufferPool, AFullPoolKeepsItsLargestBuffers) {
  auto pool = std::make_shared<BufferPool>(1);
  uint8_t* large_p;
  {
    BufferPool::Bytes small = BufferPool::Get(pool, 100);
    BufferPool::Bytes large = BufferPool::Get(pool, 1 << 20);
    large_p = large.data();
  }  // large back first, then small (freed: the pool is full of a larger one)
  EXPECT_EQ(pool->free_buffers(), 1u);
  BufferPool::Bytes b = BufferPool::Get(pool, 64);
  EXPECT_EQ(b.data(), large_p);
}

TEST(BufferPool, BuffersOutliveTheirPoolsOwner) {
  auto pool = std::make_shared<BufferPool>(2);
  BufferPool::Bytes b = BufferPool::Get(pool, 64);
  pool.reset();  // the buffer's own reference keeps the pool
  std::memset(b.data(), 1, 64);
}

std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + i / 251);
  return v;
}

TEST(Assembly, FragmentsInAnyOrderLandInPlace) {
  auto pool = std::make_shared<BufferPool>(4);
  const uint64_t frag = kMinFragmentBytes;
  for (const uint64_t total : {uint64_t{0}, uint64_t{1}, frag - 1, frag, frag + 1, 5 * frag + 77}) {
    SCOPED_TRACE(total);
    const std::vector<uint8_t> want = Pattern(total);
    auto a = Assembly::Start(pool, total, frag);
    ASSERT_TRUE(a.ok()) << a.status();
    const uint64_t n = total == 0 ? 1 : (total + frag - 1) / frag;
    // Last fragment first, then the others backwards.
    for (uint64_t k = 0; k < n; ++k) {
      const uint64_t i = n - 1 - k;
      const uint64_t off = i * frag, len = std::min(frag, total - off);
      auto dst = (*a)->Claim(off, len);
      ASSERT_TRUE(dst.ok()) << dst.status();
      if (len) std::memcpy(*dst, want.data() + off, len);
      EXPECT_EQ((*a)->Landed(true), k + 1 == n);
    }
    EXPECT_TRUE((*a)->ok());
    BufferPool::Bytes got = (*a)->Take();
    ASSERT_EQ(got.size(), total);
    if (total > 0) {
      EXPECT_EQ(std::memcmp(got.data(), want.data(), total), 0);
    }
  }
}

// Lanes: one payload's fragments claimed and landed from several threads
// at once (some twice, refused): each lands once, exactly one landing
// completes the payload, and the bytes are all in place.
TEST(Assembly, FragmentsFromSeveralThreadsAtOnce) {
  auto pool = std::make_shared<BufferPool>(4);
  const uint64_t frag = kMinFragmentBytes, n = 64, total = n * frag - 123;
  const std::vector<uint8_t> want = Pattern(total);
  for (int round = 0; round < 20; ++round) {
    auto a = Assembly::Start(pool, total, frag);
    ASSERT_TRUE(a.ok()) << a.status();
    std::atomic<int> completions{0}, refused{0};
    std::vector<std::thread> threads;
    for (uint64_t t = 0; t < 4; ++t) {
      // Thread t takes fragments t, t + 4, ... and then its neighbour's
      // first one: whichever of the two comes second is refused.
      threads.emplace_back([&, t] {
        std::vector<uint64_t> mine;
        for (uint64_t i = t; i < n; i += 4) mine.push_back(i);
        mine.push_back((t + 1) % 4);
        for (const uint64_t i : mine) {
          const uint64_t off = i * frag, len = std::min(frag, total - off);
          auto dst = (*a)->Claim(off, len);
          if (!dst.ok()) {
            ++refused;
            continue;
          }
          std::memcpy(*dst, want.data() + off, len);
          if ((*a)->Landed(true)) ++completions;
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(completions.load(), 1);
    EXPECT_EQ(refused.load(), 4);
    EXPECT_TRUE((*a)->ok());
    BufferPool::Bytes got = (*a)->Take();
    ASSERT_EQ(got.size(), total);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), total), 0) << "round " << round;
  }
}

TEST(Assembly, ZeroOrOversizedFragmentMeansOneMessage) {
  auto pool = std::make_shared<BufferPool>(4);
  for (const uint64_t frag : {uint64_t{0}, uint64_t{1} << 30}) {
    auto a = Assembly::Start(pool, 3000, frag);
    ASSERT_TRUE(a.ok());
    EXPECT_FALSE((*a)->Claim(0, 2999).ok());  // the whole payload or nothing
    auto dst = (*a)->Claim(0, 3000);
    ASSERT_TRUE(dst.ok());
    EXPECT_TRUE((*a)->Landed(true));
  }
}

TEST(Assembly, RefusesWhatIsNotOneOfItsFragmentsOrCameBefore) {
  auto pool = std::make_shared<BufferPool>(4);
  const uint64_t frag = kMinFragmentBytes, total = 3 * frag + 10;
  auto a = Assembly::Start(pool, total, frag);
  ASSERT_TRUE(a.ok());
  Assembly& as = **a;
  EXPECT_EQ(as.Claim(1, frag).status().code(), absl::StatusCode::kInvalidArgument);  // unaligned
  EXPECT_EQ(as.Claim(frag, frag - 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(as.Claim(3 * frag, frag).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(as.Claim(4 * frag, 0).status().code(), absl::StatusCode::kInvalidArgument);  // past
  EXPECT_EQ(as.Claim(UINT64_MAX / frag * frag, 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(as.Claim(3 * frag, 10).ok());
  const absl::Status twice = as.Claim(3 * frag, 10).status();
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("twice"), std::string::npos) << twice;
  // A failed transfer: complete, not ok.
  EXPECT_FALSE(as.Landed(false));
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(as.Claim(i * frag, frag).ok());
  EXPECT_FALSE(as.Landed(true));
  EXPECT_FALSE(as.Landed(true));
  EXPECT_TRUE(as.Landed(true));
  EXPECT_FALSE(as.ok());
}

TEST(Assembly, FragmentsUnderTheMinimumAreRefused) {
  auto pool = std::make_shared<BufferPool>(4);
  auto a = Assembly::Start(pool, 10 * kMinFragmentBytes, kMinFragmentBytes - 1);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  // ... unless the payload fits in one.
  EXPECT_TRUE(Assembly::Start(pool, 100, 200).ok());
  EXPECT_TRUE(Assembly::Start(pool, 100, 100).ok());
  EXPECT_TRUE(CheckFragmentBytes(0).ok());
  EXPECT_TRUE(CheckFragmentBytes(kMinFragmentBytes).ok());
  EXPECT_EQ(CheckFragmentBytes(1000).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hmoe
