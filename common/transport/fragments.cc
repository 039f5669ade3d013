#include "common/transport/fragments.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"

namespace hmoe {

BufferPool::~BufferPool() {
  for (auto& [cap, p] : free_) std::free(p);
}

BufferPool::Bytes BufferPool::Get(const std::shared_ptr<BufferPool>& pool, size_t n) {
  Bytes b;
  b.pool_ = pool;
  b.size_ = n;
  {
    std::lock_guard<std::mutex> lock(pool->mu_);
    auto best = pool->free_.end();
    for (auto it = pool->free_.begin(); it != pool->free_.end(); ++it) {
      if (it->first >= n && (best == pool->free_.end() || it->first < best->first)) best = it;
    }
    if (best != pool->free_.end()) {
      b.capacity_ = best->first;
      b.p_ = best->second;
      pool->free_.erase(best);
      return b;
    }
  }
  b.capacity_ = (std::max<size_t>(n, 1) + 63) / 64 * 64;
  b.p_ = static_cast<uint8_t*>(std::aligned_alloc(64, b.capacity_));
  if (b.p_ == nullptr) throw std::bad_alloc();
  return b;
}

size_t BufferPool::free_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

void BufferPool::Put(uint8_t* p, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < max_free_) {
    free_.emplace_back(capacity, p);
    return;
  }
  // Full: keep the larger buffers (the next large call reuses them).
  auto smallest = std::min_element(free_.begin(), free_.end());
  if (smallest != free_.end() && smallest->first < capacity) {
    std::free(smallest->second);
    *smallest = {capacity, p};
  } else {
    std::free(p);
  }
}

absl::Status CheckFragmentBytes(uint64_t fragment_bytes) {
  if (fragment_bytes != 0 && fragment_bytes < kMinFragmentBytes) {
    return absl::InvalidArgumentError(absl::StrCat("UCX fragment size ", fragment_bytes,
                                                   ": 0 (no fragments) or at least ",
                                                   kMinFragmentBytes));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
