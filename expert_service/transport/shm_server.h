// The shared-memory data plane's service end (the layout and protocol:
// common/transport/shm_layout.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/transport/moe_call.h"
#include "common/transport/shm_layout.h"

namespace hmoe {

// Service side: one thread per attached segment.
class ShmServer {
 public:
  static constexpr size_t kDefaultMaxSessions = 1024;
  // Serves at most `max_sessions` segments at once (segments of dead clients
  // are dropped first).
  explicit ShmServer(MoeHandler* handler, size_t max_sessions = kDefaultMaxSessions);
  ~ShmServer();
  // Maps `path` (/proc/<client_pid>/fd/<n>: the client's memfd on tmpfs,
  // sealed with F_SEAL_SHRINK, whose header carries `nonce`; INVALID_ARGUMENT
  // otherwise), checks its header, starts serving it; returns the epoch
  // written into it. The nonce guards against a stale attach finding a newer
  // segment under a reused fd number. A segment already served:
  // ALREADY_EXISTS; max_sessions segments served: RESOURCE_EXHAUSTED.
  absl::StatusOr<uint64_t> Attach(const std::string& path, int64_t client_pid, uint64_t nonce);
  uint64_t sessions() const;
  uint64_t discarded() const { return discarded_.load(); }

 private:
  struct Session;
  void Serve(Session* s);
  MoeHandler* handler_;
  const size_t max_sessions_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::unique_ptr<Session>> sessions_;
  std::atomic<uint64_t> next_epoch_;
  std::atomic<uint64_t> discarded_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace hmoe
