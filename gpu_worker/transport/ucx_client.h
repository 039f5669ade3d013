// The UCX data plane's worker end (the protocol: common/transport/ucx_wire.h).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/moe_call.h"
#include "common/transport/ucx_wire.h"

namespace hmoe {

class ControlClient;

struct UcxClientOptions {
  int spin_us = 50;  // progress busily this long before sleeping on the worker's event fd
  // Wait spins this long for the answer before it sleeps (0: sleeps at
  // once). Saves a futex wake on small calls where cores are spare.
  int wait_spin_us = 0;
  // Requests over this go out in fragments of it (>= 64 KiB; 0: one message).
  uint64_t fragment_bytes = kDefaultUcxFragmentBytes;
  // UCP workers with their progress threads (1..kMaxUcxLanes); the calls use
  // min(this, the service's lanes).
  int lanes = kDefaultUcxLanes;
};

class UcxClient : public MoeClient {
 public:
  static absl::StatusOr<std::unique_ptr<UcxClient>> Create(std::shared_ptr<ControlClient> control,
                                                           const ShardInfo& info,
                                                           const UcxClientOptions& opts = {});
  ~UcxClient() override;
  absl::StatusOr<uint64_t> Submit(const MoeCall& call, float* out, absl::Time deadline) override;
  absl::Status Wait(uint64_t handle, absl::Time deadline) override;
  const char* transport() const override { return "ucx"; }
  // Lanes the current connection uses (0 while not connected).
  int lanes() const;
  // Fault injection: the client's endpoint on `lane` fails as if UCX had
  // reported an error on it (on that lane's thread).
  void FailLaneForTesting(int lane);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hmoe