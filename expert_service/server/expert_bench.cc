// hmoe-expert-bench: drives running expert-service shards through the
// ExpertPool over one transport, and reports per-request latency and the part
// of it that is not the shards' compute ("overhead").
//
//   hmoe-expert-bench --targets=HOST:PORT[,HOST:PORT...] --transport=grpc|shm|ucx [flags]
//       (--help lists them)
//
// Prints one JSON object per token count: transport, tokens, hidden, p50/p99/mean
// round trip (us), mean shard compute (us, from the shards' stats) and
// overhead = mean round trip - mean compute, and the bytes a call moves
// (request: bf16 rows, ids, weights; answer: f32 rows) over the p50 round
// trip as gb_per_s. With --verify-model-dir the
// results are also compared with the in-process computation (max_rel_diff).
// Exit status 0 on success, 1 on any failed request or verification.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/auth_token.h"
#include "common/dtype.h"
#include "common/flags.h"
#include "common/runtime/thread_pool.h"
#include "common/status.h"
#include "common/transport/fragments.h"
#include "common/transport/grpc_tls.h"
#include "expert_service/server/expert_shard.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gpu_worker/transport/shm_client.h"

namespace hmoe {
namespace {

int Main(int argc, char** argv) {
  ExpertPoolOptions po;
  std::vector<int> tokens_list = {1, 128};
  int iters = 200, warmup = 20;
  std::string verify_dir;
  bool zero_copy = false;
  TlsClientFiles tls;
  std::string targets, transport = "grpc", tokens = "1,128", auth_token_file;
  int64_t fragment_bytes = static_cast<int64_t>(po.ucx.fragment_bytes);
  FlagSet fs("hmoe-expert-bench", "--targets HOST:PORT[,HOST:PORT...] [flags]",
             "Drives running expert-service shards through the ExpertPool over one transport\n"
             "and prints per-request latency and overhead, one JSON object per token count.");
  fs.String("targets", &targets, "HOST:PORT,...", "the shards");
  fs.Choice("transport", &transport, {"grpc", "shm", "ucx"}, "the data plane");
  fs.String("tokens", &tokens, "N,N,...", "tokens per call, one run each");
  fs.Int("iters", &iters, 1, 1 << 30, "timed calls per run");
  fs.Int("warmup", &warmup, 0, 1 << 30, "untimed calls first");
  fs.String("verify-model-dir", &verify_dir, "DIR",
            "compare the answers with the in-process computation on this checkpoint");
  fs.Bool("zero-copy", &zero_copy, "shm: the calls' rows in the shard's own segment");
  fs.Int("ucx-fragment-bytes", &fragment_bytes, 0, std::numeric_limits<int64_t>::max(),
         "UCX answers over N bytes in N-byte fragments; 0: one message, else >= 65536");
  fs.Int("ucx-wait-spin-us", &po.ucx.wait_spin_us, 0, std::numeric_limits<int>::max(),
         "UCX: microseconds to spin before sleeping on an answer");
  fs.Int("ucx-lanes", &po.ucx.lanes, 1, kMaxUcxLanes, "UCX workers and connections per shard");
  fs.String("auth-token-file", &auth_token_file, "PATH", "the shards' --auth-token-file");
  AddTlsFlags(fs, &tls);
  if (auto exit = fs.ParseOrExit(argc, argv, [&]() -> absl::Status {
        po.targets = absl::StrSplit(targets, ',', absl::SkipEmpty());
        ASSIGN_OR_RETURN(po.transport, ParseTransportKind(transport));
        tokens_list.clear();
        for (absl::string_view t : absl::StrSplit(tokens, ',')) {
          int n = 0;
          if (!absl::SimpleAtoi(t, &n) || n <= 0)
            return absl::InvalidArgumentError(
                absl::StrCat("--tokens: \"", tokens, "\" is not a list of counts > 0"));
          tokens_list.push_back(n);
        }
        po.ucx.fragment_bytes = static_cast<uint64_t>(fragment_bytes);
        RETURN_IF_ERROR(
            Annotate(CheckFragmentBytes(po.ucx.fragment_bytes), "--ucx-fragment-bytes"));
        if (!auth_token_file.empty()) {
          ASSIGN_OR_RETURN(po.auth_tokens, AuthTokens::FromFile(auth_token_file));
        }
        return absl::OkStatus();
      }))
    return *exit;
  if (tls.enabled()) {
    auto creds = ChannelCredentialsFrom(tls);
    if (!creds.ok()) {
      std::fprintf(stderr, "hmoe-expert-bench: %s\n",
                   std::string(creds.status().message()).c_str());
      return 2;
    }
    po.credentials = *creds;
  }
  auto pool = ExpertPool::Connect(po);
  if (!pool.ok()) {
    std::fprintf(stderr, "hmoe-expert-bench: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  const ShardInfo& info = (*pool)->model();
  // The reference: the same shards computed here, in the served format and
  // split (quantization scales depend on both), summed.
  std::vector<std::unique_ptr<ExpertShard>> local;
  if (!verify_dir.empty()) {
    ShardOptions so;
    so.model_dir = verify_dir;
    so.max_tokens = info.max_tokens;
    so.split = info.split;
    so.num_shards = (*pool)->num_shards();
    auto format = ParseWeightFormat(info.weight_format, &so.group);
    if (!format.ok()) {
      std::fprintf(stderr, "hmoe-expert-bench: %s\n", format.status().ToString().c_str());
      return 1;
    }
    so.format = *format;
    if (const absl::Status env = ThreadCountsFromEnv(&so.threads, &so.virtual_nodes); !env.ok()) {
      std::fprintf(stderr, "hmoe-expert-bench: %s\n", env.ToString().c_str());
      return 1;
    }
    for (int i = 0; i < so.num_shards; ++i) {
      so.shard_index = i;
      auto s = ExpertShard::Load(so);
      if (!s.ok()) {
        std::fprintf(stderr, "hmoe-expert-bench: %s\n", s.status().ToString().c_str());
        return 1;
      }
      local.push_back(std::move(*s));
    }
  }
  std::vector<std::shared_ptr<ControlClient>> controls;
  for (const std::string& t : po.targets) {
    controls.push_back(
        std::make_shared<ControlClient>(MakeExpertChannel(t, po.auth_tokens, po.credentials)));
  }
  // --zero-copy (shm, one shard): requests are written in place in the slot
  // and answers read in place (ShmClient::Acquire/Commit/WaitInPlace/Release),
  // as the GPU worker does with DMA into the registered segment: what is left
  // is the transport's own cost.
  std::unique_ptr<ShmClient> shm;
  if (zero_copy) {
    if (po.transport != TransportKind::kShm || po.targets.size() != 1) {
      std::fprintf(stderr, "hmoe-expert-bench: --zero-copy needs --transport=shm and one target\n");
      return 2;
    }
    auto c = ShmClient::Create(controls[0], info);
    if (!c.ok()) {
      std::fprintf(stderr, "hmoe-expert-bench: %s\n", c.status().ToString().c_str());
      return 1;
    }
    shm = std::move(*c);
  }
  // Per zero-copy slot, the call whose hidden states it holds (the source
  // pointer and the token count: a call of another T lays ids and weights
  // over the region, so its hidden states are written again).
  std::map<const void*, std::pair<const void*, int32_t>> filled;
  auto run_zero_copy = [&](const MoeCall& call, float* out, bool copy_out) -> absl::Status {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    ASSIGN_OR_RETURN(ShmClient::SlotView v, shm->Acquire(call.tokens, call.top_k, deadline));
    const std::pair<const void*, int32_t> holds{call.hidden, call.tokens};
    auto [it, fresh] = filled.try_emplace(v.hidden, holds);
    if (fresh || it->second != holds) {
      std::memcpy(v.hidden, call.hidden, call.hidden_bytes);
      it->second = holds;
    }
    std::memcpy(v.ids, call.ids, call.ids_bytes);
    std::memcpy(v.weights, call.weights, call.weights_bytes);
    RETURN_IF_ERROR(shm->Commit(v.handle, call.layer));
    auto answer = shm->WaitInPlace(v.handle, deadline);
    if (!answer.ok()) return answer.status();
    if (copy_out) std::memcpy(out, *answer, static_cast<size_t>(call.tokens) * info.hidden * 4);
    shm->Release(v.handle);
    return absl::OkStatus();
  };
  auto compute_ns = [&]() {
    uint64_t ns = 0;
    for (auto& c : controls) {
      auto s = c->Stats();
      if (s.ok()) ns = std::max(ns, s->compute_ns);  // shards run in parallel: the slowest
    }
    return ns;
  };
  int rc = 0;
  for (int T : tokens_list) {
    if (T > info.max_tokens) {
      std::fprintf(stderr, "tokens %d over the shards' capacity %lld\n", T,
                   static_cast<long long>(info.max_tokens));
      return 1;
    }
    const int k = static_cast<int>(info.top_k);
    std::vector<uint16_t> x(static_cast<size_t>(T * info.hidden));
    std::vector<int32_t> ids(static_cast<size_t>(T * k));
    std::vector<float> w(static_cast<size_t>(T * k), 1.f / static_cast<float>(k));
    uint64_t seed = 12345;
    auto rnd = [&]() {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<uint32_t>(seed >> 33);
    };
    for (auto& v : x) v = F32ToBf16(static_cast<float>(rnd() % 2001) / 1000.f - 1.f);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) {
        ids[static_cast<size_t>(t * k + j)] = static_cast<int32_t>(
            (static_cast<int64_t>(t) * 7 + j * (info.num_experts / k + 1)) % info.num_experts);
      }
    }
    const MoeCall call =
        MoeCall::Make(info.moe_layers[0], T, k, info.hidden, x.data(), ids.data(), w.data());
    std::vector<float> out(static_cast<size_t>(T * info.hidden));
    const uint64_t call_bytes = call.hidden_bytes + call.ids_bytes + call.weights_bytes +
                                static_cast<uint64_t>(T) * static_cast<uint64_t>(info.hidden) * 4;
    std::vector<double> us;
    uint64_t c0 = 0;
    for (int i = 0; i < warmup + iters; ++i) {
      if (i == warmup) c0 = compute_ns();
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status st = shm ? run_zero_copy(call, out.data(), /*copy_out=*/i + 1 == warmup + iters)
                            : (*pool)->Run(call, out.data(), absl::Now() + absl::Seconds(30));
      const auto t1 = std::chrono::steady_clock::now();
      if (!st.ok()) {
        std::fprintf(stderr, "request failed: %s\n", st.ToString().c_str());
        return 1;
      }
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    const double compute_us = static_cast<double>(compute_ns() - c0) / 1e3 / iters;
    std::sort(us.begin(), us.end());
    double mean = 0;
    for (double u : us) mean += u;
    mean /= static_cast<double>(us.size());
    double max_rel = -1;
    if (!local.empty()) {
      std::vector<float> want(out.size(), 0.0f), part(out.size());
      for (const auto& shard : local) {
        absl::Status st = shard->Handle(call, part.data(), nullptr);
        if (!st.ok()) return 1;
        for (size_t i = 0; i < want.size(); ++i) want[i] += part[i];
      }
      max_rel = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        max_rel = std::max(max_rel, std::abs(static_cast<double>(out[i]) - want[i]) /
                                        (1.0 + std::abs(static_cast<double>(want[i]))));
      }
      if (!(max_rel < 1e-5)) rc = 1;
    }
    std::printf(
        "{\"transport\": \"%s\", \"shards\": %d, \"tokens\": %d, \"hidden\": %lld, \"iters\": %d, "
        "\"p50_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"compute_us\": %.1f, "
        "\"overhead_us\": %.1f, \"bytes\": %llu, \"gb_per_s\": %.3f, \"max_rel_diff\": %.3g}\n",
        shm ? "shm-zero-copy" : TransportKindName(po.transport), (*pool)->num_shards(), T,
        static_cast<long long>(info.hidden), iters, us[us.size() / 2],
        us[std::min(us.size() - 1, us.size() * 99 / 100)], mean, compute_us, mean - compute_us,
        static_cast<unsigned long long>(call_bytes), call_bytes / us[us.size() / 2] / 1e3, max_rel);
    std::fflush(stdout);
  }
  return rc;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
