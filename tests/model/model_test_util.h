// Helpers shared by the model tests: fixture discovery and reference loading.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gpu_worker/model.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe::testing {

// HMOE_FIXTURES_DIR when set (e.g. fixtures made with another seed), else tests/fixtures.
inline std::string ModelFixturesRoot() {
  const char* env = std::getenv("HMOE_FIXTURES_DIR");
  return env && *env ? std::string(env) : FixturesDir();
}

// deepseek_v4 fixtures: the model driver does not run its layer kinds yet
// (both backends refuse it at load); deepseek_v4_reference_test checks them
// against transformers with the plain f32 forward pass instead.
inline bool DriverCannotRunYet(const std::string& dir) {
  auto c = LoadModelConfig(dir);
  return c.ok() && c->arch == Architecture::kDeepseekV4;
}

// Names of the subdirectories of the fixtures root that hold reference.safetensors.
inline std::vector<std::string> ModelFixtureNames() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(ModelFixturesRoot(), ec)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "reference.safetensors") &&
        std::filesystem::exists(e.path() / "config.json") && !DriverCannotRunYet(e.path().string()))
      out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ModelFixtureNames() less the fixtures whose layers the CUDA backend does
// not run (mla_dsa: it refuses those models), for the suites that compare it
// with the reference backend.
inline std::vector<std::string> CudaModelFixtureNames() {
  std::vector<std::string> out;
  for (const std::string& n : ModelFixtureNames()) {
    auto c = LoadModelConfig(ModelFixturesRoot() + "/" + n);
    if (c.ok() && std::any_of(c->layers.begin(), c->layers.end(), [](const LayerSpec& l) {
          return l.attention == AttentionKind::kMlaDsa;
        }))
      continue;
    out.push_back(n);
  }
  return out;
}

// max |a - b| over max |b| (the logits' scale); infinite for a non-finite a
// or a size mismatch.
inline double MaxScaledDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? m / scale : m;
}

// The largest MaxScaledDiff over passes' logits (PrefillThenDecode's);
// infinite when the pass counts differ.
inline double MaxScaledDiff(const std::vector<std::vector<float>>& a,
                            const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, MaxScaledDiff(a[i], b[i]));
  return worst;
}

// The last-token logits of a prefill of `prompt` in a fresh Sequence of `m`,
// then of `steps` decode steps feeding tokens 3, 8, 13, ...; stops at (and
// reports) the first failure, so a shorter result means one failed.
// `dir`'s config and checkpoint, and the in-process reference experts that
// read them (MakeReferenceRoutedExperts): keep the rig while they run.
struct ReferenceRig {
  ModelConfig config;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<RoutedExperts> experts;
};
// Fails the calling test (wrap in ASSERT_NO_FATAL_FAILURE) if a step fails.
inline void LoadReferenceRig(const std::string& dir, int num_threads, ReferenceRig* out) {
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  out->config = *config;
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  out->ckpt = std::move(*ckpt);
  auto experts = MakeReferenceRoutedExperts(out->config, *out->ckpt, num_threads);
  ASSERT_TRUE(experts.ok()) << experts.status();
  out->experts = std::move(*experts);
}

inline std::vector<std::vector<float>> PrefillThenDecode(const Model& m,
                                                         const std::vector<int32_t>& prompt,
                                                         int steps) {
  std::vector<std::vector<float>> out;
  auto s = m.NewSequence();
  auto l = m.Prefill(*s, prompt, LogitsMode::kLast);
  EXPECT_TRUE(l.ok()) << l.status();
  if (!l.ok()) return out;
  out.push_back(*l);
  for (int step = 0; step < steps; ++step) {
    auto d = m.Decode(*s, 3 + 5 * step);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return out;
    out.push_back(*d);
  }
  return out;
}

struct ReferenceOutputs {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> prefill, steps;  // [P, V], [N, V]
  int64_t vocab = 0;
};

inline ReferenceOutputs LoadReference(const std::string& dir) {
  ReferenceOutputs r;
  auto f = SafetensorsFile::Open(dir + "/reference.safetensors");
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return r;
  auto ids = [&](const char* name) {
    std::vector<int32_t> out;
    auto t = (*f)->Get(name);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok())
      for (float v : t->ToF32()) out.push_back(static_cast<int32_t>(v));
    return out;
  };
  auto floats = [&](const char* name) {
    auto t = (*f)->Get(name);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->ToF32() : std::vector<float>();
  };
  r.prompt = ids("prompt_ids");
  r.greedy = ids("greedy_ids");
  r.prefill = floats("prefill_logits");
  r.steps = floats("step_logits");
  if (!r.prompt.empty()) r.vocab = static_cast<int64_t>(r.prefill.size() / r.prompt.size());
  return r;
}

// max |a - b| / max |b| over n values.
inline double RelErr(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return den > 0 ? num / den : num;
}

inline int64_t ArgMax(const float* v, int64_t n) { return std::max_element(v, v + n) - v; }

}  // namespace hmoe::testing
