// CudaBackend's slot passes (cuda_backend_impl.h): passes of up to
// kSlotTokens tokens whose routed experts are called through the slots of
// the ExpertCallPath chosen at AttachExperts, with the hot experts computed
// on the GPU meanwhile, captured and replayed as CUDA Graphs (PassGraphs).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"
#include "gpu_worker/cuda/elementwise_kernels.h"
#include "gpu_worker/cuda/host_copy_path.h"
#include "gpu_worker/cuda/router_kernels.h"

namespace hmoe::cuda {
namespace {

int64_t BucketFor(int64_t T) {
  int64_t b = 1;
  while (b < T) b *= 2;
  return b;
}

}  // namespace

bool CudaBackend::AttachExperts(RoutedExperts* experts) {
  experts_ = experts;
  ExpertCallOptions eo;
  eo.slots = cu_.expert_slots;
  eo.slot_calls = cu_.slot_calls;
  ExpertSlotsOptions& so = eo.slot_options;
  so.hidden = c_.hidden_size;
  so.num_slots = 2 * c_.num_layers;  // per layer: the call, and its deferred part
  so.max_tokens = static_cast<int32_t>(kSlotTokens);
  so.top_k = static_cast<int32_t>(c_.moe.experts_per_token);
  // Called outside passes (Prepare, destruction): unpins what is released.
  so.before_release = [](void* base, uint64_t) {
    cudaHostUnregister(base);
    cudaGetLastError();  // not registered (e.g. registration had failed): nothing to undo
  };
  std::string why;
  calls_ = ChooseExpertCallPath(experts, eo, &why);
  auto fallback = [&](const std::string& st) {
    std::fprintf(stderr,
                 "hmoe cuda backend: routed experts through host copies, without slots or "
                 "graphs: %s\n",
                 st.c_str());
    calls_ = std::make_unique<HostCopyPath>();
    return false;
  };
  if (!calls_->uses_slots()) return fallback(why);
  DropGraphs();
  const int64_t max_len = o_.max_seq_len > 0 ? o_.max_seq_len : c_.max_position_embeddings;
  table_per_seq_ = (max_len + kBlockTokens - 1) / kBlockTokens;
  table_cap_ = std::min(kSlotTokens * table_per_seq_, pool_->total());
  absl::Status st = EnsureWorkspace(kSlotTokens, table_cap_, kSlotTokens);
  if (!st.ok()) return fallback(st.ToString());
  ExpertSlots* slots = calls_->slots();
  std::fprintf(stderr,
               "hmoe cuda backend: routed experts through %d %s slots, %s; passes of up to %lld "
               "tokens %s\n",
               slots->num_slots(), slots->kind(), calls_->description(),
               static_cast<long long>(kSlotTokens),
               graphs_->on() ? "replay one CUDA Graph per bucket (1, 2, 4, 8, 16, 32 tokens)"
                             : "run kernel by kernel (--cuda-graphs off)");
  return true;
}

absl::Status CudaBackend::BeginSlotPass(const PassTokens& p) {
  runs_.clear();
  const int64_t T = p.size(), B = BucketFor(T), rd = geo_.rope_dim;
  // Reconnects to a restarted service (new slots, graphs recaptured).
  ASSIGN_OR_RETURN(const bool moved, calls_->Prepare());
  if (moved) DropGraphs();  // they copy to and from the old slots
  const int64_t cap = std::min(B * table_per_seq_, table_cap_);
  RETURN_IF_ERROR(EnsureWorkspace(kSlotTokens, table_cap_, kSlotTokens));
  // The padded layout: slot, table start, pos, logit rows, ids [B each], table.
  int32_t* m = host_.meta;
  int32_t *slot = m, *tstart = m + B, *pos = m + 2 * B, *lrows = m + 3 * B, *ids = m + 4 * B,
          *table = m + 5 * B;
  std::unordered_map<const KvCache*, int32_t> start;
  int64_t entries = 0;
  for (int64_t t = 0; t < T; ++t) {
    auto [it, fresh] = start.emplace(p.kv[static_cast<size_t>(t)], 0);
    if (!fresh) continue;
    const auto& b = static_cast<const CudaKvCache*>(it->first)->blocks();
    if (entries + static_cast<int64_t>(b.size()) > cap)
      return absl::InternalError(absl::StrCat("slot pass: block table over ", cap, " entries"));
    it->second = static_cast<int32_t>(entries);
    std::copy(b.begin(), b.end(), table + entries);
    entries += static_cast<int64_t>(b.size());
  }
  for (int64_t t = 0; t < B; ++t) {
    if (t < T) {
      const auto* kv = static_cast<const CudaKvCache*>(p.kv[static_cast<size_t>(t)]);
      const int64_t ps = p.pos[static_cast<size_t>(t)];
      slot[t] = kv->Row(ps);
      tstart[t] = start[kv];
      pos[t] = static_cast<int32_t>(ps);
      ids[t] = p.ids[static_cast<size_t>(t)];
    } else {  // padding: position 0 of the first table, no cache write, token 0
      slot[t] = -1;
      tstart[t] = 0;
      pos[t] = 0;
      ids[t] = 0;
    }
    lrows[t] =
        t < static_cast<int64_t>(p.logit_rows.size()) ? p.logit_rows[static_cast<size_t>(t)] : 0;
  }
  std::memcpy(host_.rope_cs, p.rope_cs.data(), static_cast<size_t>(T * rd) * 4);
  std::fill(host_.rope_cs + T * rd, host_.rope_cs + B * rd, 0.0f);
  *host_.tokens = static_cast<int32_t>(T);
  pass_ = &p;
  rows_ = B;
  slot_pass_ = true;
  slot_ = buf_.meta;
  tstart_ = buf_.meta + B;
  pos_ = buf_.meta + 2 * B;
  lrows_ = buf_.meta + 3 * B;
  int32_t* ids_dev = buf_.meta + 4 * B;
  table_ = buf_.meta + 5 * B;
  events_used_ = 0;
  calls_->BeginPass(host_.tokens);
  eager_record_.Clear();
  record_ = &eager_record_;
  cudaError_t e = cudaEventRecord(pass_ev_[0], stream_);
  if (e != cudaSuccess) return Fail(CudaError(e, "cudaEventRecord"));
  if (graphs_->on()) {
    if (CallRecord* r = graphs_->Replayable(B)) {
      record_ = r;
      calls_->Arm(*r);
      e = graphs_->Replay(B);
      if (e != cudaSuccess) return Fail(CudaError(e, "cudaGraphLaunch"));
      return absl::OkStatus();
    }
    // Captured now (or, when capture cannot start, run eagerly).
    if (CallRecord* r = graphs_->BeginCapture(B)) record_ = r;
  }
  RETURN_IF_ERROR(
      Copy(buf_.meta, host_.meta, (5 * B + cap) * 4, cudaMemcpyHostToDevice, "metadata upload"));
  RETURN_IF_ERROR(
      Copy(buf_.rope_cs, host_.rope_cs, B * rd * 4, cudaMemcpyHostToDevice, "rope upload"));
  return Launched(
      EmbedRows(embed_.as<uint16_t>(), c_.hidden_size, ids_dev, B, buf_.residual, stream_),
      "EmbedRows");
}

absl::Status CudaBackend::RouteToSlots(int l, const GateSpec& g, int n) {
  RETURN_IF_ERROR(health());
  RETURN_IF_ERROR(RunRouter(l, g));
  const int64_t T = rows_, K = g.top_k, k0 = K - n;
  LayerCalls c;
  c.layer = l;
  c.hidden = buf_.normed_bf16;  // the post-attention norm's bf16 rows
  c.T = T;
  c.H = c_.hidden_size;
  c.ids = buf_.route_ids;
  c.weights = buf_.route_weights;
  c.k = static_cast<int32_t>(k0);
  if (n > 0) {
    RETURN_IF_ERROR(
        Launched(SplitDeferred(buf_.route_ids, buf_.route_weights, T, K, n, buf_.now_ids,
                               buf_.now_weights, buf_.later_ids, buf_.later_weights, stream_),
                 "SplitDeferred"));
    c.ids = buf_.now_ids;
    c.weights = buf_.now_weights;
    c.later_ids = buf_.later_ids;
    c.later_weights = buf_.later_weights;
    c.later_k = n;
  }
  // Hot experts: this layer's hot slots split off (their ids copied out for
  // the routing stats: SlotPassRoutes), the others sent (the deferred part always is),
  // then the hot ones computed while the service works.
  const bool hot = hot_ && hot_->has(l);
  if (hot) {
    ASSIGN_OR_RETURN(c.ids, hot_->Split(l, c.ids, T * k0, &c.hot_ids, *this));
  }
  RETURN_IF_ERROR(calls_->Submit(c, graphs_->capturing(), record_, *this));
  if (hot) return hot_->Run(l, buf_.normed_bf16, T, c.weights, k0, *this);
  return absl::OkStatus();
}

void CudaBackend::SlotPassRoutes(
    const std::function<void(int32_t, const int32_t*, int64_t)>& add) const {
  if (slot_pass_ && record_ != nullptr) calls_->Routes(*record_, *host_.tokens, add);
}

absl::Status CudaBackend::JoinSlot(int l, int part) {
  RETURN_IF_ERROR(health());
  ASSIGN_OR_RETURN(const ResidualPart answer,
                   calls_->Wait(l, part, rows_, buf_.routed, record_, *this));
  const bool hot = part == 0 && hot_ && hot_->has(l);
  // x += routed (the service's part + the hot part) + shared, the reference's order.
  return Join({answer, hot ? ResidualPart::Scratch(hot_->out()) : ResidualPart{}},
              part == 0 ? TakeShared() : ResidualPart{});
}

}  // namespace hmoe::cuda
