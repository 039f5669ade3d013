// Internal: the per-ISA kernel table behind RunMoe. Each kernel computes
//   c[m][16*(j - nb0) + col] = sum_k a[m][k] * W[16j + col][k]   (dequantized)
// for panels j in [nb0, nb1) of one packed matrix and rows m < rows.
#pragma once

#include <cstdint>

#include "expert_service/kernels/packed.h"
#include "expert_service/kernels/tuning.h"

namespace hmoe::kern {

struct GemmArgs {
  const PackedGeom* g = nullptr;
  const uint8_t* w = nullptr;  // panel 0 of the matrix
  int64_t nb0 = 0, nb1 = 0;
  const void* a = nullptr;  // rows of Kp bf16 or int8 (zero-padded past K)
  int64_t lda = 0;          // bytes between rows
  // AMX kernels only: A in the tile layout. Rows come in blocks of 16; block b
  // starts at a + 16 * b * lda and holds its k steps (64 bytes of each row:
  // 32 bf16 or 64 int8) one after another, 1 KiB each, row i of the block at
  // +64 i: every A tile is one contiguous KiB.
  bool a_tiled = false;
  int m = 0;                        // rows; rows up to roundup(m, 32) exist and are zero past m
  const float* a_scale = nullptr;   // int8 activations: per row
  const int32_t* a_gsum = nullptr;  // int4 "few": per row, per group: sum of the int8 activations
  int64_t gsum_stride = 0;          // int32 elements between rows of a_gsum
  float* c = nullptr;               // roundup(m, 32) rows; rows >= m may be left unwritten
  int64_t ldc = 0;                  // floats between rows of c
  uint8_t* scratch = nullptr;       // scratch_bytes (>= kGemmScratchBytes), 64-byte aligned
  int64_t scratch_bytes = 0;
  // Optional hint (AMX kernels with prefetch on, order 1): the caller's next task,
  // panels [next_nb0, next_nb1) of the matrix at next_w with geometry next_g
  // (same format); its first K chunk is prefetched into L2 during this
  // call's last one. Never read through, only prefetched.
  const PackedGeom* next_g = nullptr;
  const uint8_t* next_w = nullptr;
  int64_t next_nb0 = 0, next_nb1 = 0;
  // Loop orders, chunk sizes and prefetch distances (tuning.h); null: the
  // defaults. Speed only: every setting computes the same c.
  const KernelTuning* tuning = nullptr;
  const KernelTuning& tune() const { return tuning != nullptr ? *tuning : kDefaultKernelTuning; }
};
inline constexpr int64_t kGemmScratchBytes = 128 * 1024;

using GemmFn = void (*)(const GemmArgs&);

struct KernelSet {
  GemmFn bf16 = nullptr;     // bf16 weights, bf16 activations
  GemmFn i8 = nullptr;       // int8 weights, int8 activations
  GemmFn i4_i8 = nullptr;    // int4 weights, int8 activations (per-group int32 sums)
  GemmFn i4_bf16 = nullptr;  // int4 weights as bf16(q * s), bf16 activations
  // out[i] = SiLU(g[i]) * u[i]; f32 or rounded to bf16.
  void (*silu_mul)(const float* g, const float* u, int64_t n, float* out) = nullptr;
  void (*silu_mul_bf16)(const float* g, const float* u, int64_t n, uint16_t* out) = nullptr;
  // Per-row symmetric int8 quantization (moe.h numerics): s = amax / 127,
  // q = clamp(rne(x * (1 / s)), -127, 127), zero-filled from n to kp; when
  // gsum is set, gsum[g] = sum of q over [g * group, (g + 1) * group), g < kp / group.
  void (*quant_bf16)(const uint16_t* x, int64_t n, int64_t kp, int8_t* q, float* scale,
                     int32_t* gsum, int group) = nullptr;
  float (*amax_f32)(const float* x, int64_t n) = nullptr;
  void (*quant_f32)(const float* x, int64_t n, int64_t kp, float inv, int8_t* q, int32_t* gsum,
                    int group) = nullptr;
  // dst[r][0..n) = src[r][0..n) for r < rows (lds/ldd in floats). Written with
  // streaming stores where aligned (output read only much later), fenced.
  void (*store_rows)(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                     int64_t n) = nullptr;
  // Writes one 16-row block of the tile layout (GemmArgs::a_tiled) at `block`
  // (16 * kbytes bytes, 64-byte aligned): row i is n bytes from rows[i]
  // (nullptr: zeros), zero-filled to kbytes (a multiple of 64). `stream`:
  // streaming stores where the ISA has them, fenced.
  void (*pack_tiled_block)(const uint8_t* const* rows, int64_t n, int64_t kbytes, uint8_t* block,
                           bool stream) = nullptr;
  // out[i] = sum_{j < n} w[j] * rows[j][i] for i < len, the j terms added in
  // order from 0 (n = 0: zeros). Reads the n rows side by side (as many
  // memory streams in flight). `stream`: streaming stores where out is
  // 64-byte aligned (the output is not read again soon), fenced.
  void (*weighted_sum)(const float* const* rows, const float* w, int n, int64_t len, float* out,
                       bool stream) = nullptr;
  // Native formats (packed.h; the kernel reads GemmArgs::g->format), bf16
  // activations. "few": per scale group, sum_k x * value (the exact element
  // value) in f32, times the group's scale; "many": weights as bf16(value *
  // scale), as bf16 weights. Dequantized formats' rules in moe.h.
  GemmFn native = nullptr;
  GemmFn native_bf16 = nullptr;
};

// Shared scalar helpers (kernels_scalar.cc) for ISA files that reuse them.
void QuantBf16Scalar(const uint16_t* x, int64_t n, int64_t kp, int8_t* q, float* scale,
                     int32_t* gsum, int group);
float AmaxF32Scalar(const float* x, int64_t n);
void QuantF32Scalar(const float* x, int64_t n, int64_t kp, float inv, int8_t* q, int32_t* gsum,
                    int group);
void SiluMulScalar(const float* g, const float* u, int64_t n, float* out);
void SiluMulBf16Scalar(const float* g, const float* u, int64_t n, uint16_t* out);
void StoreRowsScalar(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                     int64_t n);
void PackTiledBlockScalar(const uint8_t* const* rows, int64_t n, int64_t kbytes, uint8_t* block,
                          bool stream);
void WeightedSumScalar(const float* const* rows, const float* w, int n, int64_t len, float* out,
                       bool stream);

const KernelSet& ScalarKernels();
const KernelSet& Avx2Kernels();
const KernelSet& Avx512Kernels();
const KernelSet& AmxKernels();  // "many" kernels; silu from AVX-512
// The AMX kernels run on a software model of the tile registers (needs
// AVX-512 for the epilogues): lets CI without AMX test the AMX code path.
const KernelSet& AmxEmulatedKernels();

// AVX-512 helpers shared with the AMX file: int4 panel lines for k in
// [k0, k1) (multiples of the group) -> bf16(q * s) in the BF16 panel layout
// ((k1 - k0) / 2 lines of 64 B at out).
void DequantI4PanelBf16Avx512(const PackedGeom& g, const uint8_t* panel, int64_t k0, int64_t k1,
                              uint16_t* out);
// The AVX-512 bf16 kernel over an already-bf16 panel set (used for int4 "many"
// without AMX): panels at `w` with `panel_bytes` stride, kp = K extent.
void GemmBf16PanelsAvx512(const GemmArgs& a, const uint8_t* w, int64_t panel_bytes, int64_t kp);

// Native formats, AVX-512 (shared with the AMX file): panel lines for k in
// [k0, k1) (multiples of the scale group) -> bf16(value * scale) in the BF16
// panel layout ((k1 - k0) / 2 lines of 64 B at out).
void DequantNativePanelBf16Avx512(const PackedGeom& g, const uint8_t* panel, int64_t k0, int64_t k1,
                                  uint16_t* out);

// Probes for the benchmark (only call after dispatch says the ISA is there).
// Streams `bytes` (multiple of 256) with AVX-512 loads; returns a checksum.
uint64_t StreamReadAvx512(const uint8_t* p, int64_t bytes);
// Register-only AMX loop: `iters` x 8 tile dot-products (16x16x32 bf16 or
// 16x16x64 int8). Returns nothing useful; time it.
void AmxPeakLoop(int64_t iters, bool int8);

// The bf16 bits of each 4-bit code's value, indexed by the code: e2m1
// (kMxfp4: bit 3 the sign, then 0, .5, 1, 1.5, 2, 3, 4, 6) or two's
// complement int4 (the int4 formats: 0..7, then -8..-1). Kernels that
// look values up by code read these; tests check them against the
// reference decoders (common/dtype.h).
inline constexpr uint16_t kE2M1Bf16[16] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
                                           0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0,
                                           0xC000, 0xC040, 0xC080, 0xC0C0};
inline constexpr uint16_t kInt4Bf16[16] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
                                           0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0,
                                           0xC080, 0xC040, 0xC000, 0xBF80};
constexpr const uint16_t* FourBitBf16Table(WeightFormat f) {
  return f == WeightFormat::kMxfp4 ? kE2M1Bf16 : kInt4Bf16;
}

}  // namespace hmoe::kern
