// CudaBackend's attention (cuda_backend_impl.h): MLA and GQA over the paged
// KV cache, by PagedAttention or, for a pass's long runs, GEMM attention.
#include <algorithm>

#include "common/status.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"
#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/mla_kernels.h"
#include "gpu_worker/cuda/paged_attention_kernels.h"

namespace hmoe::cuda {
namespace {

// GEMM attention's scratch (gathered keys, one query chunk's scores): at most
// this much, taken at the first pass with a long run.
constexpr int64_t kGemmAttentionScratchBytes = int64_t{1} << 30;

}  // namespace

absl::Status CudaBackend::Attend(PagedAttentionArgs& a, int64_t window) {
  a.block_table = table_;
  a.table_start = tstart_;
  a.pos = pos_;
  a.block_tokens = kBlockTokens;
  a.window = window;
  a.scale = geo_.softmax_scale;
  const int64_t need = PagedAttentionScratchFloats(a);
  if (need > 0 && need * 4 <= attn_scratch_.bytes()) {
    a.scratch = attn_scratch_.as<float>();
    a.scratch_floats = attn_scratch_.bytes() / 4;
  }
  if (runs_.empty()) return Launched(PagedAttention(a, stream_), "PagedAttention");
  GemmAttentionOptions g;
  g.scratch = gemm_scratch_.as<float>();
  g.scratch_floats = gemm_scratch_.bytes() / 4;
  g.tf32 = cu_.gemm_attention_tf32;
  absl::Status st = AttendPass(a, runs_, g, blas_, stream_, &launches_, &gemm_attention_tokens_);
  return st.ok() ? st : Failed(st);
}

KvRows CudaBackend::CacheRows(int l, bool keys) const {
  KvRows c;
  const size_t i = static_cast<size_t>(l);
  if (i < kcache_.size()) {
    c.data = keys ? kcache_[i].as<void>() : vcache_[i].as<void>();
    c.scale = keys ? kscale_[i].as<float>() : vscale_[i].as<float>();
  }
  c.elem = kv_;
  c.row = keys ? k_row_ : v_row_;
  c.part_len = kv_part_len_;
  c.parts = kv_parts_;
  return c;
}

void CudaBackend::SetCaches(int l, PagedAttentionArgs* a) const {
  const KvRows k = CacheRows(l, true), v = v_row_ > 0 ? CacheRows(l, false) : k;
  a->k_cache = k.data;
  a->k_scale = k.scale;
  a->k_row = k.row;
  a->v_cache = v.data;
  a->v_scale = v.scale;
  a->v_row = v.row;
  a->kv = kv_;
  a->kv_part_len = kv_part_len_;
  a->kv_parts = kv_parts_;
}

PagedAttentionArgs CudaBackend::AttentionShape() const {
  PagedAttentionArgs a;
  const AttentionSpec& s = attn_specs_[0];
  const bool values = s.cache.v_row > 0;  // else read from the key rows
  SetCaches(0, &a);
  a.num_heads = s.num_heads;
  a.dk = s.dk;
  a.dv = s.dv;
  a.k_row = s.cache.k_row;
  a.v_row = values ? s.cache.v_row : s.cache.k_row;
  a.num_kv_heads = s.num_kv_heads;
  return a;
}

absl::Status CudaBackend::PlanGemmAttention(const int32_t* tstart, const int32_t* pos, int64_t T) {
  runs_.clear();
  const int64_t min_tokens = cu_.gemm_attention_tokens;
  if (min_tokens <= 0 || T < min_tokens) return absl::OkStatus();
  runs_ = FindAttentionRuns(tstart, pos, T, min_tokens);
  const PagedAttentionArgs shape = AttentionShape();
  int64_t want = 0, least = 0;  // bytes: every run at its full chunk; one query
  for (const AttentionRun& r : runs_) {
    want = std::max(
        want, 4 * GemmAttentionScratchFloats(shape, r, std::min(r.n, kMaxGemmAttentionChunk)));
    least = std::max(least, 4 * GemmAttentionScratchFloats(shape, r, 1));
  }
  want = std::max(least, std::min(want, kGemmAttentionScratchBytes));
  if (want <= gemm_scratch_.bytes()) return absl::OkStatus();
  // Grow to `want`, or to what the budget has room for (runs that do not
  // fit then take PagedAttention).
  const int64_t old = gemm_scratch_.bytes();
  const int64_t room = budget_.limit() - budget_.used() + old;
  const int64_t bytes = std::min(want, room);
  if (bytes <= old) return absl::OkStatus();
  budget_.Give(old, "attention scratch");
  RETURN_IF_ERROR(gemm_scratch_.Allocate(0));
  RETURN_IF_ERROR(budget_.Take(bytes, "attention scratch"));
  if (!gemm_scratch_.Allocate(bytes).ok()) {  // out of device memory: PagedAttention
    budget_.Give(bytes, "attention scratch");
    cudaGetLastError();
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::MlaAttention(int l) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, nh = c_.num_heads, r = c_.mla.kv_lora_rank,
                rope = c_.mla.qk_rope_head_dim, nope = c_.mla.qk_nope_head_dim,
                vd = c_.mla.v_head_dim;
  const bool inter = geo_.rope_layout == RopeLayout::kInterleaved;
  if (c_.mla.q_lora_rank) {
    const int64_t qr = *c_.mla.q_lora_rank;
    RETURN_IF_ERROR(Gemm(L.q_a, buf_.normed_bf16, T, buf_.q_a));
    RETURN_IF_ERROR(Launched(AddRmsNorm(buf_.q_a, nullptr, T, qr, L.q_a_norm.as<float>(),
                                        kMlaNormEps, nullptr, buf_.q_a_bf16, stream_),
                             "AddRmsNorm"));
    RETURN_IF_ERROR(Gemm(L.q_b, buf_.q_a_bf16, T, buf_.q));
  } else {
    RETURN_IF_ERROR(Gemm(L.q, buf_.normed_bf16, T, buf_.q));
  }
  RETURN_IF_ERROR(Gemm(L.kv_a, buf_.normed_bf16, T, buf_.kv_a));
  RETURN_IF_ERROR(
      Launched(WriteMlaCache(buf_.kv_a, T, r, rope, L.kv_a_norm.as<float>(), kMlaNormEps,
                             buf_.rope_cs, inter, slot_, CacheRows(l, true), stream_),
               "WriteMlaCache"));
  RETURN_IF_ERROR(Launched(MlaAbsorbQuery(buf_.q, L.kv_b.w.as<uint16_t>(), T, nh, nope, rope, vd, r,
                                          buf_.q_latent, stream_),
                           "MlaAbsorbQuery"));
  RETURN_IF_ERROR(Launched(ApplyRope(buf_.q_latent, T, nh, nh * (r + rope), r + rope, r, rope,
                                     buf_.rope_cs, inter, stream_),
                           "ApplyRope"));
  PagedAttentionArgs a;
  a.q = buf_.q_latent;
  a.q_tok_stride = nh * (r + rope);
  a.q_head_stride = r + rope;
  a.dk = r + rope;
  SetCaches(l, &a);  // values: the latents, the key rows' first r elements
  a.dv = r;
  a.T = T;
  a.num_heads = nh;
  a.num_kv_heads = 1;
  a.out = buf_.out_latent;
  a.out_tok_stride = nh * r;
  a.out_head_stride = r;
  RETURN_IF_ERROR(Attend(a, L.window));
  RETURN_IF_ERROR(Launched(MlaExpandOutput(buf_.out_latent, L.kv_b.w.as<uint16_t>(), T, nh, nope,
                                           vd, r, nullptr, buf_.attn_out_bf16, stream_),
                           "MlaExpandOutput"));
  return Gemm(L.o, buf_.attn_out_bf16, T, buf_.layer_out);
}

absl::Status CudaBackend::GqaAttention(int l) {
  const DevLayer& L = layers_[static_cast<size_t>(l)];
  const int64_t T = rows_, nh = c_.num_heads, nkv = c_.num_kv_heads, hd = c_.head_dim;
  const int64_t row = nkv * hd, rd = geo_.rope_dim;  // rd < hd: partial rotary
  const float eps = static_cast<float>(c_.rms_norm_eps);
  RETURN_IF_ERROR(Gemm(L.q, buf_.normed_bf16, T, buf_.q));
  RETURN_IF_ERROR(Gemm(L.k, buf_.normed_bf16, T, buf_.k));
  RETURN_IF_ERROR(Gemm(L.v, buf_.normed_bf16, T, buf_.v));
  if (L.q_norm.bytes() > 0) {
    RETURN_IF_ERROR(Launched(AddRmsNorm(buf_.q, nullptr, T * nh, hd, L.q_norm.as<float>(), eps,
                                        buf_.q, nullptr, stream_),
                             "AddRmsNorm"));
    RETURN_IF_ERROR(Launched(AddRmsNorm(buf_.k, nullptr, T * nkv, hd, L.k_norm.as<float>(), eps,
                                        buf_.k, nullptr, stream_),
                             "AddRmsNorm"));
  }
  RETURN_IF_ERROR(Launched(
      ApplyRope(buf_.q, T, nh, nh * hd, hd, 0, rd, buf_.rope_cs, false, stream_), "ApplyRope"));
  RETURN_IF_ERROR(Launched(ApplyRope(buf_.k, T, nkv, row, hd, 0, rd, buf_.rope_cs, false, stream_),
                           "ApplyRope"));
  RETURN_IF_ERROR(Launched(
      WriteKvCache(buf_.k, buf_.v, T, slot_, CacheRows(l, true), CacheRows(l, false), stream_),
      "WriteKvCache"));
  PagedAttentionArgs a;
  a.q = buf_.q;
  a.q_tok_stride = nh * hd;
  a.q_head_stride = hd;
  a.dk = hd;
  SetCaches(l, &a);
  a.k_head_offset = hd;
  a.v_head_offset = hd;
  a.dv = hd;
  a.T = T;
  a.num_heads = nh;
  a.num_kv_heads = nkv;
  a.out = buf_.attn_out;
  a.out_tok_stride = nh * hd;
  a.out_head_stride = hd;
  RETURN_IF_ERROR(Attend(a, L.window));
  RETURN_IF_ERROR(
      Launched(ToBf16(buf_.attn_out, T * nh * hd, buf_.attn_out_bf16, stream_), "ToBf16"));
  return Gemm(L.o, buf_.attn_out_bf16, T, buf_.layer_out);
}

}  // namespace hmoe::cuda
