// Every CUDA kernel of gpu_worker/cuda/kernels.h against a plain CPU
// reference (hmoe::cpu ops where one exists, a scalar loop here otherwise),
// on many shapes, odd ones included. Skips without a usable CUDA device.
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/transport/moe_call.h"
#include "expert_service/kernels/moe.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cuda/gemm_attention.h"
#include "gpu_worker/cuda/kernels.h"
#include "gpu_worker/driver/routing.h"
#include "gpu_worker/hot_weights.h"
#include "tests/kernels/moe_test_util.h"

namespace hmoe::cuda {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (std::string why; !hmoe::cuda::CudaDeviceUsable(&why)) GTEST_SKIP() << why

// Device memory for n values of T, freed on destruction.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0 && cudaMalloc(&p_, n_ * sizeof(T)) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << n_ * sizeof(T) << " bytes failed";
      p_ = nullptr;
    }
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { Upload(v); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void Upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    if (n_ > 0) {
      ASSERT_EQ(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> Download() const {
    std::vector<T> v(n_);
    if (n_ > 0) {
      const cudaError_t e = cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
      EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    }
    return v;
  }

 private:
  size_t n_ = 0;
  T* p_ = nullptr;
};

// Checks a launch and waits for it.
void Check(cudaError_t launch) {
  ASSERT_EQ(launch, cudaSuccess) << cudaGetErrorString(launch);
  const cudaError_t e = cudaDeviceSynchronize();
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}

std::vector<float> Random(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

uint16_t HostBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float HostBf16ToF(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::vector<uint16_t> v(n);
  std::uniform_real_distribution<float> d(lo, hi);
  for (uint16_t& x : v) x = HostBf16(d(rng));
  return v;
}

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? num / den : num;
}

// Distance in bf16 steps (sign-magnitude order).
int Bf16Ulps(uint16_t a, uint16_t b) {
  const auto ord = [](uint16_t v) {
    return (v & 0x8000) != 0 ? -static_cast<int>(v & 0x7fff) : static_cast<int>(v);
  };
  return std::abs(ord(a) - ord(b));
}

// got (bf16) within 1 step of bf16(want), or within atol of want, everywhere.
void ExpectBf16Near(const std::vector<uint16_t>& got, const std::vector<float>& want,
                    const std::string& what, double atol = 0.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = Bf16Ulps(got[i], HostBf16(want[i]));
    if (d > 1 && std::fabs(double{HostBf16ToF(got[i])} - want[i]) <= atol) continue;
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, 1) << what << ": at " << at << " got " << HostBf16ToF(got[at]) << " want "
                      << want[at];
}

constexpr double kNmse = 1e-5;

// RopeCosSin rows [T, dim] for positions: cs[2i] = cos(p f_i) af, cs[2i+1] = sin(p f_i) af,
// f_i = 10000^(-2i/dim).
std::vector<float> CosSinRows(const std::vector<int64_t>& pos, int64_t dim, float af) {
  std::vector<float> cs(pos.size() * dim);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float f = static_cast<float>(std::pow(10000.0, -2.0 * i / dim));
      const float a = static_cast<float>(pos[t]) * f;
      cs[t * dim + 2 * i] = std::cos(a) * af;
      cs[t * dim + 2 * i + 1] = std::sin(a) * af;
    }
  return cs;
}

// ---- conversions and elementwise ---------------------------------------------------

TEST(GpuKernelTest, Bf16Conversions) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(1);
  std::vector<float> special = {0.0f,
                                -0.0f,
                                1.0f,
                                -1.0f,
                                1.00390625f /* tie to even */,
                                1.01171875f /* tie to odd: rounds up */,
                                1.0f + 1e-7f,
                                3.0e38f,
                                3.4028235e38f,
                                INFINITY,
                                -INFINITY,
                                NAN,
                                -NAN,
                                1e-40f /* subnormal */,
                                -3e-39f,
                                65504.0f,
                                1.17549435e-38f};
  uint32_t snan = 0x7f800001u;  // signalling NaN whose top half would read as inf
  float f;
  std::memcpy(&f, &snan, 4);
  special.push_back(f);
  for (size_t n : {size_t{1}, size_t{7}, size_t{33}, size_t{1000}, size_t{100003}}) {
    std::vector<float> x = Random(n, rng, -100.0f, 100.0f);
    for (size_t i = 0; i < std::min(n, special.size()); ++i) x[i] = special[i];
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint16_t> dy(n);
    Check(ToBf16(dx.get(), static_cast<int64_t>(n), dy.get(), nullptr));
    const std::vector<uint16_t> y = dy.Download();
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(y[i], HostBf16(x[i])) << "n " << n << " i " << i << " x " << x[i];
      if (std::isnan(x[i])) {
        ASSERT_TRUE(std::isnan(HostBf16ToF(y[i])));
      }
    }
  }
  // Every bf16 pattern back to f32.
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), 0);
  for (size_t n : {size_t{1}, size_t{129}, size_t{65536}}) {
    std::vector<uint16_t> x(all.begin(), all.begin() + static_cast<int64_t>(n));
    DeviceBuffer<uint16_t> dx(x);
    DeviceBuffer<float> dy(n);
    Check(Bf16ToF32(dx.get(), static_cast<int64_t>(n), dy.get(), nullptr));
    const std::vector<float> y = dy.Download();
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(y[i]), static_cast<uint32_t>(x[i]) << 16);
    }
  }
}

TEST(GpuKernelTest, EmbedRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(2);
  const int64_t rows = 50;
  for (int64_t cols : {1, 7, 129, 1000}) {
    const std::vector<uint16_t> table = RandomBf16(rows * cols, rng);
    DeviceBuffer<uint16_t> dt(table);
    for (int64_t T : {1, 3, 17, 300}) {
      std::vector<int32_t> ids(T);
      for (auto& id : ids) id = static_cast<int32_t>(rng() % rows);
      DeviceBuffer<int32_t> di(ids);
      DeviceBuffer<float> dout(T * cols);
      Check(EmbedRows(dt.get(), cols, di.get(), T, dout.get(), nullptr));
      const std::vector<float> out = dout.Download();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(out[t * cols + c], HostBf16ToF(table[ids[t] * cols + c]))
              << "cols " << cols << " T " << T;
        }
      }
    }
  }
}

TEST(GpuKernelTest, AddRmsNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {1, 7}, {3, 33}, {17, 129}, {64, 1000}, {300, 7}, {1, 7168}, {5, 5000}, {300, 256}};
  for (auto [rows, n] : shapes) {
    for (int mode = 0; mode < 4; ++mode) {  // 0 plain, 1 add, 2 in place + add, 3 bf16 only
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " n " << n << " mode " << mode);
      const std::vector<float> x0 = Random(rows * n, rng, -3.0f, 3.0f);
      const std::vector<float> add = Random(rows * n, rng);
      const std::vector<float> w = Random(n, rng, 0.5f, 1.5f);
      const float eps = 1e-6f;
      std::vector<float> xs = x0;
      if (mode != 0)
        for (size_t i = 0; i < xs.size(); ++i) xs[i] = x0[i] + add[i];
      std::vector<float> want(rows * n);
      cpu::RmsNorm(xs.data(), rows, n, w.data(), eps, want.data());

      DeviceBuffer<float> dx(x0), dadd(add), dw(w), dh(rows * n);
      DeviceBuffer<uint16_t> dh16(rows * n);
      float* h = mode == 2 ? dx.get() : mode == 3 ? nullptr : dh.get();
      Check(AddRmsNorm(dx.get(), mode == 0 ? nullptr : dadd.get(), rows, n, dw.get(), eps, h,
                       mode == 0 ? nullptr : dh16.get(), nullptr));
      const std::vector<float> x = dx.Download();
      if (mode == 2) {
        EXPECT_LE(Nmse(x, want), kNmse);
      } else {
        EXPECT_EQ(x, xs);  // x + add is one rounded add either way
        if (mode != 3) {
          EXPECT_LE(Nmse(dh.Download(), want), kNmse);
        }
      }
      if (mode != 0) ExpectBf16Near(dh16.Download(), want, "h_bf16");
    }
  }
}

TEST(GpuKernelTest, ApplyRope) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(4);
  struct Case {
    int64_t T, heads, dim, offset, pad;
  };
  const std::vector<Case> cases = {{1, 1, 2, 0, 0},   {3, 3, 8, 5, 1},    {17, 8, 64, 128, 0},
                                   {64, 2, 72, 0, 3}, {300, 4, 64, 7, 2}, {1, 128, 64, 128, 0},
                                   {5, 1, 6, 1, 1}};
  for (const Case& c : cases) {
    for (bool inter : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.T << " heads " << c.heads << " dim " << c.dim
                                        << " interleaved " << inter);
      const int64_t head_stride = c.offset + c.dim + c.pad;
      const int64_t tok_stride = c.heads * head_stride + c.pad;
      std::vector<float> x = Random(c.T * tok_stride, rng, -2.0f, 2.0f);
      std::vector<int64_t> pos(c.T);
      for (auto& p : pos) p = static_cast<int64_t>(rng() % 5000);
      const std::vector<float> cs = CosSinRows(pos, c.dim, 0.9f);
      DeviceBuffer<float> dx(x), dcs(cs);
      Check(ApplyRope(dx.get(), c.T, c.heads, tok_stride, head_stride, c.offset, c.dim, dcs.get(),
                      inter, nullptr));
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t i = 0; i < c.heads; ++i)
          cpu::ApplyRope(x.data() + t * tok_stride + i * head_stride + c.offset, c.dim,
                         cs.data() + t * c.dim,
                         inter ? RopeLayout::kInterleaved : RopeLayout::kHalves);
      const std::vector<float> got = dx.Download();
      EXPECT_LE(Nmse(got, x), kNmse);
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i)
        worst = std::max(worst, std::fabs(double{got[i]} - x[i]));
      EXPECT_LE(worst, 1e-5);
    }
  }
}

TEST(GpuKernelTest, WriteMlaCache) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  struct Case {
    int64_t T, r, rope;
  };
  for (const Case& c : std::vector<Case>{
           {1, 512, 64}, {3, 33, 8}, {17, 7, 6}, {64, 512, 64}, {300, 129, 2}, {5, 1000, 0}}) {
    for (bool inter : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.T << " r " << c.r << " rope " << c.rope);
      const int64_t row = c.r + c.rope, slots = c.T * 2 + 3;
      const std::vector<float> kva = Random(c.T * row, rng, -3.0f, 3.0f);
      const std::vector<float> nw = Random(c.r, rng, 0.5f, 1.5f);
      std::vector<int64_t> pos(c.T);
      for (auto& p : pos) p = static_cast<int64_t>(rng() % 3000);
      const std::vector<float> cs = CosSinRows(pos, c.rope, 1.1f);
      std::vector<int32_t> perm(slots);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int32_t> slot(perm.begin(), perm.begin() + c.T);
      if (c.T > 2) slot[1] = -1;  // skipped
      std::vector<float> cache = Random(slots * row, rng);
      DeviceBuffer<float> dkva(kva), dnw(nw), dcs(cs), dcache(cache);
      DeviceBuffer<int32_t> dslot(slot);
      Check(WriteMlaCache(dkva.get(), c.T, c.r, c.rope, dnw.get(), 1e-6f, dcs.get(), inter,
                          dslot.get(), dcache.get(), nullptr));
      for (int64_t t = 0; t < c.T; ++t) {
        if (slot[t] < 0) continue;
        float* dst = cache.data() + slot[t] * row;
        cpu::RmsNorm(kva.data() + t * row, 1, c.r, nw.data(), 1e-6f, dst);
        std::copy(kva.begin() + t * row + c.r, kva.begin() + (t + 1) * row, dst + c.r);
        if (c.rope > 0)
          cpu::ApplyRope(dst + c.r, c.rope, cs.data() + t * c.rope,
                         inter ? RopeLayout::kInterleaved : RopeLayout::kHalves);
      }
      EXPECT_LE(Nmse(dcache.Download(), cache), kNmse);
    }
  }
}

TEST(GpuKernelTest, WriteKvCache) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  for (int64_t row : {1, 7, 129, 1024}) {
    for (int64_t T : {1, 3, 17, 300}) {
      const int64_t slots = T + 10;
      const std::vector<float> k = Random(T * row, rng), v = Random(T * row, rng);
      std::vector<float> kc = Random(slots * row, rng), vc = Random(slots * row, rng);
      std::vector<int32_t> perm(slots);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<int32_t> slot(perm.begin(), perm.begin() + T);
      DeviceBuffer<float> dk(k), dv(v), dkc(kc), dvc(vc);
      DeviceBuffer<int32_t> ds(slot);
      Check(WriteKvCache(dk.get(), dv.get(), T, row, ds.get(), dkc.get(), dvc.get(), nullptr));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < row; ++i) {
          kc[slot[t] * row + i] = k[t * row + i];
          vc[slot[t] * row + i] = v[t * row + i];
        }
      EXPECT_EQ(dkc.Download(), kc);
      EXPECT_EQ(dvc.Download(), vc);
    }
  }
}

TEST(GpuKernelTest, SiluMul) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  for (int64_t T : {1, 3, 17, 300}) {
    for (int64_t I : {1, 7, 33, 129, 1000}) {
      const std::vector<float> gu = Random(T * 2 * I, rng, -8.0f, 8.0f);
      DeviceBuffer<float> dgu(gu);
      DeviceBuffer<uint16_t> dout(T * I);
      Check(SiluMul(dgu.get(), T, I, dout.get(), nullptr));
      std::vector<float> want(T * I);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < I; ++i)
          want[t * I + i] = cpu::Silu(gu[t * 2 * I + i]) * gu[t * 2 * I + I + i];
      ExpectBf16Near(dout.Download(), want, "silu_mul T " + std::to_string(T));
    }
  }
}

TEST(GpuKernelTest, AddBiasAccumulateGather) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  for (int64_t T : {1, 3, 17, 300}) {
    for (int64_t N : {1, 7, 33, 129, 1000}) {
      SCOPED_TRACE(::testing::Message() << "T " << T << " N " << N);
      std::vector<float> y = Random(T * N, rng);
      const std::vector<float> b = Random(N, rng);
      DeviceBuffer<float> dy(y), db(b);
      Check(AddBias(dy.get(), T, N, db.get(), nullptr));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) y[t * N + n] += b[n];
      EXPECT_EQ(dy.Download(), y);

      const int64_t n = T * N;
      std::vector<float> x = Random(n, rng);
      const std::vector<float> a1 = Random(n, rng), a2 = Random(n, rng);
      DeviceBuffer<float> dx(x), da1(a1), da2(a2);
      Check(Accumulate(dx.get(), da1.get(), nullptr, n, nullptr));
      for (int64_t i = 0; i < n; ++i) x[i] += a1[i];
      EXPECT_EQ(dx.Download(), x);
      Check(Accumulate(dx.get(), da1.get(), da2.get(), n, nullptr));
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] + a1[i] + a2[i];
      EXPECT_EQ(dx.Download(), x);

      // Gather N-wide rows of a [T, N] matrix.
      std::vector<int32_t> rows(T + 5);
      for (auto& r : rows) r = static_cast<int32_t>(rng() % T);
      DeviceBuffer<int32_t> drows(rows);
      DeviceBuffer<float> dg(rows.size() * N);
      Check(GatherRows(dy.get(), N, drows.get(), static_cast<int64_t>(rows.size()), dg.get(),
                       nullptr));
      std::vector<float> want(rows.size() * N);
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy(y.begin() + rows[i] * N, y.begin() + (rows[i] + 1) * N, want.begin() + i * N);
      EXPECT_EQ(dg.Download(), want);
    }
  }
}

TEST(GpuKernelTest, ZeroSizesAreNoOps) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(EmbedRows(nullptr, 16, nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(AddRmsNorm(nullptr, nullptr, 0, 16, nullptr, 1e-6f, nullptr, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(ApplyRope(nullptr, 0, 4, 64, 16, 0, 16, nullptr, false, nullptr), cudaSuccess);
  EXPECT_EQ(
      WriteMlaCache(nullptr, 0, 512, 64, nullptr, 1e-6f, nullptr, true, nullptr, nullptr, nullptr),
      cudaSuccess);
  EXPECT_EQ(WriteKvCache(nullptr, nullptr, 0, 16, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  PagedAttentionArgs a;
  a.dk = a.dv = 64;
  EXPECT_EQ(PagedAttention(a, nullptr), cudaSuccess);
  EXPECT_EQ(MlaAbsorbQuery(nullptr, nullptr, 0, 128, 128, 64, 128, 512, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(MlaExpandOutput(nullptr, nullptr, 0, 128, 128, 128, 512, nullptr, nullptr, nullptr),
            cudaSuccess);
  RouteParams p;
  p.num_experts = 8;
  p.top_k = 2;
  EXPECT_EQ(RouteTokens(nullptr, 0, p, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(SiluMul(nullptr, 0, 16, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(ToBf16(nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(Bf16ToF32(nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(AddBias(nullptr, 0, 16, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(Accumulate(nullptr, nullptr, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(GatherRows(nullptr, 16, nullptr, 0, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// ---- paged attention -----------------------------------------------------------------

// One sequence of a batch: its query tokens sit at positions
// [ctx - tokens, ctx), and its cache holds keys [0, ctx).
struct SeqSpec {
  int64_t ctx = 0;
  int64_t tokens = 0;
};

struct AttnCase {
  std::string name;
  bool mla = false;
  int64_t heads = 0, kv_heads = 1;
  int64_t dk = 0, dv = 0;  // GQA: dk == dv == head dim
  int64_t block_tokens = 16;
  int64_t window = 0;
  std::vector<SeqSpec> seqs;
  int64_t q_pad = 0;  // extra floats per token row of q
  bool use_scratch = true;
  // > 0: AttendPass with GEMM attention for runs of at least this many
  // tokens, with gemm_floats of scratch (0: the full chunk of every run).
  int64_t gemm_min = 0;
  int64_t gemm_floats = 0;
  bool tf32 = true;
};

// TF32 inputs (10-bit mantissas) in the GEMM attention.
constexpr double kGemmNmse = 5e-5;

void RunAttention(const AttnCase& c, std::mt19937& rng) {
  SCOPED_TRACE(c.name);
  const int64_t bt = c.block_tokens;
  // Shuffled physical blocks, with spares that hold garbage.
  int64_t nblocks = 3;
  for (const SeqSpec& s : c.seqs) nblocks += (s.ctx + bt - 1) / bt;
  std::vector<int32_t> phys(nblocks);
  std::iota(phys.begin(), phys.end(), 0);
  std::shuffle(phys.begin(), phys.end(), rng);
  std::vector<int32_t> table, table_start, pos;
  std::vector<int64_t> seq_of, seq_table;
  size_t next = 0;
  for (size_t si = 0; si < c.seqs.size(); ++si) {
    const SeqSpec& s = c.seqs[si];
    seq_table.push_back(static_cast<int64_t>(table.size()));
    for (int64_t b = 0; b < (s.ctx + bt - 1) / bt; ++b) table.push_back(phys[next++]);
    for (int64_t i = 0; i < s.tokens; ++i) {
      table_start.push_back(static_cast<int32_t>(seq_table.back()));
      pos.push_back(static_cast<int32_t>(s.ctx - s.tokens + i));
      seq_of.push_back(static_cast<int64_t>(si));
    }
  }
  const int64_t T = static_cast<int64_t>(pos.size());
  const int64_t rows = nblocks * bt;
  const int64_t k_row = c.mla ? c.dk : c.kv_heads * c.dk;
  const int64_t v_row = c.mla ? c.dk : c.kv_heads * c.dv;
  const std::vector<float> kc = Random(rows * k_row, rng);
  const std::vector<float> vc = c.mla ? std::vector<float>() : Random(rows * v_row, rng);
  const int64_t q_ts = c.heads * c.dk + c.q_pad;
  const std::vector<float> q = Random(T * q_ts, rng, -2.0f, 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));

  DeviceBuffer<float> dq(q), dk(kc), dv(c.mla ? std::vector<float>{0.0f} : vc);
  DeviceBuffer<int32_t> dtable(table), dstart(table_start), dpos(pos);
  DeviceBuffer<float> dout(T * c.heads * c.dv);
  PagedAttentionArgs a;
  a.q = dq.get();
  a.q_tok_stride = q_ts;
  a.q_head_stride = c.dk;
  a.dk = c.dk;
  a.k_cache = dk.get();
  a.k_row = k_row;
  a.k_head_offset = c.mla ? 0 : c.dk;
  a.v_cache = c.mla ? dk.get() : dv.get();
  a.v_row = v_row;
  a.v_head_offset = c.mla ? 0 : c.dv;
  a.dv = c.dv;
  a.T = T;
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv_heads;
  a.block_table = dtable.get();
  a.table_start = dstart.get();
  a.pos = dpos.get();
  a.block_tokens = bt;
  a.window = c.window;
  a.scale = scale;
  a.out = dout.get();
  a.out_tok_stride = c.heads * c.dv;
  a.out_head_stride = c.dv;
  const int64_t scratch_n = c.use_scratch ? PagedAttentionScratchFloats(a) : 0;
  DeviceBuffer<float> dscratch(static_cast<size_t>(std::max<int64_t>(scratch_n, 1)));
  if (scratch_n > 0) {
    a.scratch = dscratch.get();
    a.scratch_floats = scratch_n;
  }
  int64_t gemm_runs = 0, gemm_tokens = 0;
  if (c.gemm_min > 0) {
    const std::vector<AttentionRun> runs =
        FindAttentionRuns(table_start.data(), pos.data(), T, c.gemm_min);
    int64_t floats = c.gemm_floats;
    for (const AttentionRun& r : runs) {
      if (c.gemm_floats == 0)
        floats = std::max(floats,
                          GemmAttentionScratchFloats(a, r, std::min(r.n, kMaxGemmAttentionChunk)));
      if (GemmAttentionChunk(a, r, floats) > 0) {
        ++gemm_runs;
        gemm_tokens += r.n;
      }
    }
    DeviceBuffer<float> gs(static_cast<size_t>(std::max<int64_t>(floats, 1)));
    cublasHandle_t blas = nullptr;
    ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    int64_t launches = 0, took = 0;
    GemmAttentionOptions go;
    go.scratch = gs.get();
    go.scratch_floats = floats;
    go.tf32 = c.tf32;
    const absl::Status st = AttendPass(a, runs, go, blas, nullptr, &launches, &took);
    cublasDestroy(blas);
    ASSERT_TRUE(st.ok()) << st;
    Check(cudaDeviceSynchronize());
    EXPECT_GT(launches, 0);
    EXPECT_EQ(took, gemm_tokens);
  } else {
    Check(PagedAttention(a, nullptr));
  }
  const std::vector<float> got = dout.Download();

  // Reference: gather each (sequence, kv head)'s keys and values contiguously.
  std::vector<float> want(T * c.heads * c.dv);
  const int64_t group = c.heads / c.kv_heads;
  for (size_t si = 0; si < c.seqs.size(); ++si) {
    const int64_t ctx = c.seqs[si].ctx;
    for (int64_t g = 0; g < c.kv_heads; ++g) {
      std::vector<float> kk(ctx * c.dk), vv(ctx * c.dv);
      for (int64_t p = 0; p < ctx; ++p) {
        const int64_t row = static_cast<int64_t>(table[seq_table[si] + p / bt]) * bt + p % bt;
        const float* ksrc = kc.data() + row * k_row + (c.mla ? 0 : g * c.dk);
        std::copy(ksrc, ksrc + c.dk, kk.begin() + p * c.dk);
        const float* vsrc = c.mla ? ksrc : vc.data() + row * v_row + g * c.dv;
        std::copy(vsrc, vsrc + c.dv, vv.begin() + p * c.dv);
      }
      std::vector<float> scores(ctx);
      for (int64_t t = 0; t < T; ++t) {
        if (seq_of[t] != static_cast<int64_t>(si)) continue;
        for (int64_t hl = 0; hl < group; ++hl) {
          const int64_t h = g * group + hl;
          cpu::AttendOne(q.data() + t * q_ts + h * c.dk, c.dk, kk.data(), c.dk, vv.data(), c.dv,
                         c.dv, pos[t], c.window, scale, scores.data(),
                         want.data() + (t * c.heads + h) * c.dv);
        }
      }
    }
  }
  const double nmse = Nmse(got, want);
  if (c.gemm_min > 0) {
    std::printf("[ gemm attn ] %-28s %s %lld of %lld tokens in %lld GEMM runs: NMSE %.2e\n",
                c.name.c_str(), c.tf32 ? "tf32" : "fp32", static_cast<long long>(gemm_tokens),
                static_cast<long long>(T), static_cast<long long>(gemm_runs), nmse);
    EXPECT_LE(nmse, c.tf32 ? kGemmNmse : kNmse);
  } else {
    EXPECT_LE(nmse, kNmse);
  }
}

TEST(GpuKernelTest, PagedAttentionMla) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  // Prefill chunks of several sequences in one call (ds-v3 latent shapes).
  RunAttention({"mla prefill",
                true,
                16,
                1,
                576,
                512,
                16,
                0,
                {{1, 1}, {17, 17}, {133, 33}, {43, 3}, {64, 1}}},
               rng);
  // Odd latent shapes, heads not a multiple of 8, odd block size.
  RunAttention({"mla odd", true, 12, 1, 72, 40, 7, 0, {{29, 5}, {3, 3}, {100, 1}}, 3}, rng);
  RunAttention({"mla scalar loads", true, 3, 1, 37, 33, 5, 0, {{50, 4}, {1, 1}}, 1}, rng);
}

TEST(GpuKernelTest, PagedAttentionMlaDecodeLong) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(10);
  for (bool scratch : {true, false}) {
    AttnCase c{"mla decode", true, 32, 1, 576, 512, 64, 0, {{1000, 1}, {5000, 1}, {77, 1}}};
    c.use_scratch = scratch;
    RunAttention(c, rng);
  }
  RunAttention({"mla decode 128 heads", true, 128, 1, 576, 512, 16, 0, {{700, 1}}}, rng);
}

TEST(GpuKernelTest, PagedAttentionGqa) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  RunAttention(
      {"gqa prefill", false, 32, 4, 128, 128, 16, 0, {{1, 1}, {17, 17}, {300, 64}, {40, 3}}}, rng);
  for (bool scratch : {true, false}) {
    AttnCase c{"gqa decode", false, 32, 4, 128, 128, 16, 0, {{1000, 1}, {5000, 1}, {2, 1}}};
    c.use_scratch = scratch;
    RunAttention(c, rng);
  }
  RunAttention({"gqa hd72", false, 6, 2, 72, 72, 16, 0, {{33, 7}, {200, 1}}}, rng);
  RunAttention({"gqa hd40 odd blocks", false, 8, 8, 40, 40, 7, 0, {{129, 17}, {5, 5}}, 2}, rng);
  RunAttention({"gqa hd33 scalar", false, 4, 2, 33, 33, 3, 0, {{70, 9}, {1000, 1}}}, rng);
  RunAttention({"gqa hd256", false, 16, 2, 256, 256, 32, 0, {{300, 3}, {1500, 1}}}, rng);
}

TEST(GpuKernelTest, PagedAttentionSlidingWindow) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  RunAttention({"window 37", false, 8, 2, 64, 64, 16, 37, {{300, 64}, {20, 20}, {1000, 1}}}, rng);
  RunAttention({"window 256", false, 32, 4, 128, 128, 16, 256, {{1000, 1}, {5000, 1}, {400, 17}}},
               rng);
  RunAttention({"window 1", false, 4, 1, 40, 40, 5, 1, {{33, 33}}}, rng);
  RunAttention({"mla window", true, 8, 1, 576, 512, 16, 100, {{1000, 3}, {50, 50}}}, rng);
}

// ---- GEMM attention (gemm_attention.h) -------------------------------------------------

TEST(GemmAttention, FindAttentionRuns) {
  // Tokens: seq A positions 5..7, seq B 0..1, seq A 8 (not adjacent to A's
  // run), seq C 3..5 then 7 (a gap).
  const std::vector<int32_t> ts{0, 0, 0, 4, 4, 0, 9, 9, 9, 9};
  const std::vector<int32_t> pos{5, 6, 7, 0, 1, 8, 3, 4, 5, 7};
  auto runs = FindAttentionRuns(ts.data(), pos.data(), 10, 2);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].row0, 0);
  EXPECT_EQ(runs[0].n, 3);
  EXPECT_EQ(runs[0].pos0, 5);
  EXPECT_EQ(runs[0].table_start, 0);
  EXPECT_EQ(runs[1].row0, 3);
  EXPECT_EQ(runs[1].n, 2);
  EXPECT_EQ(runs[1].table_start, 4);
  EXPECT_EQ(runs[2].row0, 6);
  EXPECT_EQ(runs[2].n, 3);
  EXPECT_EQ(runs[2].pos0, 3);
  EXPECT_EQ(FindAttentionRuns(ts.data(), pos.data(), 10, 1).size(), 5u);
  EXPECT_EQ(FindAttentionRuns(ts.data(), pos.data(), 10, 4).size(), 0u);
  EXPECT_TRUE(FindAttentionRuns(ts.data(), pos.data(), 0, 1).empty());
}

TEST(GemmAttention, ScratchAndChunk) {
  PagedAttentionArgs a;  // ds-v3 latent attention, 128 heads
  float cache = 0;
  a.k_cache = a.v_cache = &cache;
  a.k_row = a.v_row = a.dk = 576;
  a.dv = 512;
  a.num_heads = 128;
  const AttentionRun run{0, 8192, 0, 0};
  EXPECT_EQ(GemmAttentionScratchFloats(a, run, 1), 8192 * 576 + 128 * 8192);
  const int64_t one_gib = (int64_t{1} << 30) / 4;
  EXPECT_EQ(GemmAttentionChunk(a, run, one_gib), 128);  // 512, 256 do not fit
  EXPECT_EQ(GemmAttentionChunk(a, run, 8192 * 576), 0);
  // A window bounds the keys of a chunk; separate values add their rows.
  a.window = 100;
  EXPECT_EQ(GemmAttentionScratchFloats(a, run, 16), 8192 * 576 + 128 * 16 * 115);
  a.v_cache = nullptr;
  a.window = 0;
  EXPECT_EQ(GemmAttentionScratchFloats(a, AttentionRun{0, 10, 90, 0}, 2),
            100 * (576 + 576) + 128 * 2 * 100);
}

TEST(GpuKernelTest, GemmAttentionMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  auto gemm = [](AttnCase c, int64_t min, int64_t floats = 0) {
    c.gemm_min = min;
    c.gemm_floats = floats;
    return c;
  };
  // ds-v3 latent shapes: two long runs (one after a 500-token prefix) beside
  // a decode token and a short chunk that take PagedAttention.
  const AttnCase mla{
      "mla", true, 16, 1, 576, 512, 16, 0, {{300, 300}, {1, 1}, {700, 200}, {50, 3}}};
  RunAttention(gemm(mla, 4), rng);
  RunAttention(gemm(mla, 4, 481600), rng);  // chunks of 37 and 6 queries
  RunAttention(gemm(mla, 4, 200000), rng);  // the 700-key run does not fit: PagedAttention
  RunAttention(gemm({"gqa", false, 32, 4, 128, 128, 16, 0, {{400, 400}, {1000, 1}, {90, 70}}}, 16),
               rng);
  RunAttention(gemm({"gqa hd72 padded q", false, 6, 2, 72, 72, 7, 0, {{129, 100}, {33, 33}}, 3}, 1),
               rng);
  RunAttention(gemm({"gqa hd33 scalar", false, 4, 2, 33, 33, 3, 0, {{70, 69}, {5, 1}}, 1}, 1), rng);
  RunAttention(gemm({"gqa hd256", false, 16, 2, 256, 256, 32, 0, {{600, 600}}}, 64), rng);
  RunAttention(gemm({"gqa window 37", false, 8, 2, 64, 64, 16, 37, {{300, 300}, {1000, 100}}}, 8),
               rng);
  RunAttention(gemm({"gqa window 37 small chunks", false, 8, 2, 64, 64, 16, 37, {{300, 300}}}, 8,
                    300 * 256 + 4 * 9 * 45),  // chunks of 9 queries
               rng);
  RunAttention(gemm({"mla window 100", true, 8, 1, 576, 512, 16, 100, {{1000, 600}}}, 8), rng);
  // Full-fp32 GEMMs: PagedAttention's tolerance.
  for (AttnCase c :
       {gemm(mla, 4), gemm({"gqa fp32", false, 8, 2, 64, 64, 16, 0, {{200, 150}}}, 8)}) {
    c.tf32 = false;
    RunAttention(c, rng);
  }
  // The tiny fixtures' latent shapes (deepseek_v3_tiny, v2_tiny).
  RunAttention(gemm({"mla dk48 dv32", true, 4, 1, 48, 32, 16, 0, {{12, 6}, {19, 1}, {12, 12}}}, 1),
               rng);
  RunAttention(gemm({"mla dk40 dv32", true, 4, 1, 40, 32, 16, 0, {{12, 6}, {19, 1}}}, 1), rng);
}

// ---- MLA absorb / expand --------------------------------------------------------------

struct MlaShape {
  int64_t T, nh, nope, rope, vd, r;
};

const std::vector<MlaShape>& MlaShapes() {
  static const std::vector<MlaShape> shapes = {
      {1, 128, 128, 64, 128, 512},  // ds-v3 decode
      {3, 16, 128, 64, 128, 512},  {8, 4, 128, 64, 128, 512}, {17, 3, 33, 7, 20, 40},
      {32, 2, 128, 64, 128, 512},  {33, 5, 24, 0, 8, 37},     {64, 2, 16, 8, 16, 72},
      {300, 2, 64, 16, 32, 128},   {129, 1, 7, 2, 1, 1},      {1, 1, 1, 1, 1, 1000},
  };
  return shapes;
}

TEST(GpuKernelTest, MlaAbsorbQuery) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  for (const MlaShape& s : MlaShapes()) {
    SCOPED_TRACE(::testing::Message() << "T " << s.T << " nh " << s.nh << " nope " << s.nope
                                      << " rope " << s.rope << " vd " << s.vd << " r " << s.r);
    const int64_t qk = s.nope + s.rope, orow = s.r + s.rope;
    const std::vector<float> q = Random(s.T * s.nh * qk, rng);
    const std::vector<uint16_t> w = RandomBf16(s.nh * (s.nope + s.vd) * s.r, rng);
    DeviceBuffer<float> dq(q), dout(s.T * s.nh * orow);
    DeviceBuffer<uint16_t> dw(w);
    Check(MlaAbsorbQuery(dq.get(), dw.get(), s.T, s.nh, s.nope, s.rope, s.vd, s.r, dout.get(),
                         nullptr));
    std::vector<float> want(s.T * s.nh * orow, 0.0f);
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.nh; ++h) {
        const float* qh = q.data() + t * s.nh * qk + h * qk;
        float* o = want.data() + t * s.nh * orow + h * orow;
        for (int64_t j = 0; j < s.nope; ++j) {
          const uint16_t* wr = w.data() + (h * (s.nope + s.vd) + j) * s.r;
          for (int64_t c = 0; c < s.r; ++c) o[c] += qh[j] * HostBf16ToF(wr[c]);
        }
        for (int64_t i = 0; i < s.rope; ++i) o[s.r + i] = qh[s.nope + i];
      }
    EXPECT_LE(Nmse(dout.Download(), want), kNmse);
  }
}

TEST(GpuKernelTest, MlaExpandOutput) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(14);
  for (const MlaShape& s : MlaShapes()) {
    const std::vector<float> olat = Random(s.T * s.nh * s.r, rng);
    const std::vector<uint16_t> w = RandomBf16(s.nh * (s.nope + s.vd) * s.r, rng);
    std::vector<float> want(s.T * s.nh * s.vd);
    double ss = 0;
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.nh; ++h)
        for (int64_t d = 0; d < s.vd; ++d) {
          const uint16_t* wr = w.data() + (h * (s.nope + s.vd) + s.nope + d) * s.r;
          const float* l = olat.data() + t * s.nh * s.r + h * s.r;
          double acc = 0;
          for (int64_t c = 0; c < s.r; ++c) acc += double{HostBf16ToF(wr[c])} * l[c];
          want[t * s.nh * s.vd + h * s.vd + d] = static_cast<float>(acc);
          ss += acc * acc;
        }
    // Outputs that cancel to near zero carry the f32 sum's absolute error,
    // which can exceed their bf16 step.
    const double atol = 1e-5 * std::sqrt(ss / static_cast<double>(want.size()));
    DeviceBuffer<float> dl(olat);
    DeviceBuffer<uint16_t> dw(w);
    for (int mode = 0; mode < 3; ++mode) {  // f32, f32 + bf16, bf16 only
      SCOPED_TRACE(::testing::Message() << "T " << s.T << " nh " << s.nh << " vd " << s.vd << " r "
                                        << s.r << " mode " << mode);
      DeviceBuffer<float> dout(s.T * s.nh * s.vd);
      DeviceBuffer<uint16_t> dout16(s.T * s.nh * s.vd);
      Check(MlaExpandOutput(dl.get(), dw.get(), s.T, s.nh, s.nope, s.vd, s.r,
                            mode == 2 ? nullptr : dout.get(), mode == 0 ? nullptr : dout16.get(),
                            nullptr));
      if (mode != 2) {
        EXPECT_LE(Nmse(dout.Download(), want), kNmse);
      }
      if (mode != 0) ExpectBf16Near(dout16.Download(), want, "out_bf16", atol);
      if (mode == 1) {  // the bf16 copy is exactly the f32 output rounded
        const std::vector<float> f = dout.Download();
        const std::vector<uint16_t> b = dout16.Download();
        for (size_t i = 0; i < f.size(); ++i) {
          ASSERT_EQ(b[i], HostBf16(f[i])) << i;
        }
      }
    }
  }
}

// ---- router --------------------------------------------------------------------------

// Scalar reference of hmoe::Route's semantics for one token.
void RouteRef(const RouteParams& p, const float* l, const float* bias, int32_t* ids, float* w) {
  const int E = p.num_experts, K = p.top_k, G = std::max(1, p.n_group), per = E / G;
  std::vector<float> scores(E), choice(E);
  if (p.sigmoid) {
    for (int e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
  } else {
    const float mx = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += (scores[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) scores[e] /= sum;
  }
  for (int e = 0; e < E; ++e) choice[e] = scores[e] + (bias ? bias[e] : 0.0f);
  // Descending by value, ties to the lower index.
  const auto before = [](const std::vector<float>& v) {
    return [&v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  std::vector<char> allowed(E, 1);
  if (p.method != 0 && G > 1) {
    std::vector<float> gs(G);
    for (int g = 0; g < G; ++g) {
      std::vector<float> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(c.begin(), c.end(), std::greater<float>());
      gs[g] = p.method == 2 ? c[0] + (per > 1 ? c[1] : -INFINITY) : c[0];
    }
    std::vector<int> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), before(gs));
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int i = 0; i < p.topk_group; ++i)
      for (int e = order[i] * per; e < (order[i] + 1) * per; ++e) allowed[e] = 1;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) cand.push_back(e);
  std::sort(cand.begin(), cand.end(), before(choice));
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += scores[cand[k]];
  for (int k = 0; k < K; ++k) {
    ids[k] = cand[k];
    w[k] = scores[cand[k]];
    if (p.norm) w[k] /= (sum + p.norm_eps);
    w[k] *= p.scale;
  }
}

void CheckRoute(const RouteParams& p, const std::vector<float>& logits,
                const std::vector<float>& bias, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t T = static_cast<int64_t>(logits.size()) / p.num_experts;
  DeviceBuffer<float> dl(logits), db(bias.empty() ? std::vector<float>{0.0f} : bias);
  DeviceBuffer<int32_t> dids(T * p.top_k);
  DeviceBuffer<float> dw(T * p.top_k);
  Check(RouteTokens(dl.get(), T, p, bias.empty() ? nullptr : db.get(), dids.get(), dw.get(),
                    nullptr));
  const std::vector<int32_t> ids = dids.Download();
  const std::vector<float> w = dw.Download();
  std::vector<int32_t> want_ids(T * p.top_k);
  std::vector<float> want_w(T * p.top_k);
  for (int64_t t = 0; t < T; ++t)
    RouteRef(p, logits.data() + t * p.num_experts, bias.empty() ? nullptr : bias.data(),
             want_ids.data() + t * p.top_k, want_w.data() + t * p.top_k);
  for (int64_t i = 0; i < T * p.top_k; ++i) {
    ASSERT_EQ(ids[i], want_ids[i]) << "token " << i / p.top_k << " slot " << i % p.top_k;
    ASSERT_NEAR(w[i], want_w[i], 1e-6 * std::fabs(want_w[i]))
        << "token " << i / p.top_k << " slot " << i % p.top_k;
  }
}

TEST(GpuKernelTest, RouteTokens) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  struct Cfg {
    int E, K, method, G, TG;
    bool norm;
    float eps, scale;
    bool use_bias;
  };
  const std::vector<Cfg> cfgs = {
      {8, 2, 0, 1, 1, true, 0.0f, 1.0f, false},       // mixtral
      {128, 8, 0, 1, 1, false, 0.0f, 1.0f, false},    // qwen3 un-normalized
      {128, 8, 0, 1, 1, true, 0.0f, 1.0f, true},      // greedy + bias
      {512, 10, 0, 1, 1, true, 0.0f, 1.0f, false},    // wide
      {160, 6, 1, 8, 3, false, 0.0f, 16.0f, false},   // deepseek-v2
      {64, 6, 1, 8, 3, true, 1e-20f, 1.0f, true},     // group limited + bias
      {256, 8, 2, 8, 4, true, 1e-20f, 2.5f, true},    // deepseek-v3
      {512, 16, 2, 16, 4, true, 1e-20f, 1.5f, true},  // max sizes
      {33, 5, 2, 3, 2, false, 0.0f, 1.0f, true},      // E not a multiple of G
      {16, 1, 1, 16, 1, false, 0.0f, 1.0f, false},    // one expert per group
      {7, 7, 0, 1, 1, true, 0.0f, 1.0f, false},       // K == E
  };
  for (const Cfg& c : cfgs) {
    for (bool sigmoid : {false, true}) {
      RouteParams p;
      p.num_experts = c.E;
      p.top_k = c.K;
      p.sigmoid = sigmoid;
      p.method = c.method;
      p.n_group = c.G;
      p.topk_group = c.TG;
      p.norm = c.norm;
      p.norm_eps = c.eps;
      p.scale = c.scale;
      for (int64_t T : {1, 3, 17, 300}) {
        std::normal_distribution<float> nd(0.0f, 2.0f);
        std::vector<float> logits(T * c.E);
        for (float& x : logits) x = nd(rng);
        const std::vector<float> bias =
            c.use_bias ? Random(c.E, rng, -0.1f, 0.1f) : std::vector<float>();
        CheckRoute(p, logits, bias,
                   "E " + std::to_string(c.E) + " K " + std::to_string(c.K) + " method " +
                       std::to_string(c.method) + " sigmoid " + std::to_string(sigmoid) + " T " +
                       std::to_string(T));
      }
    }
  }
}

TEST(GpuKernelTest, RouteTokensTiesGoToLowerIndex) {
  SKIP_WITHOUT_GPU();
  for (bool sigmoid : {false, true}) {
    RouteParams p;
    p.num_experts = 16;
    p.top_k = 4;
    p.sigmoid = sigmoid;
    // All equal except expert 9: 9 first, then 0, 1, 2.
    std::vector<float> logits(16, 0.5f);
    logits[9] = 1.0f;
    DeviceBuffer<float> dl(logits);
    DeviceBuffer<int32_t> dids(4);
    DeviceBuffer<float> dw(4);
    Check(RouteTokens(dl.get(), 1, p, nullptr, dids.get(), dw.get(), nullptr));
    EXPECT_EQ(dids.Download(), (std::vector<int32_t>{9, 0, 1, 2}));
    CheckRoute(p, logits, {}, "tie greedy");

    // Groups of 4 all tied: noaux_tc and group_limited_greedy keep groups 0, 1.
    for (int method : {1, 2}) {
      p.method = method;
      p.n_group = 4;
      p.topk_group = 2;
      std::vector<float> flat(16, 0.25f);
      flat[14] = 0.75f;  // group 3 wins; then group 0 by the tie
      Check(RouteTokens(DeviceBuffer<float>(flat).get(), 1, p, nullptr, dids.get(), dw.get(),
                        nullptr));
      EXPECT_EQ(dids.Download(), (std::vector<int32_t>{14, 0, 1, 2})) << "method " << method;
      CheckRoute(p, flat, {}, "tie groups method " + std::to_string(method));
    }
  }
}

// Expert Deferral's split against the driver's (hmoe::SplitDeferred), with
// ties (repeated weights) that the later slot must win, on odd shapes.
TEST(GpuKernelTest, SplitDeferred) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  for (int64_t T : {1, 3, 32, 77}) {
    for (int64_t K : {2, 6, 8}) {
      for (int64_t n = 0; n < K; ++n) {
        SCOPED_TRACE(::testing::Message() << "T " << T << " K " << K << " n " << n);
        std::vector<int32_t> ids(T * K);
        std::vector<float> w(T * K);
        std::uniform_int_distribution<int> id(0, 255), tie(0, 3);
        for (int64_t i = 0; i < T * K; ++i) {
          ids[i] = id(rng);
          // Few distinct weights: many ties.
          w[i] = 0.125f * static_cast<float>(tie(rng));
        }
        std::vector<int32_t> want_now(T * (K - n)), want_later(T * n);
        std::vector<float> want_wn(T * (K - n)), want_wl(T * n);
        hmoe::SplitDeferred(ids.data(), w.data(), T, K, n, want_now.data(), want_wn.data(),
                            want_later.data(), want_wl.data());
        DeviceBuffer<int32_t> di(ids), dn(T * (K - n)), dl(std::max<int64_t>(1, T * n));
        DeviceBuffer<float> dw(w), dwn(T * (K - n)), dwl(std::max<int64_t>(1, T * n));
        Check(SplitDeferred(di.get(), dw.get(), T, K, n, dn.get(), dwn.get(), dl.get(), dwl.get(),
                            nullptr));
        EXPECT_EQ(dn.Download(), want_now);
        EXPECT_EQ(dwn.Download(), want_wn);
        if (n > 0) {
          EXPECT_EQ(dl.Download(), want_later);
          EXPECT_EQ(dwl.Download(), want_wl);
        }
      }
    }
  }
  EXPECT_EQ(SplitDeferred(nullptr, nullptr, 4, 4, 4, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(SplitDeferred(nullptr, nullptr, 0, 4, 1, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaSuccess);
}

// The device-side wait on a word in mapped host memory: ends when a host
// thread moves the word out of the busy range (not before), when the abort
// word is set, or at the timeout (which then sets abort); the data the host
// wrote before the word is what the stream reads after the wait.
TEST(GpuKernelTest, WaitHostWord) {
  SKIP_WITHOUT_GPU();
  struct Shared {
    uint32_t word, abort, pad[2];
    unsigned long long waited;
    float data[64];
  };
  Shared* h = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&h), sizeof(Shared), cudaHostAllocMapped),
            cudaSuccess);
  Shared* d = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), h, 0), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  DeviceBuffer<float> got(64);
  auto reset = [&](uint32_t word) {
    std::memset(static_cast<void*>(h), 0, sizeof(Shared));
    reinterpret_cast<std::atomic<uint32_t>*>(&h->word)->store(word);
  };
  // 1. Released by the host after 20 ms: the wait takes about that long,
  // and the copy after it sees what the host wrote before the release.
  for (uint32_t done_value : {0u, 3u}) {
    reset(2);
    ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(got.get(), h->data, sizeof(h->data), cudaMemcpyHostToDevice, s),
              cudaSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the wait ended while the word was busy";
    for (int i = 0; i < 64; ++i) h->data[i] = static_cast<float>(i) + 0.5f;
    reinterpret_cast<std::atomic<uint32_t>*>(&h->word)->store(done_value);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    std::vector<float> v = got.Download();
    for (int i = 0; i < 64; ++i) ASSERT_EQ(v[i], static_cast<float>(i) + 0.5f) << i;
    EXPECT_GE(h->waited, 15'000'000ull);
    EXPECT_LT(h->waited, 5'000'000'000ull);
    EXPECT_EQ(h->abort, 0u);
  }
  // 2. A word outside the busy range: no wait at all.
  reset(0);
  Check(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s));
  EXPECT_LT(h->waited, 100'000'000ull);
  // 3. Abort set by the host ends the wait; the word stays busy.
  reset(1);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, nullptr, s), cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  reinterpret_cast<std::atomic<uint32_t>*>(&h->abort)->store(1);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  // 4. The timeout ends it and sets abort; a second wait then ends at once.
  reset(2);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 30'000'000ull, &d->waited, s), cudaSuccess);
  ASSERT_EQ(WaitHostWord(&d->word, 1, 2, &d->abort, 10'000'000'000ull, &d->waited, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(h->abort, 1u);
  EXPECT_GE(h->waited, 25'000'000ull);
  EXPECT_LT(h->waited, 2'000'000'000ull);
  EXPECT_EQ(WaitHostWord(nullptr, 1, 2, &d->abort, 1, nullptr, s), cudaErrorInvalidValue);
  EXPECT_EQ(WaitHostWord(&d->word, 3, 2, &d->abort, 1, nullptr, s), cudaErrorInvalidValue);
  cudaStreamDestroy(s);
  cudaFreeHost(h);
}

// SendExpertCall: the request lands in mapped host memory exactly (odd and
// large shapes: one block and many, vector and scalar copies), the state
// word is set only when armed, and the block counter is back at 0.
TEST(GpuKernelTest, SendExpertCall) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  DeviceBuffer<unsigned int> counter(std::vector<unsigned int>{0});
  for (int64_t T : {1, 3, 33}) {
    for (int64_t H : {7, 8, 2048, 7168}) {
      for (int64_t k : {1, 8}) {
        SCOPED_TRACE(::testing::Message() << "T " << T << " H " << H << " k " << k);
        std::vector<uint16_t> hid(static_cast<size_t>(T * H));
        for (auto& v : hid) v = static_cast<uint16_t>(rng());
        std::vector<int32_t> ids(static_cast<size_t>(T * k));
        for (auto& v : ids) v = static_cast<int32_t>(rng() % 1000);
        const std::vector<float> w = Random(static_cast<size_t>(T * k), rng);
        DeviceBuffer<uint16_t> dh(hid);
        DeviceBuffer<int32_t> di(ids);
        DeviceBuffer<float> dw(w);
        // Host side: hidden | ids | weights | state, armed; 64-aligned as in
        // a slot, with a spare byte after the hidden rows.
        auto align64 = [](size_t n) { return (n + 63) / 64 * 64; };
        const size_t hb = align64(hid.size() * 2 + 1), ib = align64(ids.size() * 4);
        uint8_t* host = nullptr;
        const size_t total = hb + 2 * ib + 64;
        ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), total, cudaHostAllocMapped),
                  cudaSuccess);
        uint8_t* dev = nullptr;
        ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
        for (uint32_t armed : {0u, 1u}) {
          std::memset(host, 0xff, total);
          auto* state = reinterpret_cast<uint32_t*>(host + hb + 2 * ib);
          state[0] = 0;
          state[1] = armed;
          Check(SendExpertCall(
              dh.get(), T, H, di.get(), dw.get(), k, reinterpret_cast<uint16_t*>(dev),
              reinterpret_cast<int32_t*>(dev + hb), reinterpret_cast<float*>(dev + hb + ib),
              reinterpret_cast<uint32_t*>(dev + hb + 2 * ib), 5,
              reinterpret_cast<uint32_t*>(dev + hb + 2 * ib) + 1, nullptr, counter.get(), s));
          ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
          EXPECT_EQ(std::memcmp(host, hid.data(), hid.size() * 2), 0);
          EXPECT_EQ(std::memcmp(host + hb, ids.data(), ids.size() * 4), 0);
          EXPECT_EQ(std::memcmp(host + hb + ib, w.data(), w.size() * 4), 0);
          EXPECT_EQ(host[hid.size() * 2], 0xff) << "wrote past the hidden rows";
          EXPECT_EQ(state[0], armed ? 5u : 0u);
          EXPECT_EQ(counter.Download()[0], 0u);
        }
        cudaFreeHost(host);
      }
    }
  }
  // An aborted pass sends nothing more, armed or not.
  {
    uint32_t* host = nullptr;
    ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), 4096, cudaHostAllocMapped),
              cudaSuccess);
    uint32_t* dev = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
    std::memset(host, 0, 4096);
    host[1] = 1;  // armed
    host[2] = 1;  // aborted
    DeviceBuffer<uint16_t> dh(std::vector<uint16_t>(8, 1));
    DeviceBuffer<int32_t> di(std::vector<int32_t>{3});
    DeviceBuffer<float> dw(std::vector<float>{0.5f});
    Check(SendExpertCall(dh.get(), 1, 8, di.get(), dw.get(), 1,
                         reinterpret_cast<uint16_t*>(dev + 64),
                         reinterpret_cast<int32_t*>(dev + 128), reinterpret_cast<float*>(dev + 192),
                         dev, 5, dev + 1, dev + 2, counter.get(), s));
    EXPECT_EQ(host[0], 0u) << "sent although aborted";
    host[2] = 0;
    Check(SendExpertCall(dh.get(), 1, 8, di.get(), dw.get(), 1,
                         reinterpret_cast<uint16_t*>(dev + 64),
                         reinterpret_cast<int32_t*>(dev + 128), reinterpret_cast<float*>(dev + 192),
                         dev, 5, dev + 1, dev + 2, counter.get(), s));
    EXPECT_EQ(host[0], 5u);
    cudaFreeHost(host);
  }
  EXPECT_EQ(SendExpertCall(nullptr, 1, 8, nullptr, nullptr, 1, nullptr, nullptr, nullptr, nullptr,
                           1, nullptr, nullptr, counter.get(), s),
            cudaErrorInvalidValue);
  cudaStreamDestroy(s);
}

// The device split against hmoe::SplitHot, empty and foreign ids included.
TEST(GpuKernelTest, SplitHotIds) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  for (int64_t n : {1, 7, 256, 1000}) {
    for (int64_t E : {8, 256}) {
      std::vector<int32_t> ids(static_cast<size_t>(n));
      for (auto& v : ids) v = static_cast<int32_t>(rng() % (E + 3)) - 1;  // -1 .. E + 1
      std::vector<uint8_t> mask(static_cast<size_t>(E));
      for (auto& m : mask) m = rng() % 3 == 0;
      std::vector<int32_t> wc(ids.size()), wh(ids.size());
      hmoe::SplitHot(ids.data(), n, mask.data(), E, wc.data(), wh.data());
      DeviceBuffer<int32_t> di(ids), dc(ids.size()), dh(ids.size());
      DeviceBuffer<uint8_t> dm(mask);
      Check(SplitHotIds(di.get(), n, dm.get(), E, dc.get(), dh.get(), nullptr));
      EXPECT_EQ(dc.Download(), wc) << n << " " << E;
      EXPECT_EQ(dh.Download(), wh) << n << " " << E;
    }
  }
  EXPECT_EQ(SplitHotIds(nullptr, 4, nullptr, 8, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

// Hot experts on the GPU against the expert service's scalar reference
// (RunMoeReference, "few tokens" regime) over the same quantized weights
// (QuantizeExpert), every format, odd shapes (partial int4 groups), some
// experts not hot, empty and foreign slots.
TEST(GpuKernelTest, HotExpertsMatchTheServiceReference) {
  SKIP_WITHOUT_GPU();
  struct Fmt {
    WeightFormat f;
    int group;
  };
  const Fmt fmts[] = {{WeightFormat::kBf16, 128},
                      {WeightFormat::kInt8, 128},
                      {WeightFormat::kInt4, 32},
                      {WeightFormat::kInt4, 64},
                      {WeightFormat::kInt4, 128}};
  const std::pair<int64_t, int64_t> shapes[] = {{96, 40}, {200, 64}, {2048, 96}};
  constexpr int64_t E = 6;
  const bool hot_e[E] = {true, false, true, true, false, true};
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> keep;
  // The backend's layout (gpu_worker/hot_weights.h), uploaded.
  auto upload = [&](const QuantMatrix& m, WeightFormat f) {
    const HostQuantMatrix h = ToKernelLayout(m);
    EXPECT_EQ(h.format, f);
    DevQuantMatrix d;
    d.format = h.format;
    d.group = h.group;
    d.rows = h.rows;
    d.cols = h.cols;
    keep.push_back(std::make_unique<DeviceBuffer<uint8_t>>(h.w));
    d.w = keep.back()->get();
    if (!h.scale.empty()) {
      std::vector<uint8_t> sb(h.scale.size() * 4);
      std::memcpy(sb.data(), h.scale.data(), sb.size());
      keep.push_back(std::make_unique<DeviceBuffer<uint8_t>>(sb));
      d.scale = reinterpret_cast<const float*>(keep.back()->get());
    }
    return d;
  };
  for (const Fmt& fm : fmts) {
    for (const auto& [H, I] : shapes) {
      SCOPED_TRACE(::testing::Message()
                   << WeightFormatName(fm.f) << " g" << fm.group << " H " << H << " I " << I);
      const MoeWeightsSource src = testing::RandomSource(H, I, E, 17 + static_cast<uint64_t>(H));
      PackOptions po;
      po.format = fm.f;
      po.group = fm.group;
      std::vector<QuantExpert> q;
      std::vector<DevExpert> dev(E);
      for (int64_t e = 0; e < E; ++e) {
        auto w = src.expert(e);
        ASSERT_TRUE(w.ok()) << w.status();
        auto qe = QuantizeExpert(*w, src, po);
        ASSERT_TRUE(qe.ok()) << qe.status();
        q.push_back(std::move(*qe));
        if (hot_e[e])
          dev[static_cast<size_t>(e)] = DevExpert{
              upload(q.back().gate, fm.f), upload(q.back().up, fm.f), upload(q.back().down, fm.f)};
      }
      std::vector<uint8_t> dev_bytes(sizeof(DevExpert) * E);
      std::memcpy(dev_bytes.data(), dev.data(), dev_bytes.size());
      DeviceBuffer<uint8_t> dexperts(dev_bytes);
      for (int64_t T : {1, 3, 9}) {
        for (int K : {2, 4}) {
          SCOPED_TRACE(::testing::Message() << "T " << T << " K " << K);
          testing::Batch b = testing::RandomBatch(T, K, H, E, 100 + static_cast<uint64_t>(T * K),
                                                  true, -1, /*foreign=*/true);
          std::vector<int32_t> ref_ids = b.ids;  // only the hot experts' slots
          for (int32_t& id : ref_ids)
            if (id >= 0 && id < E && !hot_e[id]) id = hmoe::kNoExpert;
          RunOptions ro;
          ro.many_threshold = ro.many_threshold_int4 = 1 << 20;  // the "few tokens" regime
          std::vector<float> want(static_cast<size_t>(T * H));
          const MoeInput in{T, K, b.x.data(), ref_ids.data(), b.w.data()};
          ASSERT_TRUE(RunMoeReference(q, H, 0, in, want.data(), ro).ok());
          DeviceBuffer<uint16_t> dx(b.x);
          DeviceBuffer<int32_t> di(b.ids);
          DeviceBuffer<float> dw(b.w), dout(static_cast<size_t>(T * H));
          const int64_t sb = HotExpertsScratchBytes(T, H, I, K);
          DeviceBuffer<uint8_t> scratch(static_cast<size_t>(sb));
          HotExpertsArgs a;
          a.x = dx.get();
          a.T = T;
          a.H = H;
          a.I = I;
          a.ids = di.get();
          a.weights = dw.get();
          a.K = K;
          a.experts = reinterpret_cast<const DevExpert*>(dexperts.get());
          a.E = E;
          a.out = dout.get();
          a.scratch = scratch.get();
          a.scratch_bytes = sb;
          Check(HotExperts(a, nullptr));
          const std::vector<float> got = dout.Download();
          EXPECT_LE(testing::RelErr(got, want), 1e-3);
          a.scratch_bytes = sb - 1;
          EXPECT_EQ(HotExperts(a, nullptr), cudaErrorInvalidValue);
        }
      }
    }
  }
}

// DequantToBf16 against the host's bf16(q * scale), bit for bit: bf16, int8
// and int4 (groups 32 and 64, the even column in the low nibble), odd shapes.
TEST(GpuKernelTest, DequantToBf16) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{3, 37}, {5, 64}, {7, 130}, {1, 1}}) {
    for (const auto& [format, group] : {std::pair<WeightFormat, int>{WeightFormat::kBf16, 0},
                                        {WeightFormat::kInt8, 0},
                                        {WeightFormat::kInt4, 32},
                                        {WeightFormat::kInt4, 64}}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " format "
                                        << WeightFormatName(format) << " group " << group);
      std::vector<uint8_t> w;
      std::vector<float> scale;
      std::vector<uint16_t> want(static_cast<size_t>(rows * cols));
      const int64_t half = (cols + 1) / 2, ng = group > 0 ? (cols + group - 1) / group : 0;
      if (format == WeightFormat::kBf16) {
        const std::vector<uint16_t> b = RandomBf16(want.size(), rng);
        w.resize(b.size() * 2);
        std::memcpy(w.data(), b.data(), w.size());
        want = b;
      } else if (format == WeightFormat::kInt8) {
        w.resize(want.size());
        scale = Random(static_cast<size_t>(rows), rng, 0.001f, 0.1f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int q = static_cast<int>(rng() % 255) - 127;
            w[static_cast<size_t>(r * cols + c)] = static_cast<uint8_t>(static_cast<int8_t>(q));
            want[static_cast<size_t>(r * cols + c)] =
                HostBf16(static_cast<float>(q) * scale[static_cast<size_t>(r)]);
          }
      } else {
        w.assign(static_cast<size_t>(rows * half), 0);
        scale = Random(static_cast<size_t>(rows * ng), rng, 0.001f, 0.1f);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int q = static_cast<int>(rng() % 16) - 8;
            w[static_cast<size_t>(r * half + c / 2)] |=
                static_cast<uint8_t>((q & 0xF) << (4 * (c % 2)));
            want[static_cast<size_t>(r * cols + c)] =
                HostBf16(static_cast<float>(q) * scale[static_cast<size_t>(r * ng + c / group)]);
          }
      }
      DeviceBuffer<uint8_t> dw(w);
      DeviceBuffer<float> ds(scale);
      DeviceBuffer<uint16_t> out(want.size());
      DevQuantMatrix m;
      m.format = format;
      m.group = group;
      m.rows = rows;
      m.cols = cols;
      m.w = dw.get();
      m.scale = format == WeightFormat::kBf16 ? nullptr : ds.get();
      Check(DequantToBf16(m, out.get(), nullptr));
      EXPECT_EQ(out.Download(), want);
    }
  }
}

// The streamed experts' data movers: gather rows, weighted scatter into
// slots, the marked slots' sum per token in slot order.
TEST(GpuKernelTest, StreamedExpertsGatherScatterSum) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(12);
  const int64_t T = 5, K = 3, H = 19;  // H odd: the unvectorized paths
  for (int64_t cols : {H, int64_t{24}}) {
    const std::vector<uint16_t> x = RandomBf16(static_cast<size_t>(T * cols), rng);
    const std::vector<int32_t> rows = {4, 0, 0, 3, 2};
    DeviceBuffer<uint16_t> dx(x), g(rows.size() * static_cast<size_t>(cols));
    DeviceBuffer<int32_t> dr(rows);
    Check(GatherBf16Rows(dx.get(), cols, dr.get(), static_cast<int64_t>(rows.size()), g.get(),
                         nullptr));
    const std::vector<uint16_t> got = g.Download();
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t c = 0; c < cols; ++c)
        EXPECT_EQ(got[i * static_cast<size_t>(cols) + static_cast<size_t>(c)],
                  x[static_cast<size_t>(rows[i] * cols + c)]);
  }
  // Slots 1, 5, 6, 14 computed (marked); z rows in that order.
  const std::vector<int32_t> slots = {6, 1, 14, 5};
  const std::vector<float> z = Random(slots.size() * H, rng);
  const std::vector<float> w = Random(static_cast<size_t>(T * K), rng, 0.1f, 1.0f);
  DeviceBuffer<float> dz(z), dw(w), ys(static_cast<size_t>(T * K * H)),
      out(static_cast<size_t>(T * H));
  DeviceBuffer<int32_t> ds(slots);
  Check(ScatterWeightedRows(dz.get(), H, ds.get(), static_cast<int64_t>(slots.size()), dw.get(),
                            ys.get(), nullptr));
  std::vector<uint8_t> marks(static_cast<size_t>(T * K), 0);
  for (int32_t s : slots) marks[static_cast<size_t>(s)] = 1;
  DeviceBuffer<uint8_t> dm(marks);
  Check(SumMarkedSlots(ys.get(), dm.get(), T, K, H, out.get(), nullptr));
  std::vector<float> yw(static_cast<size_t>(T * K * H), 0.0f);
  for (size_t i = 0; i < slots.size(); ++i)
    for (int64_t c = 0; c < H; ++c)
      yw[static_cast<size_t>(slots[i] * H + c)] =
          w[static_cast<size_t>(slots[i])] * z[i * static_cast<size_t>(H) + static_cast<size_t>(c)];
  const std::vector<float> got = out.Download();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float want = 0.0f;
      for (int64_t j = 0; j < K; ++j)
        if (marks[static_cast<size_t>(t * K + j)])
          want += yw[static_cast<size_t>((t * K + j) * H + c)];
      EXPECT_EQ(Bits(got[static_cast<size_t>(t * H + c)]), Bits(want)) << t << "," << c;
    }
}

}  // namespace
}  // namespace hmoe::cuda
