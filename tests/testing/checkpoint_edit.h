// Test checkpoints derived from a fixture: tensors rewritten, dropped or
// re-encoded (e.g. as DeepSeek-V3's block-scaled fp8), config edited.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace hmoe::testing {

// Copies `src`'s config.json to `dst` and rewrites its model.safetensors
// through `edit` (which adds what it wants to the writer; returning false
// drops the tensor), plus optional config changes.
inline void RewriteCheckpoint(
    const std::string& src, const std::string& dst,
    const std::function<bool(const std::string&, const Tensor&, SafetensorsWriter&)>& edit,
    const std::function<void(nlohmann::json&)>& config_edit = nullptr) {
  std::ifstream in(src + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  if (config_edit) config_edit(j);
  std::ofstream(dst + "/config.json") << j.dump(1);
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  SafetensorsWriter w;
  for (const auto& e : (*f)->entries()) {
    auto t = (*f)->Get(e.name);
    ASSERT_TRUE(t.ok()) << t.status();
    if (!edit(e.name, *t, w)) continue;
  }
  ASSERT_TRUE(w.Write(dst + "/model.safetensors").ok());
}

// The edit that keeps a tensor as it is.
inline bool Keep(const std::string& name, const Tensor& t, SafetensorsWriter& w) {
  EXPECT_TRUE(w.Add(name, t).ok()) << name;
  return true;
}

// A [R][C] matrix as DeepSeek-V3 stores it: e4m3 values, one f32 scale per
// B x B block (amax / 448); `dequantized` gets the f32 values they stand for.
struct Fp8Blocks {
  std::vector<uint8_t> q;
  std::vector<float> scale, dequantized;
  int64_t block_rows = 0, block_cols = 0;
};
inline Fp8Blocks QuantizeFp8Blocks(const std::vector<float>& v, int64_t R, int64_t C, int64_t B) {
  Fp8Blocks out;
  out.block_rows = (R + B - 1) / B;
  out.block_cols = (C + B - 1) / B;
  out.scale.assign(static_cast<size_t>(out.block_rows * out.block_cols), 0.0f);
  out.q.assign(static_cast<size_t>(R * C), 0);
  for (int64_t i = 0; i < out.block_rows; ++i)
    for (int64_t j = 0; j < out.block_cols; ++j) {
      float mx = 0;
      for (int64_t r = i * B; r < std::min(R, i * B + B); ++r)
        for (int64_t c = j * B; c < std::min(C, j * B + B); ++c)
          mx = std::max(mx, std::abs(v[static_cast<size_t>(r * C + c)]));
      const float s = mx > 0 ? mx / 448.0f : 1.0f;
      out.scale[static_cast<size_t>(i * out.block_cols + j)] = s;
      for (int64_t r = i * B; r < std::min(R, i * B + B); ++r)
        for (int64_t c = j * B; c < std::min(C, j * B + B); ++c)
          out.q[static_cast<size_t>(r * C + c)] =
              F32ToFp8E4M3(v[static_cast<size_t>(r * C + c)] / s);
    }
  out.dequantized.resize(static_cast<size_t>(R * C));
  DequantFp8BlockToF32(out.q.data(), R, C, out.scale.data(), B, out.dequantized.data());
  return out;
}

// An edit that stores every 2-D "_proj" weight as block-scaled fp8 (plus its
// "_scale_inv"), or (as_fp8 false) as the f32 values those stand for; other
// tensors are kept. Pair it with FP8 quantization_config (block B x B).
inline std::function<bool(const std::string&, const Tensor&, SafetensorsWriter&)> Fp8ProjEdit(
    bool as_fp8, int64_t B) {
  return [as_fp8, B](const std::string& n, const Tensor& t, SafetensorsWriter& w) {
    const bool linear = t.rank() == 2 && n.find("_proj") != std::string::npos;
    if (!linear) return Keep(n, t, w);
    const int64_t R = t.dim(0), C = t.dim(1);
    const Fp8Blocks f = QuantizeFp8Blocks(t.ToF32(), R, C, B);
    if (as_fp8) {
      EXPECT_TRUE(w.Add(n, DType::kF8E4M3, {R, C}, f.q.data(), f.q.size()).ok());
      EXPECT_TRUE(w.Add(n + "_scale_inv", DType::kF32, {f.block_rows, f.block_cols}, f.scale.data(),
                        f.scale.size() * 4)
                      .ok());
    } else {
      EXPECT_TRUE(
          w.Add(n, DType::kF32, {R, C}, f.dequantized.data(), f.dequantized.size() * 4).ok());
    }
    return true;
  };
}

// The config edit that goes with Fp8ProjEdit(true, B).
inline std::function<void(nlohmann::json&)> Fp8Config(int64_t B) {
  return [B](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {B, B}}};
  };
}

}  // namespace hmoe::testing
