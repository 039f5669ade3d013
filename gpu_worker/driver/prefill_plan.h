// Hybrid prefill's cost model: for one MoE layer of a pass
// with many tokens per expert, where its routed experts run —
//   (a) kCpu:    all on the expert service (its AMX kernels),
//   (b) kStream: all streamed to the GPU over PCIe and computed there
//                (double-buffered: the layer costs the larger of its upload
//                and its compute),
//   (c) kSplit:  the experts with the most tokens streamed to the GPU, the
//                rest on the CPU, chosen so that both sides finish together —
// from measured rates (what the worker measures at start or reads from a
// calibration file). Pure arithmetic; nothing here moves data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace hmoe {

class RoutedExperts;

struct PrefillRates {
  double pcie_gbps = 0;   // host -> device, pinned staging, GB/s (> 0)
  double gpu_tflops = 0;  // the GPU's grouped expert GEMM, TFLOP/s (> 0)
  // The expert service's time for one expert with n tokens, measured at the
  // points (tokens[i], us[i]) (ascending tokens, at least one point, us > 0);
  // linear between points, proportional to n beyond the last, and the first
  // point's time below it (a matrix-vector product costs its bytes).
  std::vector<int64_t> cpu_tokens;
  std::vector<double> cpu_us;
  double CpuUs(int64_t n) const;
  // The service's cost per token of the pass for a call at all (the hidden
  // states in, the sums out, whatever experts it computes), us (>= 0): what
  // (a) and (c) pay and (b) does not. Not part of cpu_us.
  double cpu_call_us_per_token = 0;
};

// OK, or INVALID_ARGUMENT naming the first rate that is not positive, or a
// CPU point out of order (what PlanPrefillLayer and ParsePrefillRates check).
absl::Status ValidatePrefillRates(const PrefillRates& r);

// The rates as JSON ({"format": "hmoe-prefill-rates-1", "pcie_gbps",
// "gpu_tflops", "cpu": [{"tokens", "us"}, ...], "cpu_call_us_per_token"
// (optional, default 0)}): what the cuda backend logs
// once it has measured them, and what ModelOptions::prefill_rates (the
// worker's --prefill-rates FILE) reads back.
std::string PrefillRatesJson(const PrefillRates& r);
// INVALID_ARGUMENT naming `source` and the field for anything else, and for
// rates ValidatePrefillRates refuses.
absl::StatusOr<PrefillRates> ParsePrefillRates(const std::string& json, const std::string& source);

enum class PrefillChoice { kCpu, kStream, kSplit };
const char* PrefillChoiceName(PrefillChoice c);  // "cpu" | "stream" | "split"

struct PrefillPlan {
  PrefillChoice choice = PrefillChoice::kCpu;
  std::vector<int32_t> gpu_experts;  // streamed and computed on the GPU, ascending
  double cpu_us = 0;                 // the CPU side's predicted time
  double gpu_us = 0;                 // the GPU side's: max(upload, compute)
  double us = 0;                     // the layer's: max(cpu_us, gpu_us)
  std::string Describe() const;      // one line for the debug log and hmoe-bench-e2e
};

// tokens[e]: how many of the pass's tokens chose expert e in this layer
// (pass_tokens tokens in all); expert_bytes: one expert's weights as
// streamed; flops_per_token: 2 * 3 * hidden * intermediate (gate, up,
// down). Experts with no tokens cost nothing anywhere; the CPU side costs
// pass_tokens * cpu_call_us_per_token more whenever it has an expert. The split moves experts to
// the GPU in descending token count (ties: lower id) while that lowers the layer's time, and picks
// the best of (a), (b) and that split (ties: (a), then (b): the simpler). INVALID_ARGUMENT for
// rates that are not positive / not ascending, or bytes / flops <= 0.
absl::StatusOr<PrefillPlan> PlanPrefillLayer(const std::vector<int64_t>& tokens,
                                             int64_t pass_tokens, int64_t expert_bytes,
                                             double flops_per_token, const PrefillRates& rates);

// Times `experts` (the expert service, or any RoutedExperts) on MoE layer
// `layer` of `config`: for each n of `tokens_per_expert` (ascending, > 0), one
// call in which every expert gets n tokens (n * E / k tokens, each routed to k
// consecutive experts), after one untimed call; then one call of the last
// point's tokens with a single token routed (its time per token is
// rates->cpu_call_us_per_token); fills rates->cpu_tokens / cpu_us with
// (n, (time - that call cost) / E), at least 1% of time / E. The hidden states are a fixed pattern
// (the kernels' time does not depend on the values). Errors of the calls are passed on;
// INVALID_ARGUMENT for a non-MoE layer or a bad list.
absl::Status MeasureExpertRates(RoutedExperts& experts, const ModelConfig& config, int layer,
                                const std::vector<int64_t>& tokens_per_expert, PrefillRates* rates);

}  // namespace hmoe
