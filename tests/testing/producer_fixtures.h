// The checkpoints under tests/fixtures/native_producers, whose routed experts
// were quantized by the formats' own producers (compressed-tensors,
// transformers; make_native_fixtures.py), and the rule that compares a
// matrix we read with the producer's own dequantization of it
// (producer_dequant.safetensors).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/experts/format_codes.h"
#include "common/experts/quantize.h"
#include "common/tensor.h"
#include "tests/testing/temp_dir.h"

namespace hmoe::testing {

struct ProducerFixture {
  const char* dir;  // under tests/fixtures/native_producers
  WeightFormat format;
  int group;
};
inline void PrintTo(const ProducerFixture& f, std::ostream* os) { *os << f.dir; }

inline std::vector<ProducerFixture> ProducerFixtures() {
  return {{"int4g32", WeightFormat::kInt4Bf16, 32}, {"mxfp4", WeightFormat::kMxfp4, 32},
          {"fp8", WeightFormat::kFp8, 128},         {"mxfp8", WeightFormat::kMxfp8, 32},
          {"mxfp4_ct", WeightFormat::kMxfp4, 32},   {"mxfp8_ct", WeightFormat::kMxfp8, 32}};
}

inline std::string ProducerFixtureDir(const ProducerFixture& f) {
  return FixturesDir() + "/native_producers/" + f.dir;
}

// One element where ours and the producer's differ.
struct Mismatch {
  std::string name;
  int64_t row = 0, col = 0;
  float ours = 0, producer = 0;
};

// Appends to `out` every element of `m` (named `name`) that is not the
// producer's `p`; false (and one entry at (-1, -1)) when `p` is not a 2-D
// bf16 / f32 tensor of m's shape. Our value is the exact product code x
// scale rounded once to f32 (QuantMatrix::At): an f32 producer (transformers'
// Fp8Dequantize) must equal it bit for bit; a bf16 one (compressed-tensors'
// decompress, transformers' convert_moe_packed_tensors) must be it rounded to
// bf16, and for mxfp4 / mxfp8 (a code times a power of two, exact in bf16)
// it unrounded too.
inline bool CompareWithProducer(const QuantMatrix& m, const Tensor& p, const std::string& name,
                                std::vector<Mismatch>* out, int64_t* elements) {
  const bool f32 = p.dtype() == DType::kF32;
  if (p.rank() != 2 || p.dim(0) != m.rows || p.dim(1) != m.cols ||
      (!f32 && p.dtype() != DType::kBF16)) {
    out->push_back({name + " (the producer's dtype or shape differs)", -1, -1, 0, 0});
    return false;
  }
  const bool exact_in_bf16 = m.format == WeightFormat::kMxfp4 || m.format == WeightFormat::kMxfp8;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const float ours = m.At(r, c);
      const size_t k = static_cast<size_t>(r * m.cols + c);
      bool same;
      float theirs;
      if (f32) {
        theirs = static_cast<const float*>(p.raw())[k];
        same = F32Bits(ours) == F32Bits(theirs);
      } else {
        const uint16_t h = static_cast<const uint16_t*>(p.raw())[k];
        theirs = Bf16ToF32(h);
        same = F32ToBf16(ours) == h && (!exact_in_bf16 || F32Bits(ours) == F32Bits(theirs));
      }
      if (!same) out->push_back({name, r, c, ours, theirs});
      ++*elements;
    }
  return true;
}

inline std::string Describe(const std::vector<Mismatch>& mismatches, int64_t elements) {
  std::string s = absl::StrCat(mismatches.size(), " of ", elements, " differ");
  for (size_t i = 0; i < mismatches.size() && i < 5; ++i) {
    const Mismatch& m = mismatches[i];
    absl::StrAppend(&s, "\n  ", m.name, "[", m.row, ", ", m.col, "]: ours ",
                    absl::StrFormat("%.9g", m.ours), ", producer ",
                    absl::StrFormat("%.9g", m.producer));
  }
  return s;
}

}  // namespace hmoe::testing
