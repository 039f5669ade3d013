#include "common/experts/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "common/status.h"

namespace hmoe {

namespace {

// The 4- or 8-bit code of weight (r, c) in `m.packed`.
uint8_t CodeAt(const QuantMatrix& m, int64_t r, int64_t c) {
  const int64_t rb = RowBytes(m.format, m.cols);
  if (Traits(m.format).bits == 8) return m.packed[static_cast<size_t>(r * rb + c)];
  const uint8_t b = m.packed[static_cast<size_t>(r * rb + c / 2)];
  return static_cast<uint8_t>((c & 1) ? b >> 4 : b & 0xF);
}

}  // namespace

float QuantMatrix::ScaleAt(int64_t r, int64_t c) const {
  const size_t i = static_cast<size_t>(ScaleIndex(format, group, cols, r, c));
  switch (Traits(format).scale_type) {
    case ScaleType::kNone:
      return 1.0f;
    case ScaleType::kF32:
      return scale[i];
    case ScaleType::kBf16:
      return Bf16ToF32(scale_bf16[i]);
    case ScaleType::kE8M0:
      return E8M0ToF32(scale_e8m0[i]);
  }
  return 0.0f;
}

float QuantMatrix::At(int64_t r, int64_t c) const {
  switch (format) {
    case WeightFormat::kBf16:
      return Bf16ToF32(bf16[static_cast<size_t>(r * cols + c)]);
    case WeightFormat::kInt8:
    case WeightFormat::kInt4:
      return static_cast<float>(q[static_cast<size_t>(r * cols + c)]) * ScaleAt(r, c);
    case WeightFormat::kInt4Bf16: {
      const int v = CodeAt(*this, r, c);
      return static_cast<float>(v >= 8 ? v - 16 : v) * ScaleAt(r, c);
    }
    case WeightFormat::kMxfp4:
      return E2M1ToF32(CodeAt(*this, r, c)) * ScaleAt(r, c);
    case WeightFormat::kFp8:
    case WeightFormat::kMxfp8:
      return Fp8E4M3ToF32(CodeAt(*this, r, c)) * ScaleAt(r, c);
  }
  return 0.0f;
}

void QuantMatrix::DequantizeRow(int64_t r, float* out) const {
  for (int64_t c = 0; c < cols; ++c) out[c] = At(r, c);
}

namespace {

// A NaN or infinite weight (a corrupt checkpoint, an fp8 NaN code, an
// overflowing scale) would poison every scale it shares: refused, located.
absl::Status CheckFinite(const std::vector<float>& w, int64_t cols, std::string_view name) {
  for (size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(name), ": element [", static_cast<int64_t>(i) / cols, ", ",
                       static_cast<int64_t>(i) % cols, "] is ", w[i], "; weights must be finite"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> MatrixF32(const Tensor& t, const Tensor& scale_inv,
                                             int64_t block, int64_t rows, int64_t cols,
                                             std::string_view name) {
  if (t.rank() != 2 || t.dim(0) != rows || t.dim(1) != cols)
    return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": expected shape [", rows,
                                                   ", ", cols, "], got ", ShapeString(t.shape())));
  if (t.dtype() == DType::kF8E4M3) {
    if (block <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat(std::string(name), ": fp8 block size must be > 0, got ", block));
    const int64_t br = (rows + block - 1) / block, bc = (cols + block - 1) / block;
    if (scale_inv.empty() || scale_inv.dtype() != DType::kF32 || scale_inv.rank() != 2 ||
        scale_inv.dim(0) != br || scale_inv.dim(1) != bc)
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(name), ": fp8 weight needs an f32 scale_inv of [", br, ", ", bc, "], got ",
          scale_inv.empty() ? std::string("none") : ShapeString(scale_inv.shape())));
    if (!t.contiguous() || !scale_inv.contiguous())
      return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": must be contiguous"));
    std::vector<float> out(static_cast<size_t>(rows * cols));
    DequantFp8BlockToF32(t.data<uint8_t>(), rows, cols, scale_inv.data<float>(), block, out.data());
    RETURN_IF_ERROR(CheckFinite(out, cols, name));
    return out;
  }
  if (t.dtype() != DType::kBF16 && t.dtype() != DType::kF32 && t.dtype() != DType::kF16)
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(name), ": unsupported dtype ", std::string(DTypeName(t.dtype()))));
  std::vector<float> out = t.ToF32();
  RETURN_IF_ERROR(CheckFinite(out, cols, name));
  return out;
}

void SetCode(QuantMatrix* m, int64_t r, int64_t c, uint8_t code) {
  const int64_t rb = RowBytes(m->format, m->cols);
  if (Traits(m->format).bits == 8) {
    m->packed[static_cast<size_t>(r * rb + c)] = code;
    return;
  }
  uint8_t& b = m->packed[static_cast<size_t>(r * rb + c / 2)];
  b = (c & 1) ? static_cast<uint8_t>((b & 0x0F) | (code << 4))
              : static_cast<uint8_t>((b & 0xF0) | (code & 0x0F));
}

// The e8m0 scale exponent e of an MX block whose largest |w| is `amax`:
// the smallest power of two X = 2^e with amax / X <= the element's max (6
// for e2m1, 448 for e4m3), so nothing clips (the OCP spec's example takes
// floor(log2(amax)) - emax_elem, which may clip the block's largest
// weights), clamped to the e8m0 range; an all-zero block gets 2^-127.
int MxScaleExponent(float amax, WeightFormat f) {
  if (!(amax > 0.0f)) return -127;
  const bool fp4 = f == WeightFormat::kMxfp4;
  const int emax_elem = fp4 ? 2 : 8;  // e2m1: 6 = 1.5 * 2^2; e4m3: 448 = 1.75 * 2^8
  const float max_elem = fp4 ? 6.0f : 448.0f;
  int fe;
  std::frexp(amax, &fe);       // amax in [2^(fe-1), 2^fe)
  int e = fe - 1 - emax_elem;  // amax / 2^e in [2^emax_elem, 2^(emax_elem + 1))
  if (std::ldexp(amax, -e) > max_elem) ++e;
  return std::clamp(e, -127, 127);
}

// OCP Microscaling: per block of `group` cols one scale 2^MxScaleExponent
// of the block's max |w|; each element w / 2^e rounded to nearest even.
void QuantizeMx(const float* w, QuantMatrix* m) {
  const bool fp4 = m->format == WeightFormat::kMxfp4;
  const int64_t spr = ScalesPerRow(m->format, m->group, m->cols);
  m->packed.assign(static_cast<size_t>(m->rows * RowBytes(m->format, m->cols)), 0);
  m->scale_e8m0.assign(static_cast<size_t>(m->rows * spr), 0);
  for (int64_t r = 0; r < m->rows; ++r)
    for (int64_t g = 0; g < spr; ++g) {
      const int64_t c0 = g * m->group, c1 = std::min(m->cols, c0 + m->group);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * m->cols + c]));
      const int e = MxScaleExponent(amax, m->format);
      m->scale_e8m0[static_cast<size_t>(r * spr + g)] = static_cast<uint8_t>(e + 127);
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::ldexp(w[r * m->cols + c], -e);
        SetCode(m, r, c, fp4 ? F32ToE2M1(v) : F32ToFp8E4M3(v));
      }
    }
}

// compressed-tensors symmetric int4: scale = bf16(max|w| / 7.5) per group,
// q = clamp(round_half_even(w / scale), -8, 7); a zero scale gets zeros.
void QuantizeInt4Bf16(const float* w, QuantMatrix* m) {
  const int64_t spr = ScalesPerRow(m->format, m->group, m->cols);
  m->packed.assign(static_cast<size_t>(m->rows * RowBytes(m->format, m->cols)), 0);
  m->scale_bf16.assign(static_cast<size_t>(m->rows * spr), 0);
  for (int64_t r = 0; r < m->rows; ++r)
    for (int64_t g = 0; g < spr; ++g) {
      const int64_t c0 = g * m->group, c1 = std::min(m->cols, c0 + m->group);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * m->cols + c]));
      const uint16_t sb = F32ToBf16(amax / 7.5f);
      const float s = Bf16ToF32(sb);
      const bool zero = !(s >= std::numeric_limits<float>::min());
      m->scale_bf16[static_cast<size_t>(r * spr + g)] = zero ? 0 : sb;
      for (int64_t c = c0; c < c1; ++c) {
        const float q = zero ? 0.0f : std::nearbyint(w[r * m->cols + c] / s);
        SetCode(m, r, c, static_cast<uint8_t>(static_cast<int>(std::clamp(q, -8.0f, 7.0f)) & 0xF));
      }
    }
}

// DeepSeek-V3 fp8: per group x group block, scale = max|w| / 448 (f32) and
// each element e4m3(w / scale), saturating; a zero scale gets zeros.
void QuantizeFp8Block(const float* w, QuantMatrix* m) {
  const int64_t b = m->group, br = ScaleRows(m->format, b, m->rows);
  const int64_t bc = ScalesPerRow(m->format, b, m->cols);
  m->packed.assign(static_cast<size_t>(m->rows * m->cols), 0);
  m->scale.assign(static_cast<size_t>(br * bc), 0.0f);
  for (int64_t i = 0; i < br; ++i)
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r1 = std::min(m->rows, (i + 1) * b), c1 = std::min(m->cols, (j + 1) * b);
      float amax = 0.0f;
      for (int64_t r = i * b; r < r1; ++r)
        for (int64_t c = j * b; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * m->cols + c]));
      float s = amax / 448.0f;
      if (!(s >= std::numeric_limits<float>::min())) s = 0.0f;
      m->scale[static_cast<size_t>(i * bc + j)] = s;
      for (int64_t r = i * b; r < r1; ++r)
        for (int64_t c = j * b; c < c1; ++c)
          SetCode(m, r, c, s == 0.0f ? 0 : F32ToFp8E4M3(w[r * m->cols + c] / s));
    }
}

}  // namespace

QuantMatrix QuantizeMatrix(const float* w, int64_t rows, int64_t cols, WeightFormat f, int group) {
  QuantMatrix m;
  m.format = f;
  m.group = IsGrouped(f) ? group : 0;
  m.rows = rows;
  m.cols = cols;
  const size_t n = static_cast<size_t>(rows * cols);
  switch (f) {
    case WeightFormat::kBf16:
      m.bf16.resize(n);
      for (size_t i = 0; i < n; ++i) m.bf16[i] = F32ToBf16(w[i]);
      break;
    case WeightFormat::kInt8:
      m.q.resize(n);
      m.scale.resize(static_cast<size_t>(rows));
      QuantizeI8PerRow(w, rows, cols, m.q.data(), m.scale.data());
      break;
    case WeightFormat::kInt4: {
      const int64_t ng = ScalesPerRow(f, group, cols), cp = ng * group;
      std::vector<float> padded(static_cast<size_t>(rows * cp), 0.0f);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(&padded[static_cast<size_t>(r * cp)], w + r * cols,
                    sizeof(float) * static_cast<size_t>(cols));
      std::vector<uint8_t> packed(static_cast<size_t>(DTypeBytes(DType::kI4, rows * cp)));
      m.scale.resize(static_cast<size_t>(rows * ng));
      QuantizeI4PerGroup(padded.data(), rows, cp, group, packed.data(), m.scale.data());
      m.q.resize(n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          m.q[static_cast<size_t>(r * cols + c)] = UnpackI4(packed.data(), r * cp + c);
      break;
    }
    case WeightFormat::kMxfp4:
    case WeightFormat::kMxfp8:
      QuantizeMx(w, &m);
      break;
    case WeightFormat::kInt4Bf16:
      QuantizeInt4Bf16(w, &m);
      break;
    case WeightFormat::kFp8:
      QuantizeFp8Block(w, &m);
      break;
  }
  return m;
}

namespace {

std::string Shape2(int64_t a, int64_t b) { return absl::StrCat("[", a, ", ", b, "]"); }

// Whether `s` is an e8m0 scale tensor's dtype (U8 as gpt-oss stores it, or
// safetensors' F8_E8M0).
bool IsE8M0Dtype(DType d) { return d == DType::kU8 || d == DType::kF8E8M0; }

// The scales of `s` into `m` in the format's scale type; `s` already checked.
absl::Status CopyScales(const Tensor& s, std::string_view name, QuantMatrix* m) {
  const size_t n = static_cast<size_t>(s.numel());
  switch (Traits(m->format).scale_type) {
    case ScaleType::kF32:
      m->scale.assign(s.data<float>(), s.data<float>() + n);
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(m->scale[i]))
          return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": scale ", i, " is ",
                                                         m->scale[i], "; scales must be finite"));
      return absl::OkStatus();
    case ScaleType::kBf16:
      m->scale_bf16.assign(s.data<uint16_t>(), s.data<uint16_t>() + n);
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(Bf16ToF32(m->scale_bf16[i])))
          return absl::InvalidArgumentError(absl::StrCat(std::string(name), ": scale ", i, " is ",
                                                         Bf16ToF32(m->scale_bf16[i]),
                                                         "; scales must be finite"));
      return absl::OkStatus();
    case ScaleType::kE8M0:
      m->scale_e8m0.assign(s.data<uint8_t>(), s.data<uint8_t>() + n);
      for (size_t i = 0; i < n; ++i)
        if (m->scale_e8m0[i] == kE8M0NaN)
          return absl::InvalidArgumentError(
              absl::StrCat(std::string(name), ": scale ", i, " is 0xFF, the e8m0 NaN"));
      return absl::OkStatus();
    case ScaleType::kNone:
      break;
  }
  return absl::OkStatus();
}

// Copies [r0, r1) x [c0, c1) of native `m` (c0 on a byte boundary).
QuantMatrix SliceNative(const QuantMatrix& m, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  QuantMatrix out;
  out.format = m.format;
  out.group = m.group;
  out.rows = r1 - r0;
  out.cols = c1 - c0;
  const int bits = Traits(m.format).bits;
  const int64_t rb = RowBytes(m.format, m.cols), ob = RowBytes(m.format, out.cols);
  out.packed.assign(static_cast<size_t>(out.rows * ob), 0);
  for (int64_t r = 0; r < out.rows; ++r) {
    std::memcpy(&out.packed[static_cast<size_t>(r * ob)],
                &m.packed[static_cast<size_t>((r0 + r) * rb + c0 * bits / 8)],
                static_cast<size_t>(ob));
    if (bits == 4 && (out.cols & 1)) out.packed[static_cast<size_t>(r * ob + ob - 1)] &= 0x0F;
  }
  const int64_t s_r0 = ScaleRows(m.format, m.group, r0), s_c0 = ScalesPerRow(m.format, m.group, c0);
  const int64_t s_rows = ScaleRows(m.format, m.group, r1) - s_r0;
  const int64_t s_cols = ScalesPerRow(m.format, m.group, c1) - s_c0;
  const int64_t ld = ScalesPerRow(m.format, m.group, m.cols);
  auto copy = [&](const auto& from, auto& to) {
    to.clear();
    if (from.empty()) return;
    for (int64_t r = 0; r < s_rows; ++r)
      for (int64_t c = 0; c < s_cols; ++c)
        to.push_back(from[static_cast<size_t>((s_r0 + r) * ld + s_c0 + c)]);
  };
  copy(m.scale, out.scale);
  copy(m.scale_bf16, out.scale_bf16);
  copy(m.scale_e8m0, out.scale_e8m0);
  return out;
}

// Native matrix `name`'s slice [r0, r1) x [c0, c1): the scale blocks must not
// straddle the cut.
absl::StatusOr<QuantMatrix> NativeSlice(const Tensor& t, const Tensor& s, WeightFormat f, int group,
                                        int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                                        int64_t c0, int64_t c1, std::string_view name) {
  ASSIGN_OR_RETURN(QuantMatrix m, NativeMatrix(t, s, f, group, rows, cols, name));
  if (r0 == 0 && r1 == rows && c0 == 0 && c1 == cols) return m;
  const bool block2d = Traits(f).scale_block == ScaleBlock::kBlock2D;
  auto cut_ok = [&](int64_t at, int64_t end, bool blocked) {
    return at == 0 || at == end || !blocked || at % group == 0;
  };
  if (!cut_ok(r0, rows, block2d) || !cut_ok(r1, rows, block2d) || !cut_ok(c0, cols, true) ||
      !cut_ok(c1, cols, true))
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(name), ": the slice [", r0, ", ", r1, ") x [", c0, ", ", c1,
                     ") of ", WeightFormatName(f, group), " ", Shape2(rows, cols),
                     " cuts its scale blocks of ", group, "; shard on multiples of ", group));
  return SliceNative(m, r0, r1, c0, c1);
}

}  // namespace

absl::StatusOr<QuantMatrix> NativeMatrix(const Tensor& t, const Tensor& s, WeightFormat f,
                                         int group, int64_t rows, int64_t cols,
                                         std::string_view name) {
  const std::string n(name);
  if (!IsWeightFormat(f) || f == WeightFormat::kBf16 || f == WeightFormat::kInt8 ||
      f == WeightFormat::kInt4)
    return absl::InvalidArgumentError(absl::StrCat(n, ": ", std::string(WeightFormatName(f)),
                                                   " is not a checkpoint's native format"));
  RETURN_IF_ERROR(CheckGroup(f, group));
  QuantMatrix m;
  m.format = f;
  m.group = group;
  m.rows = rows;
  m.cols = cols;
  // The codes: dtype and shape as stored.
  bool codes_ok = t.contiguous();
  std::string want;
  switch (f) {
    case WeightFormat::kMxfp4:
      want = absl::StrCat("U8 ", Shape2(rows, cols / 2), " or [", rows, ", ", cols / 32, ", 16]");
      codes_ok = codes_ok && cols % 32 == 0 &&
                 (t.dtype() == DType::kU8 || t.dtype() == DType::kI8) &&
                 ((t.rank() == 2 && t.dim(0) == rows && t.dim(1) == cols / 2) ||
                  (t.rank() == 3 && t.dim(0) == rows && t.dim(1) == cols / 32 && t.dim(2) == 16));
      break;
    case WeightFormat::kInt4Bf16:
      want = absl::StrCat("I32 ", Shape2(rows, (cols + 7) / 8));
      codes_ok = codes_ok && t.dtype() == DType::kI32 && t.rank() == 2 && t.dim(0) == rows &&
                 t.dim(1) == (cols + 7) / 8;
      break;
    default:  // kFp8, kMxfp8
      want = absl::StrCat("F8_E4M3 ", Shape2(rows, cols));
      codes_ok = codes_ok && t.dtype() == DType::kF8E4M3 && t.rank() == 2 && t.dim(0) == rows &&
                 t.dim(1) == cols;
      break;
  }
  if (!codes_ok)
    return absl::InvalidArgumentError(absl::StrCat(
        n, ": ", WeightFormatName(f, group), " codes must be ", want, ", got ",
        DTypeName(t.dtype()), " ", ShapeString(t.shape()), t.contiguous() ? "" : " (strided)"));
  const int64_t srows = ScaleRows(f, group, rows), scols = ScalesPerRow(f, group, cols);
  const ScaleType st = Traits(f).scale_type;
  const bool sdtype_ok = st == ScaleType::kF32    ? s.dtype() == DType::kF32
                         : st == ScaleType::kBf16 ? s.dtype() == DType::kBF16
                                                  : IsE8M0Dtype(s.dtype());
  if (s.empty() || !sdtype_ok || !s.contiguous() || s.rank() != 2 || s.dim(0) != srows ||
      s.dim(1) != scols)
    return absl::InvalidArgumentError(
        absl::StrCat(n, ": ", WeightFormatName(f, group), " scales must be ",
                     st == ScaleType::kF32    ? "F32"
                     : st == ScaleType::kBf16 ? "BF16"
                                              : "F8_E8M0 / U8",
                     " ", Shape2(srows, scols), ", got ",
                     s.empty() ? std::string("none")
                               : absl::StrCat(DTypeName(s.dtype()), " ", ShapeString(s.shape()))));
  const int64_t rb = RowBytes(f, cols);
  m.packed.resize(static_cast<size_t>(rows * rb));
  if (f == WeightFormat::kInt4Bf16) {
    // Offset-binary nibbles (q + 8) to two's complement (q): flip each top bit.
    const int64_t stride = (cols + 7) / 8 * 4;
    const uint8_t* src = static_cast<const uint8_t*>(t.raw());
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* dst = &m.packed[static_cast<size_t>(r * rb)];
      for (int64_t b = 0; b < rb; ++b) dst[b] = static_cast<uint8_t>(src[r * stride + b] ^ 0x88);
      if (cols & 1) dst[rb - 1] &= 0x0F;
    }
  } else {
    std::memcpy(m.packed.data(), t.raw(), m.packed.size());
  }
  RETURN_IF_ERROR(CopyScales(s, name, &m));
  return m;
}

absl::Status CheckQuantOptions(const QuantOptions& o, int64_t hidden, int64_t inter,
                               int64_t experts) {
  const int64_t i1 = o.i_end < 0 ? inter : o.i_end;
  if (hidden <= 0 || inter <= 0 || experts <= 0)
    return absl::InvalidArgumentError("hidden, intermediate and num_experts must be > 0");
  if (o.i_begin < 0 || o.i_begin >= i1 || i1 > inter)
    return absl::InvalidArgumentError(
        absl::StrCat("bad intermediate slice [", o.i_begin, ", ", i1, ") of ", inter));
  if (!IsWeightFormat(o.format))
    return absl::InvalidArgumentError(
        absl::StrCat("format code ", static_cast<int>(o.format), " is no weight format"));
  return CheckGroup(o.format, o.group);
}

absl::StatusOr<QuantExpert> QuantizeExpert(const ExpertWeights& w, const MoeWeightsSource& src,
                                           const QuantOptions& o) {
  RETURN_IF_ERROR(CheckQuantOptions(o, src.hidden, src.intermediate, src.num_experts));
  const int64_t H = src.hidden, I = src.intermediate;
  const int64_t i1 = o.i_end < 0 ? I : o.i_end, is = i1 - o.i_begin;
  if (w.format != WeightFormat::kBf16 && w.format == o.format && w.group == o.group) {
    // Kept as stored: no second rounding.
    QuantExpert q;
    ASSIGN_OR_RETURN(q.gate, NativeSlice(w.gate, w.gate_scale_inv, w.format, w.group, I, H,
                                         o.i_begin, i1, 0, H, "gate"));
    ASSIGN_OR_RETURN(q.up, NativeSlice(w.up, w.up_scale_inv, w.format, w.group, I, H, o.i_begin, i1,
                                       0, H, "up"));
    ASSIGN_OR_RETURN(q.down, NativeSlice(w.down, w.down_scale_inv, w.format, w.group, H, I, 0, H,
                                         o.i_begin, i1, "down"));
    return q;
  }
  auto f32 = [&](const Tensor& t, const Tensor& s, int64_t rows, int64_t cols,
                 std::string_view name) -> absl::StatusOr<std::vector<float>> {
    if (w.format == WeightFormat::kBf16) return MatrixF32(t, s, src.fp8_block, rows, cols, name);
    ASSIGN_OR_RETURN(QuantMatrix m, NativeMatrix(t, s, w.format, w.group, rows, cols, name));
    std::vector<float> out(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) m.DequantizeRow(r, &out[static_cast<size_t>(r * cols)]);
    RETURN_IF_ERROR(CheckFinite(out, cols, name));
    return out;
  };
  ASSIGN_OR_RETURN(auto gate, f32(w.gate, w.gate_scale_inv, I, H, "gate"));
  ASSIGN_OR_RETURN(auto up, f32(w.up, w.up_scale_inv, I, H, "up"));
  ASSIGN_OR_RETURN(auto down, f32(w.down, w.down_scale_inv, H, I, "down"));
  std::vector<float> ds(static_cast<size_t>(H * is));
  for (int64_t r = 0; r < H; ++r)
    std::memcpy(&ds[static_cast<size_t>(r * is)], &down[static_cast<size_t>(r * I + o.i_begin)],
                sizeof(float) * static_cast<size_t>(is));
  QuantExpert q;
  q.gate = QuantizeMatrix(gate.data() + o.i_begin * H, is, H, o.format, o.group);
  q.up = QuantizeMatrix(up.data() + o.i_begin * H, is, H, o.format, o.group);
  q.down = QuantizeMatrix(ds.data(), H, is, o.format, o.group);
  return q;
}

}  // namespace hmoe
