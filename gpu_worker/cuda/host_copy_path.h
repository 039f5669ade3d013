// The host copy path (expert_call_path.h): no slots. The driver calls the
// routed experts itself with the pass's host copies (Route, AddExperts).
// Internal to gpu_worker/cuda/.
#pragma once

#include "gpu_worker/cuda/expert_call_path.h"

namespace hmoe::cuda {

class HostCopyPath final : public ExpertCallPath {
 public:
  const char* name() const override { return "host copy"; }
  const char* description() const override { return "host copies"; }
  bool uses_slots() const override { return false; }
};

}  // namespace hmoe::cuda
