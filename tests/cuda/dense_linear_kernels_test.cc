// The dense linear kernels (gpu_worker/cuda/dense_linear_kernels.h) against
// the CPU reference's dequantization (QuantMatrix::At of the same codes) on
// many shapes: odd rows and cols, scale groups cut short, misaligned inputs,
// T = 1..32, and the prefill path's dequantization to bf16.
#include "gpu_worker/cuda/dense_linear_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/experts/quantize.h"
#include "gpu_worker/cpu/dense_weights.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

struct Case {
  WeightFormat format;
  int group;
};
constexpr Case kFormats[] = {
    {WeightFormat::kFp8, 128}, {WeightFormat::kInt8, 0}, {WeightFormat::kInt4, 128}};

// A matrix quantized on the host and its device copy (codes, scales).
struct DevMatrix {
  QuantMatrix q;
  std::unique_ptr<DeviceBuffer<uint8_t>> codes;
  std::unique_ptr<DeviceBuffer<float>> scale;
  DevQuantMatrix View() const {
    return DevQuantMatrix{q.format, q.group, q.rows, q.cols, codes->get(), scale->get()};
  }
};

DevMatrix Make(const Case& f, int64_t rows, int64_t cols, std::mt19937& rng) {
  // Rows of different magnitudes, so that scales differ.
  std::vector<float> w = Random(static_cast<size_t>(rows * cols), rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) w[static_cast<size_t>(r * cols + c)] *= 0.1f + (r % 7);
  DevMatrix m;
  m.q = QuantizeMatrix(w.data(), rows, cols, f.format, f.group);
  m.codes = std::make_unique<DeviceBuffer<uint8_t>>(cpu::DenseCodes(m.q));
  m.scale = std::make_unique<DeviceBuffer<float>>(m.q.scale);
  return m;
}

// y[t * ldy + r] in double from the host's dequantization; |x| . |w| beside.
void Reference(const QuantMatrix& q, const std::vector<uint16_t>& x, int64_t T,
               std::vector<double>* y, std::vector<double>* mag) {
  y->assign(static_cast<size_t>(T * q.rows), 0.0);
  mag->assign(y->size(), 0.0);
  std::vector<float> row(static_cast<size_t>(q.cols));
  for (int64_t r = 0; r < q.rows; ++r) {
    q.DequantizeRow(r, row.data());
    for (int64_t t = 0; t < T; ++t) {
      double s = 0, a = 0;
      for (int64_t c = 0; c < q.cols; ++c) {
        const double p = double{HostBf16ToF(x[static_cast<size_t>(t * q.cols + c)])} * row[c];
        s += p;
        a += std::fabs(p);
      }
      (*y)[static_cast<size_t>(t * q.rows + r)] = s;
      (*mag)[static_cast<size_t>(t * q.rows + r)] = a;
    }
  }
}

// DenseGemv on (rows, cols) at T, y with ldy = rows + pad and x shifted by
// `x_offset` elements, against the reference.
void CheckGemv(const Case& f, int64_t rows, int64_t cols, int64_t T, int64_t pad, int x_offset,
               std::mt19937& rng) {
  const std::string what = std::string(Traits(f.format).name) + " " + std::to_string(rows) + "x" +
                           std::to_string(cols) + " T " + std::to_string(T) + " pad " +
                           std::to_string(pad) + " x+" + std::to_string(x_offset);
  DevMatrix m = Make(f, rows, cols, rng);
  const std::vector<uint16_t> x = RandomBf16(static_cast<size_t>(T * cols), rng);
  std::vector<uint16_t> xs(static_cast<size_t>(x_offset), 0);
  xs.insert(xs.end(), x.begin(), x.end());
  DeviceBuffer<uint16_t> dx(xs);
  const int64_t ldy = rows + pad;
  const float kUnwritten = 12345.0f;
  DeviceBuffer<float> dy(std::vector<float>(static_cast<size_t>(T * ldy), kUnwritten));
  Check(DenseGemv(m.View(), dx.get() + x_offset, T, dy.get(), ldy, nullptr));
  const std::vector<float> y = dy.Download();
  std::vector<double> want, mag;
  Reference(m.q, x, T, &want, &mag);
  int bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = 0; r < ldy; ++r) {
      const float got = y[static_cast<size_t>(t * ldy + r)];
      if (r >= rows) {
        if (got != kUnwritten && ++bad <= 3)
          ADD_FAILURE() << what << ": wrote pad " << t << "," << r;
        continue;
      }
      const double w = want[static_cast<size_t>(t * rows + r)];
      const double tol = 1e-5 * mag[static_cast<size_t>(t * rows + r)] + 1e-30;
      if (!(std::fabs(got - w) <= tol) && ++bad <= 3)
        ADD_FAILURE() << what << ": y[" << t << ", " << r << "] " << got << " want " << w;
    }
  }
}

TEST(DenseLinearKernels, GemvMatchesTheReferenceOnManyShapes) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  // (rows, cols): aligned (16-byte path), odd, groups cut short, one group.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},     {3, 7},      {17, 33},  {130, 200}, {129, 128},  {64, 256},
      {257, 384}, {200, 1000}, {5, 4096}, {300, 96},  {127, 1536}, {33, 7168}};
  for (const Case& f : kFormats)
    for (auto [rows, cols] : shapes)
      for (int64_t T : {1, 2, 3, 5, 8, 13, 16, 17, 31, 32}) CheckGemv(f, rows, cols, T, 0, 0, rng);
}

TEST(DenseLinearKernels, GemvStridedOutputAndMisalignedInput) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  for (const Case& f : kFormats) {
    for (int64_t T : {1, 4, 32}) {
      CheckGemv(f, 96, 512, T, 96, 0, rng);  // the halves of a [T, 2I] gate_up output
      CheckGemv(f, 70, 256, T, 3, 1, rng);   // x not 16-byte aligned: the byte path
    }
  }
}

TEST(DenseLinearKernels, ToBf16IsTheRoundedReferenceWeight) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  for (const Case& f : kFormats) {
    for (auto [rows, cols] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {130, 200}, {300, 129}}) {
      DevMatrix m = Make(f, rows, cols, rng);
      for (auto [row0, n] : std::vector<std::pair<int64_t, int64_t>>{
               {0, rows}, {rows / 2, rows - rows / 2}, {rows - 1, 1}}) {
        DeviceBuffer<uint16_t> out(static_cast<size_t>(n * cols));
        Check(DenseToBf16(m.View(), row0, n, out.get(), nullptr));
        const std::vector<uint16_t> got = out.Download();
        int bad = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t c = 0; c < cols; ++c) {
            const uint16_t want = HostBf16(m.q.At(row0 + i, c));
            if (got[static_cast<size_t>(i * cols + c)] != want && ++bad <= 3)
              ADD_FAILURE() << Traits(f.format).name << " " << rows << "x" << cols << " ["
                            << row0 + i << ", " << c << "]";
          }
      }
    }
  }
}

TEST(DenseLinearKernels, RefusesWhatTheyCannotRun) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  DevMatrix m = Make(kFormats[0], 8, 128, rng);
  DeviceBuffer<uint16_t> x(static_cast<size_t>(33 * 128));
  DeviceBuffer<float> y(static_cast<size_t>(33 * 8));
  EXPECT_EQ(DenseGemv(m.View(), x.get(), 33, y.get(), 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DenseGemv(m.View(), x.get(), 1, y.get(), 7, nullptr), cudaErrorInvalidValue);
  DevQuantMatrix g = m.View();
  g.group = 64;  // fp8 blocks are 128
  EXPECT_EQ(DenseGemv(g, x.get(), 1, y.get(), 8, nullptr), cudaErrorInvalidValue);
  g = m.View();
  g.format = WeightFormat::kBf16;
  EXPECT_EQ(DenseGemv(g, x.get(), 1, y.get(), 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DenseToBf16(m.View(), 4, 5, x.get(), nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(DenseGemv(m.View(), x.get(), 0, y.get(), 8, nullptr), cudaSuccess);
  EXPECT_FALSE(DenseLinearTakes(WeightFormat::kInt4, 64));
  EXPECT_TRUE(DenseLinearTakes(WeightFormat::kInt8, 0));
}

}  // namespace
}  // namespace hmoe::cuda
