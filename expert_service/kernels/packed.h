// Packed expert weights: the one layout the AMX, AVX-512, AVX2 and scalar
// kernels all read. Weights are quantized and packed once (Pack) and never
// copied again.
//
// A weight matrix W is logically [N][K]: row n is output channel n, K is the
// reduction dim (gate/up: N = intermediate, K = hidden; down: N = hidden,
// K = intermediate). Padding: Np = roundup(N, 16); Kp = roundup(K, 64), or
// roundup(K, group) for int4 when group > 64. Padded weights are zero.
//
// W is stored as Np/16 "panels" of 16 output channels each; panel j holds rows
// [16j, 16j+16) over all Kp, is contiguous, panel_bytes long (a multiple of
// 64), and starts 64-byte aligned. Within a panel every 64-byte line holds
// those 16 channels for a few consecutive k ("VNNI" order):
//
//   BF16: Kp/2 lines; line p = { W[16j+c][2p], W[16j+c][2p+1] : c = 0..15 }
//         (bf16 pairs). Lines 16t..16t+15 form one AMX BF16 B tile
//         (32 k x 16 n, 1 KiB, stride 64) and each line is one
//         vdpbf16ps operand.
//   INT8: Kp/4 lines; line q = { W[16j+c][4q..4q+3] : c } (int8, symmetric,
//         |q| <= 127), then 64 B of f32 scale[16] (per output channel,
//         w = q * scale) and 64 B of int32 rowsum[16] (sum_k q, used by the
//         VNNI u8*s8 kernel's +128 activation offset). Lines 16t..16t+15
//         form one AMX INT8 B tile (64 k x 16 n).
//   INT4: per group g of G consecutive k (G = 32, 64 or 128), G/8 lines then
//         64 B of f32 scale[16] (w = q * scale[g]). Line o of the group holds
//         k0 = g*G + 8o: byte 4c+i = (q[16j+c][k0+i] + 8) | (q[16j+c][k0+4+i] + 8) << 4,
//         i = 0..3: offset-binary nibbles, so the low nibbles of a line are
//         exactly an INT8-layout line for k0..k0+3 and the high nibbles for
//         k0+4..k0+7 (values 0..15, i.e. q + 8, q in [-8, 7]).
//
//   Native formats (mxfp4, int4bf16, fp8, mxfp8: the codes and scales as a
//   checkpoint stores them, never re-quantized): Kp = roundup(K, sb_k), and
//   the panel is Kp / sb_k super-blocks of sb_k consecutive k (sb_k =
//   NativeSuperBlockK: 128, or 256 for int4bf16 group 128), each its code
//   lines, then (all but fp8) its scales:
//     4-bit codes (mxfp4: e2m1; int4bf16: two's complement q): sb_k / 8
//       lines; line o holds k0 = 8o (from the super-block's start): byte
//       4c+i = code[16j+c][k0+i] | code[16j+c][k0+4+i] << 4, i = 0..3 (the
//       INT4 nibble order, raw codes).
//     8-bit codes (e4m3): sb_k / 4 lines; line o holds k0 = 4o: byte 16i+c =
//       code[16j+c][k0+i] (k-major: 16 bytes are one k's 16 channels).
//     scales: sb_k / group groups x 16 channels, [group][channel], in the
//       format's scale type (e8m0 bytes; int4bf16: bf16), 64 or 128 bytes.
//     fp8 (one f32 scale per 128 x 128 block; sb_k = 128): every channel of
//       a panel lies in one block row (parts split K and the panel rows on
//       multiples of 128), so after the super-blocks the panel holds its
//       Kp / 128 f32 scales, one per super-block, zero-padded to 64 bytes.
//   Padding codes are 0 (the value 0 in every format) and padding scales 0.
//   Panel bytes are the stored bytes but for fp8's trailer padding: the
//   layout adds no per-weight bytes (footprint: DRAM <= 1.02x native).
//
// gate and up are packed as one matrix of 2*Np(I) rows with panels
// interleaved: panel 2j = gate rows [16j, 16j+16), panel 2j+1 = up rows, so a
// task over a panel pair computes SiLU(gate)*up for 16 columns at once.
#pragma once

#include <cstdint>
#include <limits>

#include "common/experts/format_codes.h"

namespace hmoe {

struct PackedGeom {
  WeightFormat format = WeightFormat::kBf16;
  int group = 0;  // int4 only
  int64_t n = 0, k = 0;
  int64_t np = 0, kp = 0;
  int64_t nblocks = 0;      // np / 16
  int64_t panel_bytes = 0;  // multiple of 64
  int64_t bytes() const { return nblocks * panel_bytes; }
  // INT8: scale / rowsum trailer of panel j; INT4: scales of group g of panel j.
  int64_t i8_scale_offset() const { return kp * 16; }
  int64_t i8_rowsum_offset() const { return kp * 16 + 64; }
  int64_t i4_group_bytes() const { return int64_t{group} * 8 + 64; }
  // Native formats: k per super-block, its bytes (code lines and scales),
  // its code bytes (the scales follow them), and fp8's per-panel scale
  // trailer (after the super-blocks).
  int64_t sb_k = 0;
  int64_t sb_bytes = 0;
  int64_t sb_code_bytes = 0;
  // Super-blocks per panel, and where fp8's scale trailer starts. Data, not
  // inline functions: an ISA kernel object must define no shared function
  // (tests/kernels/isa_objects_check.sh), and an unoptimized build emits
  // inline members that call each other as weak functions.
  int64_t nsb = 0;
  int64_t fp8_scale_offset = 0;
};

// The formats kept as their checkpoints store them (packed.h native layout).
constexpr bool IsNativeFormat(WeightFormat f) {
  return f == WeightFormat::kMxfp4 || f == WeightFormat::kInt4Bf16 || f == WeightFormat::kFp8 ||
         f == WeightFormat::kMxfp8;
}
// A native format's super-block (k): 128, or two groups where that is more
// (int4bf16 group 128: two groups' 16-channel bf16 scales fill one 64-byte
// line).
constexpr int64_t NativeSuperBlockK(WeightFormat f, int group) {
  if (f == WeightFormat::kInt4Bf16) return group * 2 > 128 ? int64_t{group} * 2 : 128;
  return 128;
}

PackedGeom MakeGeom(WeightFormat f, int group, int64_t n, int64_t k);
// K alignment for a format: 64, or the int4 group when larger; native
// formats: their super-block.
int64_t KAlign(WeightFormat f, int group);

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// int8 activations (per row): scale s = amax / 127, q = round(x * inv)
// clamped to [-127, 127]. inv = 1 / s, or 0 when s is 0 or below FLT_MIN
// (1 / s would overflow and 0 * inf is NaN): such a row quantizes to zeros.
inline float Int8InvScale(float s) {
  return s >= std::numeric_limits<float>::min() ? 1.0f / s : 0.0f;
}

}  // namespace hmoe
