#include "expert_service/kernels/onednn_moe.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "expert_service/kernels/gemm.h"

namespace hmoe {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

struct OnednnMoe::Impl {
  WeightFormat format;
  int64_t H, I, E, e_begin;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul gu_prim, dn_prim;
  std::vector<dnnl::memory> gu_w, dn_w, gu_s, dn_s;
  std::vector<float> gu_scale, dn_scale;  // [E][2I], [E][H]
  // scratch (grown on demand; the baseline is not held to the no-allocation rule)
  std::vector<uint8_t> xa, hb;
  std::vector<float> xs, hs, g, y;
  std::vector<int32_t> rows_of;
};

namespace {

dnnl::matmul MakeMatmul(dnnl::engine& eng, WeightFormat f, int64_t K, int64_t N,
                        dnnl::memory::desc* wdesc) {
  const dt a = f == WeightFormat::kBf16 ? dt::bf16 : dt::s8;
  dnnl::memory::desc src({DNNL_RUNTIME_DIM_VAL, K}, a, {K, 1});
  dnnl::memory::desc dst({DNNL_RUNTIME_DIM_VAL, N}, dt::f32, {N, 1});
  dnnl::primitive_attr attr;
  if (f == WeightFormat::kInt8) attr.set_output_scales(2, {DNNL_RUNTIME_F32_VAL});
  try {
    dnnl::memory::desc wany({K, N}, a, tag::any);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wany, dst), attr, eng);
    *wdesc = pd.weights_desc();
    return dnnl::matmul(pd);
  } catch (const dnnl::error&) {
    dnnl::memory::desc wplain({K, N}, a, tag::ba);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wplain, dst), attr, eng);
    *wdesc = pd.weights_desc();
    return dnnl::matmul(pd);
  }
}

}  // namespace

OnednnMoe::~OnednnMoe() = default;

absl::StatusOr<std::unique_ptr<OnednnMoe>> OnednnMoe::Create(WeightFormat format, int64_t H,
                                                             int64_t I, int64_t E, int64_t e_begin,
                                                             const Fill& fill) {
  if (format == WeightFormat::kInt4)
    return absl::UnimplementedError("oneDNN 2.6 has no int4 matmul");
  std::unique_ptr<OnednnMoe> m(new OnednnMoe());
  m->impl_ = std::make_unique<Impl>();
  Impl& d = *m->impl_;
  d.format = format;
  d.H = H;
  d.I = I;
  d.E = E;
  d.e_begin = e_begin;
  try {
    dnnl::memory::desc gu_desc, dn_desc;
    d.gu_prim = MakeMatmul(d.eng, format, H, 2 * I, &gu_desc);
    d.dn_prim = MakeMatmul(d.eng, format, I, H, &dn_desc);
    const dt a = format == WeightFormat::kBf16 ? dt::bf16 : dt::s8;
    const size_t es = format == WeightFormat::kBf16 ? 2 : 1;
    std::vector<uint8_t> gu(static_cast<size_t>(2 * I * H) * es),
        dn(static_cast<size_t>(H * I) * es);
    d.gu_scale.resize(static_cast<size_t>(E * 2 * I), 1.0f);
    d.dn_scale.resize(static_cast<size_t>(E * H), 1.0f);
    for (int64_t e = 0; e < E; ++e) {
      fill(e, gu.data(), &d.gu_scale[static_cast<size_t>(e * 2 * I)], dn.data(),
           &d.dn_scale[static_cast<size_t>(e * H)]);
      // plain [N][K] row-major == weights [K][N] in "ba"
      dnnl::memory gu_plain({{H, 2 * I}, a, tag::ba}, d.eng, gu.data());
      dnnl::memory dn_plain({{I, H}, a, tag::ba}, d.eng, dn.data());
      dnnl::memory guw(gu_desc, d.eng), dnw(dn_desc, d.eng);
      dnnl::reorder(gu_plain, guw).execute(d.strm, gu_plain, guw);
      dnnl::reorder(dn_plain, dnw).execute(d.strm, dn_plain, dnw);
      d.strm.wait();
      d.gu_w.push_back(guw);
      d.dn_w.push_back(dnw);
      d.gu_s.emplace_back(dnnl::memory::desc({2 * I}, dt::f32, tag::a), d.eng,
                          &d.gu_scale[static_cast<size_t>(e * 2 * I)]);
      d.dn_s.emplace_back(dnnl::memory::desc({H}, dt::f32, tag::a), d.eng,
                          &d.dn_scale[static_cast<size_t>(e * H)]);
    }
  } catch (const dnnl::error& e) {
    // oneDNN's bf16 matmul needs AVX-512 (avx512_core); below that it has no
    // implementation at all, which is a property of the CPU, not a fault.
    if (e.status == dnnl_unimplemented)
      return absl::UnimplementedError(
          absl::StrCat("oneDNN has no ", std::string(WeightFormatName(format)),
                       " matmul on this CPU (detected ISA ", std::string(IsaName(DetectedIsa())),
                       "): ", e.what()));
    return absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
  }
  return m;
}

absl::StatusOr<std::unique_ptr<OnednnMoe>> OnednnMoe::FromQuant(
    const std::vector<QuantExpert>& experts, int64_t expert_begin) {
  if (experts.empty()) return absl::InvalidArgumentError("no experts");
  const auto& q0 = experts[0];
  const int64_t H = q0.gate.cols, I = q0.gate.rows;
  return Create(q0.gate.format, H, I, static_cast<int64_t>(experts.size()), expert_begin,
                [&](int64_t e, void* gu, float* gus, void* dn, float* dns) {
                  const QuantExpert& q = experts[static_cast<size_t>(e)];
                  if (q.gate.format == WeightFormat::kBf16) {
                    auto* g16 = static_cast<uint16_t*>(gu);
                    std::copy(q.gate.bf16.begin(), q.gate.bf16.end(), g16);
                    std::copy(q.up.bf16.begin(), q.up.bf16.end(), g16 + I * H);
                    std::copy(q.down.bf16.begin(), q.down.bf16.end(), static_cast<uint16_t*>(dn));
                  } else {
                    auto* g8 = static_cast<int8_t*>(gu);
                    std::copy(q.gate.q.begin(), q.gate.q.end(), g8);
                    std::copy(q.up.q.begin(), q.up.q.end(), g8 + I * H);
                    std::copy(q.down.q.begin(), q.down.q.end(), static_cast<int8_t*>(dn));
                    std::copy(q.gate.scale.begin(), q.gate.scale.end(), gus);
                    std::copy(q.up.scale.begin(), q.up.scale.end(), gus + I);
                    std::copy(q.down.scale.begin(), q.down.scale.end(), dns);
                  }
                });
}

void OnednnMoe::SetThreads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

absl::Status OnednnMoe::Run(const MoeInput& in, float* out) {
  Impl& d = *impl_;
  const int64_t T = in.tokens, H = d.H, I = d.I;
  const int K = in.top_k;
  const bool i8 = d.format == WeightFormat::kInt8;
  const kern::KernelSet& ks =
      DetectedIsa() >= Isa::kAvx512 ? kern::Avx512Kernels() : kern::ScalarKernels();
  // Elementwise glue on oneDNN's OpenMP threads too (a serial fill, copy or
  // accumulate would make the baseline look slower than the library is);
  // small loops stay serial.
  constexpr int64_t kParallelMin = int64_t{1} << 16;
#pragma omp parallel for schedule(static) if (T * H >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) std::fill(out + t * H, out + (t + 1) * H, 0.0f);
  // Rows per expert, in slot order.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(d.E));
  for (int64_t s = 0; s < T * K; ++s) {
    const int64_t e = in.ids[s] - d.e_begin;
    if (e >= 0 && e < d.E) slots[static_cast<size_t>(e)].push_back(s);
  }
  const size_t es = i8 ? 1 : 2;
  try {
    for (int64_t e = 0; e < d.E; ++e) {
      const auto& sl = slots[static_cast<size_t>(e)];
      const int64_t M = static_cast<int64_t>(sl.size());
      if (M == 0) continue;
      // xa holds the gate_up input (M x H) and, for int8, later the quantized h (M x I).
      d.xa.resize(static_cast<size_t>(M * std::max(H, I)) * es);
      d.xs.resize(static_cast<size_t>(M));
      d.g.resize(static_cast<size_t>(M * 2 * I));
      d.hb.resize(static_cast<size_t>(M * I) * 4);
      d.hs.resize(static_cast<size_t>(M));
      d.y.resize(static_cast<size_t>(M * H));
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
      for (int64_t r = 0; r < M; ++r) {
        const uint16_t* x = in.x + (sl[static_cast<size_t>(r)] / K) * H;
        if (i8)
          ks.quant_bf16(x, H, H, reinterpret_cast<int8_t*>(d.xa.data()) + r * H,
                        &d.xs[static_cast<size_t>(r)], nullptr, 1);
        else
          std::memcpy(d.xa.data() + r * H * 2, x, static_cast<size_t>(H) * 2);
      }
      const dt a = i8 ? dt::s8 : dt::bf16;
      dnnl::memory src({{M, H}, a, {H, 1}}, d.eng, d.xa.data());
      dnnl::memory dst({{M, 2 * I}, dt::f32, {2 * I, 1}}, d.eng, d.g.data());
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src},
                                                 {DNNL_ARG_WEIGHTS, d.gu_w[static_cast<size_t>(e)]},
                                                 {DNNL_ARG_DST, dst}};
      if (i8) args[DNNL_ARG_ATTR_OUTPUT_SCALES] = d.gu_s[static_cast<size_t>(e)];
      d.gu_prim.execute(d.strm, args);
      d.strm.wait();
#pragma omp parallel for schedule(static) if (M * I >= kParallelMin)
      for (int64_t r = 0; r < M; ++r) {
        float* gr = &d.g[static_cast<size_t>(r * 2 * I)];
        if (i8) {
          const float s = d.xs[static_cast<size_t>(r)];
          for (int64_t c = 0; c < 2 * I; ++c) gr[c] *= s;
          float* h = reinterpret_cast<float*>(d.hb.data()) + r * I;
          ks.silu_mul(gr, gr + I, I, h);
          const float amax = ks.amax_f32(h, I), hs = amax / 127.0f;
          d.hs[static_cast<size_t>(r)] = hs;
          ks.quant_f32(h, I, I, Int8InvScale(hs), reinterpret_cast<int8_t*>(d.xa.data()) + r * I,
                       nullptr, 1);
        } else {
          ks.silu_mul_bf16(gr, gr + I, I, reinterpret_cast<uint16_t*>(d.hb.data()) + r * I);
        }
      }
      dnnl::memory hsrc({{M, I}, a, {I, 1}}, d.eng,
                        i8 ? static_cast<void*>(d.xa.data()) : static_cast<void*>(d.hb.data()));
      dnnl::memory ydst({{M, H}, dt::f32, {H, 1}}, d.eng, d.y.data());
      std::unordered_map<int, dnnl::memory> args2{
          {DNNL_ARG_SRC, hsrc},
          {DNNL_ARG_WEIGHTS, d.dn_w[static_cast<size_t>(e)]},
          {DNNL_ARG_DST, ydst}};
      if (i8) args2[DNNL_ARG_ATTR_OUTPUT_SCALES] = d.dn_s[static_cast<size_t>(e)];
      d.dn_prim.execute(d.strm, args2);
      d.strm.wait();
      // By column chunks: rows of one token (a repeated expert) never race.
      constexpr int64_t kChunk = 256;
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
      for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
        const int64_t c1 = std::min(H, c0 + kChunk);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t s = sl[static_cast<size_t>(r)];
          const float w = in.weights[s] * (i8 ? d.hs[static_cast<size_t>(r)] : 1.0f);
          float* o = out + (s / K) * H;
          const float* y = &d.y[static_cast<size_t>(r * H)];
          for (int64_t c = c0; c < c1; ++c) o[c] += w * y[c];
        }
      }
    }
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
