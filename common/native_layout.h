// How checkpoints store routed experts natively: one row per convention
// (config.json's quantization_config.quant_method and, for
// compressed-tensors, its format), naming the expert weight format it holds
// and the tensors beside each projection's "<module>.weight". The config
// parser, the weight map and the checkpoint source all read this table.
// Adding a convention: a row here (and, for a new weight format, its row in
// common/experts/format_codes.h).
#pragma once

#include <string_view>

#include "common/model_config.h"

namespace hmoe {

struct NativeLayout {
  std::string_view method;     // quantization_config.quant_method
  std::string_view ct_format;  // compressed-tensors' format; "" for the other methods
  // compressed-tensors' config group weights taken: num_bits, type and the
  // group sizes (0: unused entry); unused for the other methods.
  int ct_bits;
  std::string_view ct_type;
  int ct_groups[3];
  // The weight format held (its name in common/experts/format_codes.h).
  std::string_view expert_format;
  // The codes, scales and (compressed-tensors int4) shape tensors: the
  // module's name + these ("model...gate_proj" + ".weight_packed");
  // shape "" for none.
  std::string_view codes, scales, shape;
};

// clang-format off
inline constexpr NativeLayout kNativeLayouts[] = {
    // method                ct_format               bits type     groups          format      codes             scales               shape
    {"compressed-tensors",   "pack-quantized",       4,   "int",   {32, 64, 128},  "int4bf16", ".weight_packed", ".weight_scale",     ".weight_shape"},
    {"compressed-tensors",   "mxfp4-pack-quantized", 4,   "float", {32, 0, 0},     "mxfp4",    ".weight_packed", ".weight_scale",     ""},
    {"compressed-tensors",   "mxfp8-quantized",      8,   "float", {32, 0, 0},     "mxfp8",    ".weight",        ".weight_scale",     ""},
    {"mxfp4",                "",                     0,   "",      {0, 0, 0},      "mxfp4",    ".weight_blocks", ".weight_scales",    ""},
    {"mxfp8",                "",                     0,   "",      {0, 0, 0},      "mxfp8",    ".weight",        ".weight_scale",     ""},
    {"fp8",                  "",                     0,   "",      {0, 0, 0},      "fp8",      ".weight",        ".weight_scale_inv", ""},
};
// clang-format on

// The row of `q`'s method and (compressed-tensors) format; nullptr for none
// (no quantization_config, or a method this table does not hold).
inline const NativeLayout* FindNativeLayout(const QuantizationConfig& q) {
  for (const NativeLayout& l : kNativeLayouts)
    if (l.method == q.method && l.ct_format == q.format) return &l;
  return nullptr;
}

// The compressed-tensors row of `format`; nullptr for a format not read.
inline const NativeLayout* FindCompressedTensorsLayout(std::string_view format) {
  for (const NativeLayout& l : kNativeLayouts)
    if (l.method == "compressed-tensors" && l.ct_format == format) return &l;
  return nullptr;
}

}  // namespace hmoe
