// Test checkpoints whose routed experts ship quantized, written by packers
// that follow the published layouts (common/native_layout.h's rows):
// compressed-tensors pack-quantized int4 (weight_packed / weight_scale /
// weight_shape), its mxfp4-pack-quantized (weight_packed / weight_scale e8m0)
// and mxfp8-quantized (weight / weight_scale e8m0), transformers' mxfp4
// (weight_blocks / weight_scales), DeepSeek-V3 fp8 (weight /
// weight_scale_inv), mxfp8 (weight / weight_scale e8m0).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/dtype.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "common/native_layout.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/temp_dir.h"

namespace hmoe::testing {

inline std::string NativeFixture() { return FixturesDir() + "/qwen3_moe_tiny"; }

inline bool IsRoutedExpertWeight(const std::string& name) {
  return absl::StrContains(name, ".mlp.experts.") && absl::EndsWith(name, ".weight");
}

// compressed-tensors pack-quantized: q + 8 as 4-bit unsigned, eight per
// int32, element j of each eight in bits [4j, 4j + 4); rows padded to 8.
inline std::vector<int32_t> PackInt32(const QuantMatrix& m) {
  const int64_t words = (m.cols + 7) / 8;
  std::vector<int32_t> out(static_cast<size_t>(m.rows * words), 0);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const uint8_t b = m.packed[static_cast<size_t>(r * RowBytes(m.format, m.cols) + c / 2)];
      const int nib = (c & 1) ? b >> 4 : b & 0xF;
      const int q = nib >= 8 ? nib - 16 : nib;
      uint32_t& w = reinterpret_cast<uint32_t&>(out[static_cast<size_t>(r * words + c / 8)]);
      w |= static_cast<uint32_t>(q + 8) << (4 * (c % 8));
    }
  return out;
}

// The convention (common/native_layout.h row) a test checkpoint of `f` is
// written in by default: compressed-tensors for int4bf16, the method named
// after the format otherwise (transformers' mxfp4, DeepSeek fp8, mxfp8).
inline const NativeLayout& DefaultLayout(WeightFormat f) {
  const std::string_view method =
      f == WeightFormat::kInt4Bf16 ? "compressed-tensors" : WeightFormatName(f);
  for (const NativeLayout& l : kNativeLayouts)
    if (l.method == method && l.expert_format == WeightFormatName(f)) return l;
  ADD_FAILURE() << "no layout for " << WeightFormatName(f);
  return kNativeLayouts[0];
}

// config.json's quantization_config for convention `l` (group: the int4 group).
inline nlohmann::json QuantConfig(const NativeLayout& l, int group = 32) {
  const std::string method(l.method), format(l.ct_format);
  if (l.method == "fp8") return {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  if (l.method != "compressed-tensors") return {{"quant_method", method}};
  return {{"quant_method", method},
          {"format", format},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights",
               {{"num_bits", l.ct_bits},
                {"type", std::string(l.ct_type)},
                {"symmetric", true},
                {"strategy", "group"},
                {"group_size", group}}},
              {"input_activations", nullptr}}}}},
          {"ignore", {"lm_head"}}};
}
inline nlohmann::json QuantConfig(WeightFormat f) { return QuantConfig(DefaultLayout(f)); }

// Writes `m` under `weight`'s names in convention `layout` (default: its
// format's DefaultLayout). `bad_scales`: the scales one column too wide (the
// last repeated).
inline void AddNative(SafetensorsWriter& w, const std::string& weight, const QuantMatrix& in,
                      bool bad_scales = false, const NativeLayout* layout = nullptr) {
  const NativeLayout& l = layout != nullptr ? *layout : DefaultLayout(in.format);
  QuantMatrix m = in;
  const int64_t sr = ScaleRows(m.format, m.group, m.rows);
  int64_t sc = ScalesPerRow(m.format, m.group, m.cols);
  if (bad_scales) {
    auto widen = [&](auto& v) {
      auto out = v;
      out.clear();
      for (int64_t r = 0; r < sr; ++r) {
        for (int64_t c = 0; c < sc; ++c) out.push_back(v[static_cast<size_t>(r * sc + c)]);
        out.push_back(v[static_cast<size_t>(r * sc + sc - 1)]);
      }
      v = out;
    };
    if (!m.scale.empty()) widen(m.scale);
    if (!m.scale_bf16.empty()) widen(m.scale_bf16);
    if (!m.scale_e8m0.empty()) widen(m.scale_e8m0);
    ++sc;
  }
  const std::string codes = NativeTensorName(weight, l.codes),
                    scales = NativeTensorName(weight, l.scales);
  switch (m.format) {
    case WeightFormat::kInt4Bf16: {
      const std::vector<int32_t> p = PackInt32(m);
      ASSERT_TRUE(
          w.Add(codes, DType::kI32, {m.rows, (m.cols + 7) / 8}, p.data(), p.size() * 4).ok());
      ASSERT_TRUE(
          w.Add(scales, DType::kBF16, {sr, sc}, m.scale_bf16.data(), m.scale_bf16.size() * 2).ok());
      const int64_t shape[2] = {m.rows, m.cols};
      ASSERT_TRUE(
          w.Add(NativeTensorName(weight, l.shape), DType::kI64, {2}, shape, sizeof(shape)).ok());
      break;
    }
    case WeightFormat::kMxfp4: {
      // transformers' (gpt-oss) blocks [rows, cols/32, 16]; compressed-tensors [rows, cols/2]
      const Shape blocks =
          l.codes == ".weight_blocks" ? Shape{m.rows, m.cols / 32, 16} : Shape{m.rows, m.cols / 2};
      ASSERT_TRUE(w.Add(codes, DType::kU8, blocks, m.packed.data(), m.packed.size()).ok());
      ASSERT_TRUE(
          w.Add(scales, DType::kU8, {sr, sc}, m.scale_e8m0.data(), m.scale_e8m0.size()).ok());
      break;
    }
    case WeightFormat::kFp8:
      ASSERT_TRUE(
          w.Add(codes, DType::kF8E4M3, {m.rows, m.cols}, m.packed.data(), m.packed.size()).ok());
      ASSERT_TRUE(w.Add(scales, DType::kF32, {sr, sc}, m.scale.data(), m.scale.size() * 4).ok());
      break;
    default:
      ASSERT_TRUE(
          w.Add(codes, DType::kF8E4M3, {m.rows, m.cols}, m.packed.data(), m.packed.size()).ok());
      // F8_E8M0 as safetensors names it; compressed-tensors saves U8
      ASSERT_TRUE(w.Add(scales, l.ct_format.empty() ? DType::kF8E8M0 : DType::kU8, {sr, sc},
                        m.scale_e8m0.data(), m.scale_e8m0.size())
                      .ok());
      break;
  }
}

// The fixture with every routed expert quantized to `f` (our quantizer) in
// convention `layout` (default: DefaultLayout(f)); `mutate` may damage one
// matrix before it is written.
struct NativeCheckpoint {
  std::map<std::string, QuantMatrix> written;  // by ".weight" name
};
inline NativeCheckpoint MakeNative(
    const std::string& dir, WeightFormat f,
    const std::function<void(const std::string&, QuantMatrix&, SafetensorsWriter&, bool*)>& mutate =
        nullptr,
    const std::function<void(nlohmann::json&)>& config_edit = nullptr,
    const NativeLayout* layout = nullptr) {
  NativeCheckpoint out;
  RewriteCheckpoint(
      NativeFixture(), dir,
      [&](const std::string& name, const Tensor& t, SafetensorsWriter& w) {
        if (!IsRoutedExpertWeight(name)) {
          EXPECT_TRUE(w.Add(name, t).ok());
          return true;
        }
        const std::vector<float> v = t.ToF32();
        QuantMatrix m = QuantizeMatrix(v.data(), t.dim(0), t.dim(1), f, Traits(f).default_group);
        bool done = false;
        if (mutate) mutate(name, m, w, &done);
        if (!done) AddNative(w, name, m, /*bad_scales=*/false, layout);
        out.written[name] = m;
        return true;
      },
      [&](nlohmann::json& j) {
        j["quantization_config"] = QuantConfig(layout != nullptr ? *layout : DefaultLayout(f));
        if (config_edit) config_edit(j);
      });
  return out;
}

}  // namespace hmoe::testing
