// Payload buffers and fragment reassembly for the UCX data plane (no UCX
// here): a pool of reusable aligned buffers, and an Assembly that lands a
// payload's fragments, in any order, each exactly once, into one of them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace hmoe {

// Reusable payload buffers. A 1024-token call moves 44 MB each way round;
// fresh allocations of that size are mmap'd, zero-filled and page-faulted on
// every call (measured over TCP loopback, T=1024: 48 -> 22 ms a call with
// the pool and no copies past UCX's own and the caller's).
// Buffers are 64-byte aligned, not zeroed, and keep their pages when they
// come back. Thread-safe: buffers are taken on callers' threads and the
// progress thread and come back on either.
class BufferPool {
 public:
  // At most `max_free` buffers wait for reuse; more are freed on return.
  explicit BufferPool(size_t max_free) : max_free_(max_free) {}
  ~BufferPool();

  class Bytes {
   public:
    Bytes() = default;
    Bytes(Bytes&& o) noexcept { *this = std::move(o); }
    Bytes& operator=(Bytes&& o) noexcept {
      if (this != &o) {
        Release();
        pool_ = std::move(o.pool_);
        p_ = std::exchange(o.p_, nullptr);
        size_ = std::exchange(o.size_, 0);
        capacity_ = std::exchange(o.capacity_, 0);
      }
      return *this;
    }
    ~Bytes() { Release(); }
    uint8_t* data() const { return p_; }
    size_t size() const { return size_; }
    // Shrinks the visible size (capacity unchanged); n <= size().
    void Truncate(size_t n) { size_ = std::min(n, size_); }

   private:
    friend class BufferPool;
    void Release() {
      if (p_ != nullptr) pool_->Put(p_, capacity_);
      p_ = nullptr;
      pool_.reset();
    }
    std::shared_ptr<BufferPool> pool_;
    uint8_t* p_ = nullptr;
    size_t size_ = 0, capacity_ = 0;
  };

  // A buffer of n bytes (never null, even for n = 0): the smallest free one
  // that holds n, else a new one.
  static Bytes Get(const std::shared_ptr<BufferPool>& pool, size_t n);
  // Buffers waiting for reuse (tests).
  size_t free_buffers() const;

 private:
  void Put(uint8_t* p, size_t capacity);

  const size_t max_free_;
  mutable std::mutex mu_;
  std::vector<std::pair<size_t, uint8_t*>> free_;
};
using Bytes = BufferPool::Bytes;

// Fragments are at least this long (or the whole payload), so a payload of
// the largest accepted size has a bounded number of them.
constexpr uint64_t kMinFragmentBytes = 64 << 10;

// One payload arriving as fragments of frag_bytes (the last one shorter), in
// any order, each into its place in one pooled buffer: complete once every
// fragment has landed exactly once. Shared by the map that finds it and the
// receives in flight into it (its buffer outlives a dropped entry).
// Thread-safe: with several UCX lanes its fragments are claimed and land on
// several progress threads at once. Take() only after Landed() said true.
class Assembly {
 public:
  // frag_bytes 0 (or over total): one message. INVALID_ARGUMENT when it is
  // under kMinFragmentBytes and cuts the payload.
  static absl::StatusOr<std::shared_ptr<Assembly>> Start(const std::shared_ptr<BufferPool>& pool,
                                                         uint64_t total, uint64_t frag_bytes) {
    if (frag_bytes == 0 || frag_bytes >= total) {
      frag_bytes = std::max<uint64_t>(total, 1);  // one message
    } else if (frag_bytes < kMinFragmentBytes) {
      return absl::InvalidArgumentError(absl::StrCat("fragment size ", frag_bytes, " for a ", total,
                                                     "-byte payload (at least ", kMinFragmentBytes,
                                                     " or the whole payload)"));
    }
    auto a = std::make_shared<Assembly>();
    a->buf_ = BufferPool::Get(pool, total);
    a->frag_bytes_ = frag_bytes;
    const uint64_t n = total == 0 ? 1 : (total + frag_bytes - 1) / frag_bytes;
    a->claimed_.assign(n, false);
    a->missing_.store(n, std::memory_order_relaxed);
    a->started_ = absl::Now();
    return a;
  }

  // Where the fragment at `offset` of `len` bytes goes; INVALID_ARGUMENT if
  // it is not one of this payload's fragments or it came before.
  absl::StatusOr<uint8_t*> Claim(uint64_t offset, uint64_t len) {
    const uint64_t total = buf_.size();
    const uint64_t i = offset / frag_bytes_;
    if (offset % frag_bytes_ != 0 || i >= claimed_.size() ||
        len != std::min(frag_bytes_, total - offset)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fragment of ", len, " bytes at offset ", offset, " of a ", total,
                       "-byte payload cut every ", frag_bytes_, " bytes"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (claimed_[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("fragment at offset ", offset, " of the payload sent twice"));
    }
    claimed_[i] = true;
    return buf_.data() + offset;
  }

  // A claimed fragment's transfer ended (ok: its bytes are in place). True
  // once the last fragment has ended; ok() then says whether all arrived.
  bool Landed(bool ok) {
    if (!ok) failed_.store(true, std::memory_order_relaxed);
    // acq_rel: the last lander sees every other lander's bytes and verdict.
    return missing_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  }
  bool ok() const { return !failed_.load(std::memory_order_relaxed); }
  absl::Time started() const { return started_; }
  // The payload's bytes: a landed fragment's may be read while others are
  // still arriving. Null after Take().
  const uint8_t* data() const { return buf_.data(); }
  Bytes Take() { return std::move(buf_); }

 private:
  Bytes buf_;
  uint64_t frag_bytes_ = 0;
  std::mutex mu_;
  std::vector<bool> claimed_;  // mu_
  std::atomic<uint64_t> missing_{0};
  std::atomic<bool> failed_{false};
  absl::Time started_;
};

// INVALID_ARGUMENT unless fragment_bytes is 0 (one message) or >= kMinFragmentBytes.
absl::Status CheckFragmentBytes(uint64_t fragment_bytes);

}  // namespace hmoe
