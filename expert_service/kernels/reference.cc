// The scalar reference for RunMoe: the numerics contract of moe.h written out
// plainly, from the plain quantized weights (independent of the packed layout).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "expert_service/kernels/moe.h"
#include "expert_service/kernels/packed.h"

namespace hmoe {
namespace {

float SiluF(float v) { return v / (1.0f + std::exp(-v)); }

// int8 per-row quantization of moe.h.
// A NaN in the row makes the scale NaN (the row's output NaN).
float QuantRow(const float* x, int64_t n, std::vector<int8_t>& q) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    nan |= std::isnan(x[i]);
  }
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
  const float inv = Int8InvScale(s);
  q.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    q[static_cast<size_t>(i)] =
        std::isnan(v) ? int8_t{0} : static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
  }
  return s;
}

// y[r] = sum_c W[r][c] * a[c] with the activation treatment of the regime.
void MatVec(const QuantMatrix& W, bool many, const float* a_f, const int8_t* a_q, float a_s,
            std::vector<double>& y) {
  y.assign(static_cast<size_t>(W.rows), 0.0);
  const bool int8_act =
      W.format == WeightFormat::kInt8 || (W.format == WeightFormat::kInt4 && !many);
  for (int64_t r = 0; r < W.rows; ++r) {
    double acc = 0.0;
    if (!int8_act) {
      for (int64_t c = 0; c < W.cols; ++c) {
        float wv = W.At(r, c);
        // "many" int4 and native formats: bf16(q * s); native "few": exact.
        if (W.format == WeightFormat::kInt4 || (many && IsNativeFormat(W.format)))
          wv = Bf16ToF32(F32ToBf16(wv));
        acc += static_cast<double>(a_f[c]) * wv;
      }
    } else if (W.format == WeightFormat::kInt8) {
      int64_t isum = 0;
      for (int64_t c = 0; c < W.cols; ++c)
        isum += int64_t{a_q[c]} * W.q[static_cast<size_t>(r * W.cols + c)];
      acc = static_cast<double>(isum) * W.scale[static_cast<size_t>(r)] * a_s;
    } else {
      const int64_t ng = (W.cols + W.group - 1) / W.group;
      for (int64_t g = 0; g < ng; ++g) {
        int64_t isum = 0;
        for (int64_t c = g * W.group; c < std::min(W.cols, (g + 1) * W.group); ++c)
          isum += int64_t{a_q[c]} * W.q[static_cast<size_t>(r * W.cols + c)];
        acc += static_cast<double>(isum) * W.scale[static_cast<size_t>(r * ng + g)];
      }
      acc *= a_s;
    }
    y[static_cast<size_t>(r)] = acc;
  }
}

}  // namespace

absl::Status RunMoeReference(const std::vector<QuantExpert>& experts, int64_t hidden,
                             int64_t expert_begin, const MoeInput& in, float* out,
                             const RunOptions& opts) {
  const int64_t T = in.tokens, H = hidden, E = static_cast<int64_t>(experts.size());
  const int K = in.top_k;
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = in.ids[s] - expert_begin;
    if (e >= 0 && e < E) ++count[static_cast<size_t>(e)];
  }
  std::vector<float> xf(static_cast<size_t>(H)), hf;
  std::vector<int8_t> xq, hq;
  std::vector<double> g, u, y;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) xf[static_cast<size_t>(c)] = Bf16ToF32(in.x[t * H + c]);
    const float xs = QuantRow(xf.data(), H, xq);
    float* o = out + t * H;
    std::fill(o, o + H, 0.0f);
    for (int j = 0; j < K; ++j) {
      const int64_t e = in.ids[t * K + j] - expert_begin;
      if (e < 0 || e >= E) continue;
      const QuantExpert& q = experts[static_cast<size_t>(e)];
      if (q.gate.cols != H || q.down.rows != H)
        return absl::InvalidArgumentError(absl::StrCat("reference: expert ", e, " shape mismatch"));
      const WeightFormat f = q.gate.format;
      const bool many = count[static_cast<size_t>(e)] > ManyThreshold(f, opts);
      const bool int8_act = f == WeightFormat::kInt8 || (f == WeightFormat::kInt4 && !many);
      MatVec(q.gate, many, xf.data(), xq.data(), xs, g);
      MatVec(q.up, many, xf.data(), xq.data(), xs, u);
      const int64_t I = q.gate.rows;
      hf.resize(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) {
        const float h = SiluF(static_cast<float>(g[static_cast<size_t>(i)])) *
                        static_cast<float>(u[static_cast<size_t>(i)]);
        hf[static_cast<size_t>(i)] = int8_act ? h : Bf16ToF32(F32ToBf16(h));
      }
      float hs = 0.0f;
      if (int8_act) hs = QuantRow(hf.data(), I, hq);
      MatVec(q.down, many, hf.data(), hq.data(), hs, y);
      const float wt = in.weights[t * K + j];
      for (int64_t c = 0; c < H; ++c) o[c] += wt * static_cast<float>(y[static_cast<size_t>(c)]);
    }
  }
  return absl::OkStatus();
}

}  // namespace hmoe
