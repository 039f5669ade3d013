#include "gpu_worker/cuda/gemm_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "gpu_worker/cuda/device_memory.h"

namespace hmoe::cuda {
namespace {

struct KeyRange {
  int64_t lo = 0, hi = 0;  // the run's visible key positions [lo, hi)
  int64_t n() const { return hi - lo; }
};

KeyRange KeysOf(const PagedAttentionArgs& a, const AttentionRun& run) {
  KeyRange k;
  k.lo = a.window > 0 ? std::max<int64_t>(0, run.pos0 - a.window + 1) : 0;
  k.hi = run.pos0 + run.n;
  return k;
}

bool SharedValues(const PagedAttentionArgs& a) {
  return a.v_cache == a.k_cache && a.v_scale == a.k_scale && a.v_row == a.k_row;
}

// The key (values: false) cache of `a`, for GatherPagedRows (which only reads).
KvRows CacheRows(const PagedAttentionArgs& a, bool keys) {
  KvRows c;
  c.data = const_cast<void*>(keys ? a.k_cache : a.v_cache);
  c.scale = const_cast<float*>(keys ? a.k_scale : a.v_scale);
  c.elem = a.kv;
  c.row = keys ? a.k_row : a.v_row;
  c.part_len = a.kv_part_len;
  c.parts = a.kv_parts;
  return c;
}

// Keys a chunk of `chunk` queries sees at most.
int64_t ChunkKeys(const PagedAttentionArgs& a, const KeyRange& keys, int64_t chunk) {
  return a.window > 0 ? std::min(keys.n(), chunk + a.window - 1) : keys.n();
}

absl::Status Blas(cublasStatus_t st, const char* what, int64_t m, int64_t n, int64_t k) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLAS GemmStridedBatchedEx (attention ", what, ", ", m,
                                          "x", n, "x", k, "): ", cublasGetStatusString(st)));
}

}  // namespace

std::vector<AttentionRun> FindAttentionRuns(const int32_t* table_start, const int32_t* pos,
                                            int64_t T, int64_t min_tokens) {
  std::vector<AttentionRun> runs;
  min_tokens = std::max<int64_t>(1, min_tokens);
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1;
    while (e < T && table_start[e] == table_start[t] && pos[e] == pos[e - 1] + 1) ++e;
    if (e - t >= min_tokens) runs.push_back({t, e - t, pos[t], table_start[t]});
    t = e;
  }
  return runs;
}

int64_t GemmAttentionScratchFloats(const PagedAttentionArgs& a, const AttentionRun& run,
                                   int64_t chunk) {
  const KeyRange keys = KeysOf(a, run);
  const int64_t group = a.num_heads / std::max<int64_t>(1, a.num_kv_heads);
  const int64_t kv = keys.n() * (a.k_row + (SharedValues(a) ? 0 : a.v_row));
  return kv + group * chunk * ChunkKeys(a, keys, chunk);
}

int64_t GemmAttentionChunk(const PagedAttentionArgs& a, const AttentionRun& run,
                           int64_t scratch_floats) {
  int64_t c = std::min(run.n, kMaxGemmAttentionChunk);
  while (c > 0 && GemmAttentionScratchFloats(a, run, c) > scratch_floats) c /= 2;
  return c;
}

absl::Status GemmAttention(const PagedAttentionArgs& a, const AttentionRun& run,
                           const GemmAttentionOptions& o, cublasHandle_t blas, cudaStream_t s,
                           int64_t* launches) {
  if (run.n <= 0) return absl::OkStatus();
  const int64_t scratch_floats = o.scratch_floats;
  const int64_t chunk = GemmAttentionChunk(a, run, scratch_floats);
  if (chunk <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "GEMM attention of a run of ", run.n, " tokens at position ", run.pos0, " needs ",
        GemmAttentionScratchFloats(a, run, 1), " floats of scratch, has ", scratch_floats));
  int64_t count = 0;
  auto launched = [&](cudaError_t e, const char* what) {
    ++count;
    return e == cudaSuccess ? absl::OkStatus() : CudaError(e, what);
  };
  const KeyRange keys = KeysOf(a, run);
  const int32_t* table = a.block_table + run.table_start;
  const bool shared = SharedValues(a);
  const cublasComputeType_t compute = o.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  float* kc = o.scratch;
  float* vc = shared ? kc : kc + keys.n() * a.k_row;
  const int64_t v_ld = shared ? a.k_row : a.v_row;
  float* scores = kc + keys.n() * a.k_row + (shared ? 0 : keys.n() * a.v_row);
  absl::Status st =
      launched(GatherPagedRows(CacheRows(a, true), table, a.block_tokens, keys.lo, keys.n(), kc, s),
               "GatherPagedRows (keys)");
  if (st.ok() && !shared)
    st = launched(
        GatherPagedRows(CacheRows(a, false), table, a.block_tokens, keys.lo, keys.n(), vc, s),
        "GatherPagedRows (values)");
  const int64_t group = a.num_heads / a.num_kv_heads;
  const float one = 1.0f, zero = 0.0f;
  for (int64_t q0 = 0; st.ok() && q0 < run.n; q0 += chunk) {
    const int64_t qn = std::min(chunk, run.n - q0), qp = run.pos0 + q0;
    const int64_t k_lo = a.window > 0 ? std::max(keys.lo, qp - a.window + 1) : keys.lo;
    const int64_t nk = qp + qn - k_lo;
    for (int64_t g = 0; st.ok() && g < a.num_kv_heads; ++g) {
      // Column-major: scores_j^T [nk x qn] = K [nk x dk] . q_j^T [dk x qn], j < group.
      ++count;
      st = Blas(
          cublasGemmStridedBatchedEx(
              blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nk), static_cast<int>(qn),
              static_cast<int>(a.dk), &a.scale,
              kc + (k_lo - keys.lo) * a.k_row + g * a.k_head_offset, CUDA_R_32F,
              static_cast<int>(a.k_row), 0,
              a.q + (run.row0 + q0) * a.q_tok_stride + g * group * a.q_head_stride, CUDA_R_32F,
              static_cast<int>(a.q_tok_stride), a.q_head_stride, &zero, scores, CUDA_R_32F,
              static_cast<int>(nk), qn * nk, static_cast<int>(group), compute, CUBLAS_GEMM_DEFAULT),
          "scores", nk, qn, a.dk);
      if (!st.ok()) break;
      st = launched(MaskedSoftmaxRows(scores, group * qn, nk, qn, qp, k_lo, a.window, s),
                    "MaskedSoftmaxRows");
      if (!st.ok()) break;
      // out_j^T [dv x qn] = V^T [dv x nk] . p_j^T [nk x qn].
      ++count;
      st = Blas(cublasGemmStridedBatchedEx(
                    blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(a.dv), static_cast<int>(qn),
                    static_cast<int>(nk), &one, vc + (k_lo - keys.lo) * v_ld + g * a.v_head_offset,
                    CUDA_R_32F, static_cast<int>(v_ld), 0, scores, CUDA_R_32F, static_cast<int>(nk),
                    qn * nk, &zero,
                    a.out + (run.row0 + q0) * a.out_tok_stride + g * group * a.out_head_stride,
                    CUDA_R_32F, static_cast<int>(a.out_tok_stride), a.out_head_stride,
                    static_cast<int>(group), compute, CUBLAS_GEMM_DEFAULT),
                "values", a.dv, qn, nk);
    }
  }
  if (launches) *launches += count;
  return st;
}

absl::Status AttendPass(const PagedAttentionArgs& a, const std::vector<AttentionRun>& runs,
                        const GemmAttentionOptions& o, cublasHandle_t blas, cudaStream_t s,
                        int64_t* launches, int64_t* gemm_tokens) {
  // Tokens [from, to) by PagedAttention.
  auto paged = [&](int64_t from, int64_t to) -> absl::Status {
    if (to <= from) return absl::OkStatus();
    PagedAttentionArgs p = a;
    p.q += from * a.q_tok_stride;
    p.out += from * a.out_tok_stride;
    p.pos += from;
    p.table_start += from;
    p.T = to - from;
    if (p.scratch && PagedAttentionScratchFloats(p) > p.scratch_floats) {
      p.scratch = nullptr;
      p.scratch_floats = 0;
    }
    if (launches) ++*launches;
    const cudaError_t e = PagedAttention(p, s);
    return e == cudaSuccess ? absl::OkStatus() : CudaError(e, "PagedAttention");
  };
  int64_t next = 0;  // first token not yet enqueued
  for (const AttentionRun& run : runs) {
    if (GemmAttentionChunk(a, run, o.scratch_floats) <= 0) continue;
    if (absl::Status st = paged(next, run.row0); !st.ok()) return st;
    if (absl::Status st = GemmAttention(a, run, o, blas, s, launches); !st.ok()) return st;
    next = run.row0 + run.n;
    if (gemm_tokens) *gemm_tokens += run.n;
  }
  return paged(next, a.T);
}

}  // namespace hmoe::cuda
