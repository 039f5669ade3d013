// Random routed experts for tests (the kernels', the formats', the GPU's):
// an in-memory MoeWeightsSource.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/experts/expert_weights.h"
#include "common/experts/quantize.h"
#include "common/tensor.h"

namespace hmoe::testing {

// Experts with weights ~ N(0, 1/sqrt(fan_in)) in bf16 (or fp8 e4m3 with
// 128x128 block scales when fp8).
inline MoeWeightsSource RandomSource(int64_t H, int64_t I, int64_t E, uint64_t seed,
                                     bool fp8 = false) {
  struct Store {
    std::vector<ExpertWeights> w;
  };
  auto store = std::make_shared<Store>();
  std::mt19937_64 rng(seed);
  auto matrix = [&](int64_t r, int64_t c, Tensor* scale_inv) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt(static_cast<float>(c)));
    if (!fp8) {
      Tensor t = Tensor::Empty(DType::kBF16, {r, c});
      for (int64_t i = 0; i < r * c; ++i) t.data<uint16_t>()[i] = F32ToBf16(d(rng));
      return t;
    }
    const int64_t br = (r + 127) / 128, bc = (c + 127) / 128;
    *scale_inv = Tensor::Empty(DType::kF32, {br, bc});
    for (int64_t i = 0; i < br * bc; ++i)
      scale_inv->data<float>()[i] =
          (0.5f + 0.1f * static_cast<float>(i % 7)) / (64.0f * std::sqrt(static_cast<float>(c)));
    Tensor t = Tensor::Empty(DType::kF8E4M3, {r, c});
    for (int64_t i = 0; i < r * c; ++i) {
      const float s = scale_inv->data<float>()[(i / c / 128) * bc + (i % c) / 128];
      t.data<uint8_t>()[i] = F32ToFp8E4M3(d(rng) / s);
    }
    return t;
  };
  for (int64_t e = 0; e < E; ++e) {
    ExpertWeights w;
    w.gate = matrix(I, H, &w.gate_scale_inv);
    w.up = matrix(I, H, &w.up_scale_inv);
    w.down = matrix(H, I, &w.down_scale_inv);
    store->w.push_back(std::move(w));
  }
  MoeWeightsSource src;
  src.hidden = H;
  src.intermediate = I;
  src.num_experts = E;
  src.expert = [store](int64_t e) -> absl::StatusOr<ExpertWeights> {
    return store->w[static_cast<size_t>(e)];
  };
  return src;
}

// Quantization options that are bad for an expert of intermediate size 32
// (RandomSource(H, 32, ...)), each with what the INVALID_ARGUMENT names.
inline std::vector<std::pair<QuantOptions, std::string>> BadQuantOptionsForI32() {
  std::vector<std::pair<QuantOptions, std::string>> bad;
  QuantOptions o;
  o.format = WeightFormat::kInt4;
  o.group = 48;
  bad.emplace_back(o, "int4 group must be 32, 64 or 128, got 48");
  o.group = 32;
  o.i_begin = 40;  // past I = 32
  bad.emplace_back(o, "bad intermediate slice [40, 32) of 32");
  o.i_begin = 16;
  o.i_end = 16;  // empty
  bad.emplace_back(o, "bad intermediate slice [16, 16) of 32");
  o.i_begin = 0;
  o.i_end = 33;  // past I
  bad.emplace_back(o, "bad intermediate slice [0, 33) of 32");
  return bad;
}

}  // namespace hmoe::testing
