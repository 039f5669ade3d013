#include "gpu_worker/cpu/dense_weights.h"

#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"
#include "common/weight_map.h"

namespace hmoe::cpu {
namespace {

constexpr int kDenseGroup = 128;  // fp8 block edge, int4 group

}  // namespace

WeightLoad WeightLoadFor(const ModelConfig& config, DenseWeights weights) {
  WeightLoad l;
  l.fp8_block = config.quantization.method == "fp8" ? config.quantization.weight_block[0] : 0;
  switch (weights) {
    case DenseWeights::kAuto:
      l.keep_fp8 = l.fp8_block == kDenseGroup;
      break;
    case DenseWeights::kBf16:
      break;
    case DenseWeights::kFp8:
      l.format = WeightFormat::kFp8;
      l.group = kDenseGroup;
      break;
    case DenseWeights::kInt8:
      l.format = WeightFormat::kInt8;
      break;
    case DenseWeights::kInt4:
      l.format = WeightFormat::kInt4;
      l.group = kDenseGroup;
      break;
  }
  return l;
}

absl::StatusOr<QuantMatrix> LoadDenseMatrix(const Checkpoint& ckpt, const std::string& name,
                                            const WeightLoad& load) {
  ASSIGN_OR_RETURN(Tensor t, ckpt.Get(name));
  const bool want_fp8 = load.format == WeightFormat::kFp8 || load.keep_fp8;
  if (t.dtype() == DType::kF8E4M3 && want_fp8 && load.fp8_block == kDenseGroup && t.rank() == 2) {
    const std::string sname = ScaleInvName(name);
    ASSIGN_OR_RETURN(Tensor s, ckpt.Get(sname));
    return NativeMatrix(t, s, WeightFormat::kFp8, kDenseGroup, t.dim(0), t.dim(1),
                        absl::StrCat(ckpt.dir(), ": ", name));
  }
  ASSIGN_OR_RETURN(Matrix m, LoadMatrix(ckpt, name, load.fp8_block));
  const int64_t R = m.rows, C = m.cols;
  if (load.format == WeightFormat::kBf16) {
    QuantMatrix q;
    q.rows = R;
    q.cols = C;
    if (m.bf16 != nullptr) {
      q.bf16.assign(m.bf16, m.bf16 + R * C);
    } else {
      q.bf16.resize(static_cast<size_t>(R * C));
      for (int64_t i = 0; i < R * C; ++i) q.bf16[static_cast<size_t>(i)] = F32ToBf16(m.f32[i]);
    }
    return q;
  }
  std::vector<float> w(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r) m.RowToF32(r, w.data() + r * C);
  for (size_t i = 0; i < w.size(); ++i)
    if (!std::isfinite(w[i]))
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.dir(), ": ", name, ": element [", static_cast<int64_t>(i) / C, ", ",
          static_cast<int64_t>(i) % C, "] is ", w[i], "; weights to quantize must be finite"));
  return QuantizeMatrix(w.data(), R, C, load.format, load.group);
}

std::vector<uint8_t> DenseCodes(const QuantMatrix& m) {
  switch (m.format) {
    case WeightFormat::kFp8:
      return m.packed;
    case WeightFormat::kInt8:
      return std::vector<uint8_t>(m.q.begin(), m.q.end());
    case WeightFormat::kInt4: {
      const int64_t rb = (m.cols + 1) / 2;
      std::vector<uint8_t> out(static_cast<size_t>(m.rows * rb), 0);
      for (int64_t r = 0; r < m.rows; ++r)
        for (int64_t c = 0; c < m.cols; ++c)
          out[static_cast<size_t>(r * rb + c / 2)] |= static_cast<uint8_t>(
              (static_cast<uint8_t>(m.q[static_cast<size_t>(r * m.cols + c)]) & 15u)
              << (4 * (c % 2)));
      return out;
    }
    default:
      return {};
  }
}

absl::StatusOr<Matrix> LoadDenseAsMatrix(const Checkpoint& ckpt, const std::string& name,
                                         const WeightLoad& load) {
  if (load.format == WeightFormat::kBf16) return LoadMatrix(ckpt, name, load.fp8_block);
  ASSIGN_OR_RETURN(QuantMatrix q, LoadDenseMatrix(ckpt, name, load));
  auto v = std::make_shared<std::vector<float>>(static_cast<size_t>(q.rows * q.cols));
  for (int64_t r = 0; r < q.rows; ++r) q.DequantizeRow(r, v->data() + r * q.cols);
  Matrix m;
  m.rows = q.rows;
  m.cols = q.cols;
  m.f32 = v->data();
  m.owner = v;
  return m;
}

}  // namespace hmoe::cpu
