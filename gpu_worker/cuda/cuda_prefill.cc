// CudaBackend's routed experts on the GPU outside the slots' calls
// (cuda_backend_impl.h): loading the hot experts, and hybrid prefill (a large
// pass's routed slots taken by StreamedExperts).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/weight_format.h"
#include "common/load_progress.h"
#include "common/status.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"

namespace hmoe::cuda {

absl::Status CudaBackend::LoadHotExperts(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(hot_,
                   GpuHotExperts::Create(c_, CopySource(ckpt), *cu_.hot_experts, cu_.hot_format,
                                         cu_.hot_group, kSlotTokens, &budget_));
  std::fprintf(stderr, "hmoe cuda backend: %s on the GPU as %s (%s)\n",
               cu_.hot_experts->Describe().c_str(),
               std::string(WeightFormatName(cu_.hot_format)).c_str(),
               Gib(static_cast<double>(hot_->bytes())).c_str());
  return absl::OkStatus();
}

ExpertSourceFn CudaBackend::CopySource(const Checkpoint& ckpt) const {
  if (cu_.expert_source) return cu_.expert_source;
  return [&ckpt, this](int l) { return CheckpointSource(ckpt, c_, l); };
}

absl::Status CudaBackend::LoadStreamedExperts(const Checkpoint& ckpt) {
  if (cu_.prefill_experts == PrefillExperts::kCpu) return absl::OkStatus();
  const std::string p(PrefillExpertsName(cu_.prefill_experts));
  if (o_.deferred_experts > 0) {
    std::fprintf(stderr,
                 "hmoe cuda backend: hybrid prefill (%s) is off with Expert Deferral: large "
                 "passes' routed experts run on the expert service\n",
                 p.c_str());
    return absl::OkStatus();
  }
  const WeightFormat fmt = cu_.hot_format;
  if (cu_.prefill_stream_tokens <= kSlotTokens)
    return absl::InvalidArgumentError(absl::StrCat("prefill_stream_tokens ",
                                                   cu_.prefill_stream_tokens, " must be > ",
                                                   kSlotTokens, " (smaller passes use the slots)"));
  const int64_t max_tokens = o_.max_seq_len > kSlotTokens
                                 ? std::min(cu_.prefill_stream_tokens, o_.max_seq_len)
                                 : cu_.prefill_stream_tokens;
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<LoadProgressReporter> pinning;
  if (o_.load_progress) {
    LoadProgressOptions po = *o_.load_progress;
    po.what = "pinning routed experts";
    pinning.emplace(std::move(po));
  }
  auto progress = [&pinning](int64_t done, int64_t total) {
    if (pinning) pinning->Update(done, total);
  };
  absl::StatusOr<std::unique_ptr<StreamedExperts>> created =
      StreamedExperts::Create(c_, CopySource(ckpt), fmt, cu_.hot_group, max_tokens,
                              prefetch_planned_, stream_, blas_, &budget_, progress);
  if (pinning) pinning->Finish();
  ASSIGN_OR_RETURN(streamed_, std::move(created));
  last_streamed_.assign(static_cast<size_t>(c_.num_layers), {});
  std::fprintf(
      stderr,
      "hmoe cuda backend: hybrid prefill (%s) for passes of 33..%lld tokens: %s of "
      "routed experts (%s) pinned on the host, %s on the GPU; PCIe %.1f GB/s, "
      "expert GEMMs %.0f TFLOP/s; loaded in %.1f s\n",
      p.c_str(), static_cast<long long>(max_tokens),
      Gib(static_cast<double>(streamed_->host_bytes())).c_str(),
      std::string(WeightFormatName(cu_.hot_format)).c_str(),
      streamed_->stages() > 1 ? "two layers' (the next one's uploaded ahead)" : "one layer's",
      streamed_->pcie_gbps(), streamed_->gemm_tflops(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  streamed_->set_timeline(cu_.log_prefill_plans);
  prefill_rates_.pcie_gbps = streamed_->pcie_gbps();
  prefill_rates_.gpu_tflops = streamed_->gemm_tflops();
  if (cu_.prefill_rates) {
    RETURN_IF_ERROR(ValidatePrefillRates(*cu_.prefill_rates));
    prefill_rates_ = *cu_.prefill_rates;
    cpu_rates_measured_ = true;
    std::fprintf(stderr, "hmoe cuda backend: hybrid prefill plans with the given rates %s\n",
                 PrefillRatesJson(prefill_rates_).c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CudaBackend::TakeRoutedSlots(int l, const RoutedInput& in, int64_t T, int k,
                                                     int32_t* ids_out) {
  streamed_pending_ = false;
  const int64_t E = c_.moe.num_experts, K = c_.moe.experts_per_token;
  if (!streamed_ || slot_pass_ || T <= kSlotTokens || T > streamed_->max_tokens() || k != K)
    return int64_t{0};
  RETURN_IF_ERROR(health());
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < T * K; ++s)
    if (in.ids[s] >= 0 && in.ids[s] < E) ++counts[static_cast<size_t>(in.ids[s])];
  PrefillPlan plan;
  if (cu_.prefill_experts == PrefillExperts::kStream) {
    plan.choice = PrefillChoice::kStream;
    for (int32_t e = 0; e < E; ++e)
      if (counts[static_cast<size_t>(e)] > 0) plan.gpu_experts.push_back(e);
  } else {
    if (!cpu_rates_measured_) {
      if (experts_ == nullptr)
        return absl::FailedPreconditionError("hybrid prefill: no routed experts to measure");
      const auto t0 = std::chrono::steady_clock::now();
      RETURN_IF_ERROR(Annotate(MeasureExpertRates(*experts_, c_, l, {16, 64, 256}, &prefill_rates_),
                               "hybrid prefill: measuring the expert service"));
      cpu_rates_measured_ = true;
      std::string pts;
      for (size_t i = 0; i < prefill_rates_.cpu_tokens.size(); ++i)
        absl::StrAppend(&pts, i ? ", " : "", prefill_rates_.cpu_tokens[i], " tokens ",
                        absl::StrFormat("%.0f", prefill_rates_.cpu_us[i]), " us");
      std::fprintf(stderr,
                   "hmoe cuda backend: hybrid prefill: the expert service takes per expert: %s, "
                   "and %.2f us per token of a call (measured in %.1f s); rates %s\n",
                   pts.c_str(), prefill_rates_.cpu_call_us_per_token,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                   PrefillRatesJson(prefill_rates_).c_str());
    }
    ASSIGN_OR_RETURN(plan, PlanPrefillLayer(counts, T, streamed_->expert_bytes(),
                                            6.0 * static_cast<double>(c_.hidden_size) *
                                                static_cast<double>(c_.moe.intermediate_size),
                                            prefill_rates_));
  }
  ++prefill_layers_[static_cast<int>(plan.choice)];
  if (cu_.log_prefill_plans)
    absl::StrAppend(&pass_plan_log_, "\n  layer ", l, " ", plan.Describe());
  int64_t n = 0;
  if (!plan.gpu_experts.empty()) {
    BurstBegin();
    absl::StatusOr<int64_t> run = streamed_->Run(l, buf_.normed_bf16, T, K, in.ids,
                                                 buf_.route_weights, plan.gpu_experts, ids_out);
    BurstEnd();
    if (!run.ok()) return Failed(run.status());
    n = *run;
  }
  if (absl::Status st = PrefetchAfter(l, plan, counts); !st.ok()) return Failed(st);
  streamed_pending_ = n > 0;
  streamed_slots_ += n;
  return n;
}

absl::Status CudaBackend::PrefetchAfter(int l, const PrefillPlan& plan,
                                        const std::vector<int64_t>& counts) {
  last_streamed_[static_cast<size_t>(l)] = plan.gpu_experts;
  if (streamed_->stages() < 2) return absl::OkStatus();
  int next = l + 1;
  while (next < c_.num_layers && !c_.layers[static_cast<size_t>(next)].moe) ++next;
  if (next >= c_.num_layers) return absl::OkStatus();
  // Every expert had tokens here and streamed: the next layer's most likely
  // do too (large passes); else what the next layer streamed last time.
  const bool all = plan.choice == PrefillChoice::kStream &&
                   std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
  std::vector<int32_t> guess;
  if (all) {
    guess.resize(counts.size());
    for (size_t e = 0; e < guess.size(); ++e) guess[e] = static_cast<int32_t>(e);
  } else {
    guess = last_streamed_[static_cast<size_t>(next)];
  }
  if (guess.empty()) return absl::OkStatus();
  return streamed_->Prefetch(next, guess).status();  // the copy stream only
}

}  // namespace hmoe::cuda
