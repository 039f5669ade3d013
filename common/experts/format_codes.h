// The routed experts' weight formats and their traits: the one table every
// side reads (the expert service's kernels and packed files, the worker's
// hot and streamed experts, the CUDA kernels). Plain C++17 with no library
// beyond <cstdint>, so .cu files include it as host code does.
//
// A format is stored as `bits` per weight, row-major over a matrix's
// logical [rows][cols] (cols = the reduction dim K), with f32 scales of one
// of these blocks (w = q * scale):
//   kNone:  no scales; the stored value is the weight (bf16).
//   kRow:   one scale per row, over all cols (1 x cols).
//   kGroup: one scale per `group` consecutive cols of a row (1 x group); a
//           grouped format takes the groups in `groups`, and its bare name
//           means `default_group`.
// Adding a format: a WeightFormat code, a row of kWeightFormatTraits, and
// the kernels that read it.
#pragma once

#include <cstdint>

namespace hmoe {

enum class WeightFormat : uint8_t { kBf16 = 0, kInt8 = 1, kInt4 = 2 };

enum class ScaleType : uint8_t { kNone, kF32 };
enum class ScaleBlock : uint8_t { kNone, kRow, kGroup };

struct WeightFormatTraits {
  WeightFormat format;
  const char* name;  // as printed and parsed ("int4"; with a group: "int4g64")
  int bits;          // per stored weight (int4: two per byte, the even col in the low nibble)
  ScaleType scale_type;
  ScaleBlock scale_block;
  int default_group;  // kGroup: the group the bare name means; else 0
  int groups[3];      // kGroup: the groups taken, ascending (0: unused entry)
};

// Indexed by the WeightFormat code.
inline constexpr WeightFormatTraits kWeightFormatTraits[] = {
    {WeightFormat::kBf16, "bf16", 16, ScaleType::kNone, ScaleBlock::kNone, 0, {0, 0, 0}},
    {WeightFormat::kInt8, "int8", 8, ScaleType::kF32, ScaleBlock::kRow, 0, {0, 0, 0}},
    {WeightFormat::kInt4, "int4", 4, ScaleType::kF32, ScaleBlock::kGroup, 64, {32, 64, 128}},
};
inline constexpr int kNumWeightFormats =
    static_cast<int>(sizeof(kWeightFormatTraits) / sizeof(kWeightFormatTraits[0]));

// True for a code with a row in the table (a code read from outside).
constexpr bool IsWeightFormat(WeightFormat f) { return static_cast<int>(f) < kNumWeightFormats; }
// `f` must be a format (IsWeightFormat).
constexpr const WeightFormatTraits& Traits(WeightFormat f) {
  return kWeightFormatTraits[static_cast<int>(f)];
}
constexpr bool IsGrouped(WeightFormat f) { return Traits(f).scale_block == ScaleBlock::kGroup; }
constexpr bool HasScales(WeightFormat f) { return Traits(f).scale_type != ScaleType::kNone; }
// Bytes of one scale (0 without scales).
constexpr int ScaleBytes(WeightFormat f) { return HasScales(f) ? 4 : 0; }
// Whether grouped `f` takes `group` (false for formats without groups).
constexpr bool TakesGroup(WeightFormat f, int group) {
  for (int g : Traits(f).groups)
    if (g != 0 && g == group) return true;
  return false;
}
// Scales of one row of `cols` weights (grouped: `group` > 0).
constexpr int64_t ScalesPerRow(WeightFormat f, int group, int64_t cols) {
  switch (Traits(f).scale_block) {
    case ScaleBlock::kNone:
      return 0;
    case ScaleBlock::kRow:
      return 1;
    case ScaleBlock::kGroup:
      return (cols + group - 1) / group;
  }
  return 0;
}
// Bytes of one row of `cols` weights stored at `bits` each, whole bytes.
constexpr int64_t RowBytes(WeightFormat f, int64_t cols) { return (cols * Traits(f).bits + 7) / 8; }

}  // namespace hmoe
