// ModelOptions::kv_dtype on the CUDA backend: each KV dtype against the
// reference backend with the same dtype (both round identically,
// common/kv_quant.h), over several KV blocks; the pool's size follows the
// dtype's bytes. Skips without a usable CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_worker/model.h"
#include "tests/model/model_test_util.h"
#include "tests/testing/backends.h"

namespace hmoe {
namespace {

using testing::ArgMax;
using testing::LoadReference;
using testing::ModelFixturesRoot;

std::unique_ptr<Model> Load(const std::string& name, const std::string& backend, KvDtype kv,
                            ModelOptions opt = {}) {
  opt.backend = backend;
  opt.num_threads = 2;
  opt.kv_dtype = kv;
  auto m = Model::Load(ModelFixturesRoot() + "/" + name, opt);
  if (!m.ok()) return nullptr;
  return std::move(*m);
}

// sum (a - b)^2 / sum b^2
double Nmse(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return a.size() != b.size() ? INFINITY : den > 0 ? num / den : num;
}

class CudaVsCpuKv : public ::testing::TestWithParam<std::tuple<std::string, KvDtype>> {
 protected:
  void SetUp() override { HMOE_SKIP_UNLESS_BACKEND("cuda"); }
};

// A 40-token prompt and 24 decode steps (64 positions: four 16-token blocks).
TEST_P(CudaVsCpuKv, LogitsAgreeWithTheSameKvDtype) {
  const auto& [name, kv] = GetParam();
  auto cpu = Load(name, "cpu", kv);
  auto gpu = Load(name, "cuda", kv);
  ASSERT_TRUE(cpu && gpu);
  EXPECT_EQ(gpu->options().kv_dtype, kv);
  const auto ref = LoadReference(ModelFixturesRoot() + "/" + name);
  ASSERT_FALSE(ref.prompt.empty());
  std::vector<int32_t> prompt;
  while (prompt.size() < 40) prompt.push_back(ref.prompt[prompt.size() % ref.prompt.size()]);
  const int64_t V = cpu->config().vocab_size;
  auto sc = cpu->NewSequence();
  auto sg = gpu->NewSequence();
  auto lc = cpu->Prefill(*sc, prompt, LogitsMode::kLast);
  auto lg = gpu->Prefill(*sg, prompt, LogitsMode::kLast);
  ASSERT_TRUE(lc.ok() && lg.ok()) << lc.status() << " " << lg.status();
  double worst = Nmse(*lg, *lc);
  int agree = ArgMax(lg->data(), V) == ArgMax(lc->data(), V);
  for (int i = 0; i < 24; ++i) {  // both on the cpu's tokens
    const int32_t t = static_cast<int32_t>(ArgMax(lc->data(), V));
    lc = cpu->Decode(*sc, t);
    lg = gpu->Decode(*sg, t);
    ASSERT_TRUE(lc.ok() && lg.ok()) << lc.status() << " " << lg.status();
    worst = std::max(worst, Nmse(*lg, *lc));
    agree += ArgMax(lg->data(), V) == ArgMax(lc->data(), V);
  }
  std::printf("[ cuda/cpu ] %-22s kv %-4s NMSE max %.2e, top-1 %d/25\n", name.c_str(),
              std::string(KvDtypeName(kv)).c_str(), worst, agree);
  EXPECT_LE(worst, 1e-3) << name;  // CudaVsCpu's bound (bf16 activations into the GEMMs)
  EXPECT_GE(agree, 20) << name;    // the random fixtures have near-ties; NMSE is the check
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<std::string, KvDtype>>& info) {
  std::string s = std::get<0>(info.param) + "_" + std::string(KvDtypeName(std::get<1>(info.param)));
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaVsCpuKv,
                         ::testing::Combine(::testing::ValuesIn(testing::CudaModelFixtureNames()),
                                            ::testing::Values(KvDtype::kF32, KvDtype::kBf16,
                                                              KvDtype::kFp8)),
                         ParamName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaVsCpuKv);

// Under one gpu_mem_gb the pool holds as many blocks as the dtype's bytes
// allow: deepseek_v3_tiny's rows are 32 + 16 elements (latent, rope) over 3
// layers: a block of 16 tokens is 9216 bytes in f32, 4608 in bf16, 2688 in
// fp8 (48 codes + 2 f32 scales per row).
TEST(CudaKvPool, SmallerDtypesHoldMoreBlocks) {
  HMOE_SKIP_UNLESS_BACKEND("cuda");
  const std::string name = "deepseek_v3_tiny";
  auto pool = [&](KvDtype kv, double gb) -> int64_t {
    ModelOptions o;
    o.cuda.gpu_mem_gb = gb;
    auto m = Load(name, "cuda", kv, o);
    return m ? m->kv_blocks_total() : 0;
  };
  // The f32 pool is bounded by memory below this many blocks (8192 tokens x
  // 16 sequences' worth above it): find a bound that gives it 200..3000.
  double lo = 0.5, hi = 8.0, gb = 0;
  int64_t f32 = 0;
  for (int i = 0; i < 30; ++i) {
    gb = 0.5 * (lo + hi);
    f32 = pool(KvDtype::kF32, gb);
    if (f32 < 200) {
      lo = gb;
    } else if (f32 > 2000) {
      hi = gb;
    } else {
      break;
    }
  }
  ASSERT_GE(f32, 200) << gb;
  ASSERT_LE(f32, 2000) << gb;
  const int64_t bf16 = pool(KvDtype::kBf16, gb), fp8 = pool(KvDtype::kFp8, gb);
  std::printf("[ kv pool  ] %s at %.4f GiB: f32 %lld, bf16 %lld, fp8 %lld blocks\n", name.c_str(),
              gb, static_cast<long long>(f32), static_cast<long long>(bf16),
              static_cast<long long>(fp8));
  // The same room R: f32 = floor(R / 9216), bf16 = floor(R / 4608), fp8 = floor(R / 2688).
  EXPECT_GE(bf16, 2 * f32);
  EXPECT_LE(bf16, 2 * f32 + 1);
  EXPECT_GE(fp8, f32 * 9216 / 2688);
  EXPECT_LE(fp8, (f32 + 1) * 9216 / 2688 + 1);
}

}  // namespace
}  // namespace hmoe
