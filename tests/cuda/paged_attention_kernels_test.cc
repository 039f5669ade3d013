// Paged attention, the GQA cache write (gpu_worker/cuda/paged_attention_kernels.h) and GEMM
// attention (gemm_attention.h), against a plain CPU reference (hmoe::cpu ops where one exists, a
// scalar loop here otherwise), on many shapes, odd ones included. Skips without a usable CUDA
// device.
#include "gpu_worker/cuda/paged_attention_kernels.h"

#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/kv_quant.h"
#include "gpu_worker/cpu/ops.h"
#include "gpu_worker/cuda/gemm_attention.h"
#include "tests/cuda/kernel_test_util.h"

namespace hmoe::cuda {
namespace {

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
  KvElem kv = KvElem::kF32;  // the caches' element type
};

// A cache as stored in element type `e` (bytes, kFp8's scales: `parts` per
// row, element i of a row in part min(i / part_len, parts - 1)), and the f32
// values it reads back as.
struct StoredCache {
  std::vector<uint8_t> bytes;
  std::vector<float> scale, values;
};

StoredCache Store(const std::vector<float>& x, int64_t rows, int64_t row, KvElem e,
                  int64_t part_len, int64_t parts) {
  StoredCache s;
  s.values = x;
  s.bytes.resize(static_cast<size_t>(rows * row * KvElemBytes(e)));
  if (e == KvElem::kF32) {
    std::memcpy(s.bytes.data(), x.data(), s.bytes.size());
    return s;
  }
  if (e == KvElem::kFp8) s.scale.resize(static_cast<size_t>(rows * parts));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < (e == KvElem::kFp8 ? parts : 1); ++p) {
      const int64_t lo = e == KvElem::kFp8 ? p * part_len : 0;
      const int64_t hi = e == KvElem::kFp8 && p < parts - 1 ? lo + part_len : row;
      const int64_t i0 = r * row + lo;
      if (e == KvElem::kBf16) {
        for (int64_t i = i0; i < r * row + hi; ++i) {
          const uint16_t b = KvToBf16(x[i]);
          std::memcpy(s.bytes.data() + 2 * i, &b, 2);
          s.values[i] = KvFromBf16(b);
        }
      } else {
        const float sc = KvEncodeFp8Part(x.data() + i0, hi - lo, s.bytes.data() + i0);
        s.scale[r * parts + p] = sc;
        for (int64_t i = i0; i < r * row + hi; ++i) s.values[i] = KvFp8Value(s.bytes[i], sc);
      }
    }
  }
  return s;
}

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
  // The caches as stored in c.kv; the reference reads the values they hold.
  const int64_t part_len = c.mla ? c.dv : c.dk, parts = c.mla ? 2 : c.kv_heads;
  const StoredCache ks = Store(Random(rows * k_row, rng), rows, k_row, c.kv, part_len, parts);
  const StoredCache vs =
      c.mla ? StoredCache() : Store(Random(rows * v_row, rng), rows, v_row, c.kv, part_len, parts);
  const std::vector<float>& kc = ks.values;
  const std::vector<float>& vc = vs.values;
  const int64_t q_ts = c.heads * c.dk + c.q_pad;
  const std::vector<float> q = Random(T * q_ts, rng, -2.0f, 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));

  DeviceBuffer<float> dq(q);
  DeviceBuffer<uint8_t> dk(ks.bytes), dv(c.mla ? std::vector<uint8_t>{0} : vs.bytes);
  DeviceBuffer<float> dks(ks.scale.empty() ? std::vector<float>{0.0f} : ks.scale);
  DeviceBuffer<float> dvs(vs.scale.empty() ? std::vector<float>{0.0f} : vs.scale);
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
  a.kv = c.kv;
  a.k_scale = dks.get();
  a.v_scale = c.mla ? dks.get() : dvs.get();
  a.kv_part_len = part_len;
  a.kv_parts = parts;
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

// ---- KV caches in bf16 / fp8 (common/kv_quant.h) -------------------------------------

// PagedAttention and GEMM attention read bf16 / fp8 caches (converting as
// they load) like an f32 cache holding the decoded values.
TEST(GpuKernelTest, PagedAttentionReadsRoundedCaches) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  auto with = [](AttnCase c, KvElem kv, int64_t gemm_min = 0) {
    c.kv = kv;
    c.name += kv == KvElem::kBf16 ? " bf16" : " fp8";
    c.gemm_min = gemm_min;
    return c;
  };
  for (KvElem kv : {KvElem::kBf16, KvElem::kFp8}) {
    RunAttention(with({"mla", true, 16, 1, 576, 512, 16, 0, {{1, 1}, {133, 33}, {1000, 1}}}, kv),
                 rng);
    RunAttention(with({"mla odd", true, 12, 1, 72, 40, 7, 0, {{29, 5}, {100, 1}}, 3}, kv), rng);
    RunAttention(with({"mla scalar", true, 3, 1, 37, 33, 5, 0, {{50, 4}, {1, 1}}, 1}, kv), rng);
    RunAttention(with({"gqa", false, 32, 4, 128, 128, 16, 0, {{17, 17}, {300, 64}, {2000, 1}}}, kv),
                 rng);
    RunAttention(with({"gqa hd33 scalar", false, 4, 2, 33, 33, 3, 0, {{70, 9}, {500, 1}}}, kv),
                 rng);
    RunAttention(with({"gqa window", false, 8, 2, 64, 64, 16, 37, {{300, 64}, {1000, 1}}}, kv),
                 rng);
    RunAttention(with({"mla gemm", true, 16, 1, 576, 512, 16, 0, {{300, 300}, {1, 1}}}, kv, 4),
                 rng);
    RunAttention(with({"gqa gemm", false, 32, 4, 128, 128, 16, 0, {{400, 400}, {90, 70}}}, kv, 16),
                 rng);
  }
}

// The cache write stores each row exactly as the host encoding does.
TEST(GpuKernelTest, WriteKvCacheRoundsLikeTheHost) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(22);
  for (KvElem kv : {KvElem::kF32, KvElem::kBf16, KvElem::kFp8}) {
    for (int64_t hd : {1, 33, 128}) {
      for (int64_t nkv : {1, 3, 8}) {
        const int64_t row = hd * nkv, T = 37, slots = T + 9;
        SCOPED_TRACE(::testing::Message()
                     << "kv " << static_cast<int>(kv) << " hd " << hd << " nkv " << nkv);
        std::vector<float> k = Random(T * row, rng, -30.0f, 30.0f), v = Random(T * row, rng);
        for (int64_t i = 0; i < hd; ++i) k[i] = 0.0f;  // a zero part: scale 0
        if (hd > 1) k[row + 1] = 448.0f;
        std::vector<int32_t> perm(slots);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int32_t> slot(perm.begin(), perm.begin() + T);
        slot[2] = -1;  // skipped
        const int64_t eb = KvElemBytes(kv);
        DeviceBuffer<float> dk(k), dv(v);
        DeviceBuffer<uint8_t> dkc(std::vector<uint8_t>(slots * row * eb, 0xab)),
            dvc(std::vector<uint8_t>(slots * row * eb, 0xab));
        DeviceBuffer<float> dks(std::vector<float>(slots * nkv, -1.0f)),
            dvs(std::vector<float>(slots * nkv, -1.0f));
        DeviceBuffer<int32_t> ds(slot);
        KvRows kr, vr;
        kr.data = dkc.get();
        kr.scale = dks.get();
        kr.elem = kv;
        kr.row = row;
        kr.part_len = hd;
        kr.parts = nkv;
        vr = kr;
        vr.data = dvc.get();
        vr.scale = dvs.get();
        Check(WriteKvCache(dk.get(), dv.get(), T, ds.get(), kr, vr, nullptr));
        const auto kb = dkc.Download(), vb = dvc.Download();
        const auto ksc = dks.Download(), vsc = dvs.Download();
        const StoredCache ke = Store(k, T, row, kv, hd, nkv), ve = Store(v, T, row, kv, hd, nkv);
        for (int64_t t = 0; t < T; ++t) {
          if (slot[t] < 0) continue;
          const size_t n = static_cast<size_t>(row * eb);
          EXPECT_EQ(std::memcmp(kb.data() + slot[t] * n, ke.bytes.data() + t * n, n), 0) << t;
          EXPECT_EQ(std::memcmp(vb.data() + slot[t] * n, ve.bytes.data() + t * n, n), 0) << t;
          if (kv == KvElem::kFp8)
            for (int64_t p = 0; p < nkv; ++p) {
              EXPECT_EQ(ksc[slot[t] * nkv + p], ke.scale[t * nkv + p]) << t;
              EXPECT_EQ(vsc[slot[t] * nkv + p], ve.scale[t * nkv + p]) << t;
            }
        }
        if (kv == KvElem::kFp8) {
          EXPECT_EQ(ksc[slot[0] * nkv], 0.0f);  // token 0's first part is all zeros
        }
      }
    }
  }
}

TEST(GpuKernelTest, GatherPagedRowsDecodes) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  for (KvElem kv : {KvElem::kBf16, KvElem::kFp8}) {
    for (int64_t row : {576, 37}) {
      const int64_t bt = 16, blocks = 6, rows = blocks * bt, part_len = row == 576 ? 512 : 10,
                    parts = 2;
      const StoredCache c = Store(Random(rows * row, rng), rows, row, kv, part_len, parts);
      const std::vector<int32_t> table = {4, 0, 5, 2};
      DeviceBuffer<uint8_t> db(c.bytes);
      DeviceBuffer<float> dsc(c.scale.empty() ? std::vector<float>{0.0f} : c.scale);
      DeviceBuffer<int32_t> dt(table);
      const int64_t p0 = 5, n = 50;
      DeviceBuffer<float> dout(n * row);
      KvRows r;
      r.data = db.get();
      r.scale = dsc.get();
      r.elem = kv;
      r.row = row;
      r.part_len = part_len;
      r.parts = parts;
      Check(GatherPagedRows(r, dt.get(), bt, p0, n, dout.get(), nullptr));
      const auto got = dout.Download();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = p0 + i, pr = table[p / bt] * bt + p % bt;
        for (int64_t e = 0; e < row; ++e)
          ASSERT_EQ(got[i * row + e], c.values[pr * row + e]) << i << " " << e;
      }
    }
  }
}

}  // namespace
}  // namespace hmoe::cuda
