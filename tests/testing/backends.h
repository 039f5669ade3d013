// The model backends the model and engine tests run on: every test suite
// parameterized by BackendName() runs once per backend; a backend this build
// or machine cannot run skips with the reason (cuda without nvcc or a GPU).
#pragma once

#include <string>
#include <vector>

#include "gpu_worker/model.h"
#include "gtest/gtest.h"

namespace hmoe::testing {

// hmoe-tests-cuda compiles these suites again for its cuda instances alone
// (tests/CMakeLists.txt: HMOE_TEST_BACKENDS_CUDA_ONLY).
inline std::vector<std::string> TestBackends() {
#ifdef HMOE_TEST_BACKENDS_CUDA_ONLY
  return {"cuda"};
#else
  return {"cpu", "cuda"};
#endif
}

// Empty when `backend` runs here, else why not.
inline std::string BackendUnavailable(const std::string& backend) {
  auto r = ResolveBackend(backend);
  return r.ok() ? std::string() : std::string(r.status().message());
}

// For INSTANTIATE_TEST_SUITE_P's name generator.
struct BackendParamName {
  std::string operator()(const ::testing::TestParamInfo<std::string>& info) const {
    return info.param;
  }
};

}  // namespace hmoe::testing

// Skips the running test when `backend` cannot run here.
#define HMOE_SKIP_UNLESS_BACKEND(backend)                                                 \
  do {                                                                                    \
    const std::string hmoe_why_ = ::hmoe::testing::BackendUnavailable(backend);           \
    if (!hmoe_why_.empty()) GTEST_SKIP() << "backend " << (backend) << ": " << hmoe_why_; \
  } while (0)
