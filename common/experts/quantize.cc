#include "common/experts/quantize.h"

#include <cmath>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "common/status.h"

namespace hmoe {

float QuantMatrix::At(int64_t r, int64_t c) const {
  switch (format) {
    case WeightFormat::kBf16:
      return Bf16ToF32(bf16[static_cast<size_t>(r * cols + c)]);
    case WeightFormat::kInt8:
      return static_cast<float>(q[static_cast<size_t>(r * cols + c)]) *
             scale[static_cast<size_t>(r)];
    case WeightFormat::kInt4: {
      const int64_t ng = ScalesPerRow(format, group, cols);
      return static_cast<float>(q[static_cast<size_t>(r * cols + c)]) *
             scale[static_cast<size_t>(r * ng + c / group)];
    }
  }
  return 0.0f;
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

// The quantizers per format: the kernels of each format's quantization.
QuantMatrix Quantize(const float* w, int64_t rows, int64_t cols, WeightFormat f, int group) {
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
  }
  return m;
}

}  // namespace

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
  const int64_t is = (o.i_end < 0 ? I : o.i_end) - o.i_begin;
  ASSIGN_OR_RETURN(auto gate, MatrixF32(w.gate, w.gate_scale_inv, src.fp8_block, I, H, "gate"));
  ASSIGN_OR_RETURN(auto up, MatrixF32(w.up, w.up_scale_inv, src.fp8_block, I, H, "up"));
  ASSIGN_OR_RETURN(auto down, MatrixF32(w.down, w.down_scale_inv, src.fp8_block, H, I, "down"));
  std::vector<float> ds(static_cast<size_t>(H * is));
  for (int64_t r = 0; r < H; ++r)
    std::memcpy(&ds[static_cast<size_t>(r * is)], &down[static_cast<size_t>(r * I + o.i_begin)],
                sizeof(float) * static_cast<size_t>(is));
  QuantExpert q;
  q.gate = Quantize(gate.data() + o.i_begin * H, is, H, o.format, o.group);
  q.up = Quantize(up.data() + o.i_begin * H, is, H, o.format, o.group);
  q.down = Quantize(ds.data(), H, is, o.format, o.group);
  return q;
}

}  // namespace hmoe
