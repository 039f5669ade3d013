// The routed experts' weight formats and their traits: the one table every
// side reads (the expert service's kernels and packed files, the worker's
// hot and streamed experts, the CUDA kernels). Plain C++17 with no library
// beyond <cstdint>, so .cu files include it as host code does.
//
// A format is stored as `bits` per weight, row-major over a matrix's
// logical [rows][cols] (cols = the reduction dim K), each row in whole bytes
// (4-bit codes two per byte, the even col in the low nibble). A stored code
// decodes per `value`:
//   kBf16: the weight itself (bf16).
//   kInt:  a two's complement integer q (8 or 4 bits).
//   kE2M1: OCP Microscaling FP4: sign bit 3, then |v| by the low 3 bits in
//          {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
//   kE4M3: fp8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN, max 448.
// and is scaled (w = v * scale) by one scale of `scale_type` per block:
//   kNone:    no scales (bf16).
//   kRow:     one scale per row, over all cols (1 x cols).
//   kGroup:   one per `group` consecutive cols of a row (1 x group).
//   kBlock2D: one per `group` x `group` block (rows r / group, cols c / group).
// Scale types: f32; bf16; e8m0 (OCP: 2^(e - 127), 0xFF is NaN and is never
// stored). A format with a group parameter (kGroup, kBlock2D) takes the
// groups in `groups`; its bare name means `default_group`, and a name with a
// group is name + "g" + group unless it takes only one group.
// Adding a format: a WeightFormat code, a row of kWeightFormatTraits, and
// the kernels that read it.
#pragma once

#include <cstdint>

namespace hmoe {

enum class WeightFormat : uint8_t {
  kBf16 = 0,
  kInt8 = 1,
  kInt4 = 2,
  kMxfp4 = 3,     // OCP MXFP4: e2m1 values, an e8m0 scale per 32 (gpt-oss, DeepSeek-V4)
  kInt4Bf16 = 4,  // int4 symmetric, a bf16 scale per group (compressed-tensors pack-quantized)
  kFp8 = 5,       // e4m3 values, an f32 scale per 128 x 128 block (DeepSeek-V3 weight_scale_inv)
  kMxfp8 = 6,     // OCP MXFP8: e4m3 values, an e8m0 scale per 32
};

enum class ValueCode : uint8_t { kBf16, kInt, kE2M1, kE4M3 };
enum class ScaleType : uint8_t { kNone, kF32, kBf16, kE8M0 };
enum class ScaleBlock : uint8_t { kNone, kRow, kGroup, kBlock2D };

struct WeightFormatTraits {
  WeightFormat format;
  const char* name;  // as printed and parsed ("int4"; with a group: "int4g64")
  int bits;          // per stored weight
  ValueCode value;
  ScaleType scale_type;
  ScaleBlock scale_block;
  int default_group;  // kGroup / kBlock2D: the group the bare name means; else 0
  int groups[3];      // kGroup / kBlock2D: the groups taken, ascending (0: unused entry)
};

// Indexed by the WeightFormat code.
// clang-format off
inline constexpr WeightFormatTraits kWeightFormatTraits[] = {
    // format                  name        bits value             scale_type        scale_block            group  groups
    {WeightFormat::kBf16,      "bf16",     16,  ValueCode::kBf16, ScaleType::kNone, ScaleBlock::kNone,     0,   {0, 0, 0}},
    {WeightFormat::kInt8,      "int8",     8,   ValueCode::kInt,  ScaleType::kF32,  ScaleBlock::kRow,      0,   {0, 0, 0}},
    {WeightFormat::kInt4,      "int4",     4,   ValueCode::kInt,  ScaleType::kF32,  ScaleBlock::kGroup,    64,  {32, 64, 128}},
    {WeightFormat::kMxfp4,     "mxfp4",    4,   ValueCode::kE2M1, ScaleType::kE8M0, ScaleBlock::kGroup,    32,  {32, 0, 0}},
    {WeightFormat::kInt4Bf16,  "int4bf16", 4,   ValueCode::kInt,  ScaleType::kBf16, ScaleBlock::kGroup,    32,  {32, 64, 128}},
    {WeightFormat::kFp8,       "fp8",      8,   ValueCode::kE4M3, ScaleType::kF32,  ScaleBlock::kBlock2D,  128, {128, 0, 0}},
    {WeightFormat::kMxfp8,     "mxfp8",    8,   ValueCode::kE4M3, ScaleType::kE8M0, ScaleBlock::kGroup,    32,  {32, 0, 0}},
};
// clang-format on
inline constexpr int kNumWeightFormats =
    static_cast<int>(sizeof(kWeightFormatTraits) / sizeof(kWeightFormatTraits[0]));

// True for a code with a row in the table (a code read from outside).
constexpr bool IsWeightFormat(WeightFormat f) { return static_cast<int>(f) < kNumWeightFormats; }
// `f` must be a format (IsWeightFormat).
constexpr const WeightFormatTraits& Traits(WeightFormat f) {
  return kWeightFormatTraits[static_cast<int>(f)];
}
// Whether `f` has a group parameter (kGroup or kBlock2D scales).
constexpr bool IsGrouped(WeightFormat f) {
  return Traits(f).scale_block == ScaleBlock::kGroup ||
         Traits(f).scale_block == ScaleBlock::kBlock2D;
}
constexpr bool HasScales(WeightFormat f) { return Traits(f).scale_type != ScaleType::kNone; }
// Bytes of one scale of `t` (0 for kNone).
constexpr int ScaleTypeBytes(ScaleType t) {
  return t == ScaleType::kF32 ? 4 : t == ScaleType::kBf16 ? 2 : t == ScaleType::kE8M0 ? 1 : 0;
}
// Bytes of one scale of `f` (0 without scales).
constexpr int ScaleBytes(WeightFormat f) { return ScaleTypeBytes(Traits(f).scale_type); }
// Whether grouped `f` takes `group` (false for formats without groups).
constexpr bool TakesGroup(WeightFormat f, int group) {
  for (int g : Traits(f).groups)
    if (g != 0 && g == group) return true;
  return false;
}
// Whether grouped `f` takes one group only (its names then carry none).
constexpr bool TakesOneGroup(WeightFormat f) {
  return IsGrouped(f) && Traits(f).groups[0] != 0 && Traits(f).groups[1] == 0;
}
// Scales in one row of a matrix's scale array: kRow 1, kGroup ceil(cols /
// group), kBlock2D ceil(cols / group) (the blocks across a block row).
constexpr int64_t ScalesPerRow(WeightFormat f, int group, int64_t cols) {
  switch (Traits(f).scale_block) {
    case ScaleBlock::kNone:
      return 0;
    case ScaleBlock::kRow:
      return 1;
    case ScaleBlock::kGroup:
    case ScaleBlock::kBlock2D:
      return (cols + group - 1) / group;
  }
  return 0;
}
// Rows of a matrix's scale array: `rows`, or ceil(rows / group) for
// kBlock2D; 0 without scales.
constexpr int64_t ScaleRows(WeightFormat f, int group, int64_t rows) {
  switch (Traits(f).scale_block) {
    case ScaleBlock::kNone:
      return 0;
    case ScaleBlock::kRow:
    case ScaleBlock::kGroup:
      return rows;
    case ScaleBlock::kBlock2D:
      return (rows + group - 1) / group;
  }
  return 0;
}
// Scales of a [rows][cols] matrix: [ScaleRows][ScalesPerRow], row-major.
constexpr int64_t ScaleCount(WeightFormat f, int group, int64_t rows, int64_t cols) {
  return ScaleRows(f, group, rows) * ScalesPerRow(f, group, cols);
}
// The index of the scale of weight (r, c) in that array.
constexpr int64_t ScaleIndex(WeightFormat f, int group, int64_t cols, int64_t r, int64_t c) {
  switch (Traits(f).scale_block) {
    case ScaleBlock::kNone:
      return 0;
    case ScaleBlock::kRow:
      return r;
    case ScaleBlock::kGroup:
      return r * ScalesPerRow(f, group, cols) + c / group;
    case ScaleBlock::kBlock2D:
      return (r / group) * ScalesPerRow(f, group, cols) + c / group;
  }
  return 0;
}
// Bytes of one row of `cols` weights stored at `bits` each, whole bytes.
constexpr int64_t RowBytes(WeightFormat f, int64_t cols) { return (cols * Traits(f).bits + 7) / 8; }
// Bytes of a [rows][cols] matrix: its codes and its scales.
constexpr int64_t MatrixBytes(WeightFormat f, int group, int64_t rows, int64_t cols) {
  return rows * RowBytes(f, cols) + ScaleCount(f, group, rows, cols) * ScaleBytes(f);
}

// The magnitudes of the e2m1 codes 0..7 (code 8..15: the same, negative).
inline constexpr float kE2M1Magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
// The e8m0 code that is NaN (refused wherever scales are read).
inline constexpr uint8_t kE8M0NaN = 0xFF;

}  // namespace hmoe
