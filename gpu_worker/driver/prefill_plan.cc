#include "gpu_worker/driver/prefill_plan.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/routed_experts.h"
#include "nlohmann/json.hpp"

namespace hmoe {

double PrefillRates::CpuUs(int64_t n) const {
  if (n <= 0 || cpu_tokens.empty()) return 0;
  if (n <= cpu_tokens.front()) return cpu_us.front();
  for (size_t i = 1; i < cpu_tokens.size(); ++i) {
    if (n <= cpu_tokens[i]) {
      const double f = static_cast<double>(n - cpu_tokens[i - 1]) /
                       static_cast<double>(cpu_tokens[i] - cpu_tokens[i - 1]);
      return cpu_us[i - 1] + f * (cpu_us[i] - cpu_us[i - 1]);
    }
  }
  return cpu_us.back() * static_cast<double>(n) / static_cast<double>(cpu_tokens.back());
}

const char* PrefillChoiceName(PrefillChoice c) {
  switch (c) {
    case PrefillChoice::kCpu:
      return "cpu";
    case PrefillChoice::kStream:
      return "stream";
    case PrefillChoice::kSplit:
      return "split";
  }
  return "?";
}

std::string PrefillPlan::Describe() const {
  return absl::StrFormat("%s: %d experts on the GPU, cpu %.1f us, gpu %.1f us, layer %.1f us",
                         PrefillChoiceName(choice), gpu_experts.size(), cpu_us, gpu_us, us);
}

absl::Status ValidatePrefillRates(const PrefillRates& r) {
  if (!(r.pcie_gbps > 0) || !(r.gpu_tflops > 0))
    return absl::InvalidArgumentError(absl::StrCat("prefill rates: pcie_gbps ", r.pcie_gbps,
                                                   " and gpu_tflops ", r.gpu_tflops,
                                                   " must be > 0"));
  if (!(r.cpu_call_us_per_token >= 0))
    return absl::InvalidArgumentError(absl::StrCat("prefill rates: cpu_call_us_per_token ",
                                                   r.cpu_call_us_per_token, " must be >= 0"));
  if (r.cpu_tokens.empty() || r.cpu_tokens.size() != r.cpu_us.size())
    return absl::InvalidArgumentError(
        "prefill rates: the CPU's (tokens, us) points are missing or unpaired");
  for (size_t i = 0; i < r.cpu_tokens.size(); ++i) {
    if (r.cpu_tokens[i] <= 0 || !(r.cpu_us[i] > 0) ||
        (i > 0 && r.cpu_tokens[i] <= r.cpu_tokens[i - 1]))
      return absl::InvalidArgumentError(absl::StrCat("prefill rates: CPU point ", i, " (",
                                                     r.cpu_tokens[i], " tokens, ", r.cpu_us[i],
                                                     " us) is not positive or not ascending"));
  }
  return absl::OkStatus();
}

std::string PrefillRatesJson(const PrefillRates& r) {
  nlohmann::json j;
  j["format"] = "hmoe-prefill-rates-1";
  j["pcie_gbps"] = r.pcie_gbps;
  j["gpu_tflops"] = r.gpu_tflops;
  nlohmann::json cpu = nlohmann::json::array();
  for (size_t i = 0; i < r.cpu_tokens.size() && i < r.cpu_us.size(); ++i)
    cpu.push_back({{"tokens", r.cpu_tokens[i]}, {"us", r.cpu_us[i]}});
  j["cpu"] = cpu;
  j["cpu_call_us_per_token"] = r.cpu_call_us_per_token;
  return j.dump();
}

absl::StatusOr<PrefillRates> ParsePrefillRates(const std::string& text, const std::string& source) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": prefill rates: ", what));
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (!j.contains("format") || !j["format"].is_string() ||
      j["format"].get<std::string>() != "hmoe-prefill-rates-1")
    return bad("format: expected \"hmoe-prefill-rates-1\"");
  PrefillRates r;
  for (const char* k : {"pcie_gbps", "gpu_tflops"}) {
    if (!j.contains(k) || !j[k].is_number()) return bad(absl::StrCat(k, ": a number expected"));
  }
  r.pcie_gbps = j["pcie_gbps"].get<double>();
  r.gpu_tflops = j["gpu_tflops"].get<double>();
  if (!j.contains("cpu") || !j["cpu"].is_array()) return bad("cpu: an array expected");
  for (const auto& p : j["cpu"]) {
    if (!p.is_object() || !p.contains("tokens") || !p["tokens"].is_number_integer() ||
        !p.contains("us") || !p["us"].is_number())
      return bad("cpu[]: {\"tokens\": integer, \"us\": number} expected");
    r.cpu_tokens.push_back(p["tokens"].get<int64_t>());
    r.cpu_us.push_back(p["us"].get<double>());
  }
  if (j.contains("cpu_call_us_per_token")) {
    if (!j["cpu_call_us_per_token"].is_number())
      return bad("cpu_call_us_per_token: a number expected");
    r.cpu_call_us_per_token = j["cpu_call_us_per_token"].get<double>();
  }
  if (absl::Status st = ValidatePrefillRates(r); !st.ok()) return bad(std::string(st.message()));
  return r;
}

absl::StatusOr<PrefillPlan> PlanPrefillLayer(const std::vector<int64_t>& tokens,
                                             int64_t pass_tokens, int64_t expert_bytes,
                                             double flops_per_token, const PrefillRates& r) {
  RETURN_IF_ERROR(ValidatePrefillRates(r));
  if (expert_bytes <= 0 || !(flops_per_token > 0))
    return absl::InvalidArgumentError(absl::StrCat("prefill plan: expert_bytes ", expert_bytes,
                                                   " and flops_per_token ", flops_per_token,
                                                   " must be > 0"));
  const double upload_us = static_cast<double>(expert_bytes) / (r.pcie_gbps * 1e3);
  auto gpu_compute_us = [&](int64_t n) {
    return static_cast<double>(n) * flops_per_token / (r.gpu_tflops * 1e6);
  };
  // Experts with tokens, most tokens first (ties: lower id).
  std::vector<int32_t> order;
  for (size_t e = 0; e < tokens.size(); ++e)
    if (tokens[e] > 0) order.push_back(static_cast<int32_t>(e));
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return tokens[a] > tokens[b]; });
  // Side times with the first k of `order` on the GPU.
  double cpu_all = static_cast<double>(std::max<int64_t>(0, pass_tokens)) * r.cpu_call_us_per_token;
  for (int32_t e : order) cpu_all += r.CpuUs(tokens[e]);
  struct Sides {
    double cpu = 0, up = 0, comp = 0;
    double gpu() const { return std::max(up, comp); }
    double layer() const { return std::max(cpu, gpu()); }
  };
  std::vector<Sides> with(order.size() + 1);
  with[0].cpu = cpu_all;
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t n = tokens[order[k]];
    with[k + 1] = with[k];
    with[k + 1].cpu -= r.CpuUs(n);
    with[k + 1].up += upload_us;
    with[k + 1].comp += gpu_compute_us(n);
  }
  with.back().cpu = 0;  // (exact zero, not a sum's residue)
  // The split: the best k in 1..n-1 (the layer time falls, then rises).
  size_t best = 0;
  for (size_t k = 1; k + 1 <= order.size(); ++k)
    if (with[k].layer() < with[best].layer()) best = k;
  PrefillPlan p;
  auto take = [&](PrefillChoice c, size_t k) {
    p.choice = c;
    p.gpu_experts.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k));
    std::sort(p.gpu_experts.begin(), p.gpu_experts.end());
    p.cpu_us = with[k].cpu;
    p.gpu_us = with[k].gpu();
    p.us = with[k].layer();
  };
  const size_t all = order.size();
  take(PrefillChoice::kCpu, 0);
  if (all > 0 && with[all].layer() < p.us) take(PrefillChoice::kStream, all);
  if (best > 0 && best < all && with[best].layer() < p.us) take(PrefillChoice::kSplit, best);
  return p;
}

absl::Status MeasureExpertRates(RoutedExperts& experts, const ModelConfig& config, int layer,
                                const std::vector<int64_t>& tokens_per_expert,
                                PrefillRates* rates) {
  if (layer < 0 || layer >= config.num_layers || !config.layers[static_cast<size_t>(layer)].moe)
    return absl::InvalidArgumentError(
        absl::StrCat("expert rates: layer ", layer, " is not an MoE layer"));
  if (tokens_per_expert.empty())
    return absl::InvalidArgumentError("expert rates: no tokens-per-expert point");
  for (size_t i = 0; i < tokens_per_expert.size(); ++i)
    if (tokens_per_expert[i] <= 0 || (i > 0 && tokens_per_expert[i] <= tokens_per_expert[i - 1]))
      return absl::InvalidArgumentError(absl::StrCat("expert rates: point ", i, " (",
                                                     tokens_per_expert[i],
                                                     " tokens) is not positive or not ascending"));
  const int64_t E = config.moe.num_experts, K = config.moe.experts_per_token,
                H = config.hidden_size;
  // routed: false sends only token 0 to experts (the rest kNoExpert).
  auto call = [&](int64_t n, bool routed = true) -> absl::StatusOr<double> {
    const int64_t T = (n * E + K - 1) / K;
    std::vector<float> hidden(static_cast<size_t>(T * H)), out(static_cast<size_t>(T * H));
    for (size_t i = 0; i < hidden.size(); ++i)
      hidden[i] = static_cast<float>(static_cast<int>(i % 17) - 8) / 64.0f;
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    std::vector<float> w(static_cast<size_t>(T * K), 1.0f / static_cast<float>(K));
    for (int64_t s = 0; s < T * K; ++s)
      ids[static_cast<size_t>(s)] = routed || s < K ? static_cast<int32_t>(s % E) : kNoExpert;
    ExpertBatch b;
    b.layer = layer;
    b.num_tokens = T;
    b.hidden_size = H;
    b.hidden = hidden.data();
    b.top_k = static_cast<int>(K);
    b.expert_ids = ids.data();
    b.weights = w.data();
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(experts.Forward(b, out.data()));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  RETURN_IF_ERROR(call(tokens_per_expert.front()).status());  // warm-up
  std::vector<double> secs;
  for (int64_t n : tokens_per_expert) {
    ASSIGN_OR_RETURN(const double s, call(n));
    secs.push_back(s);
  }
  const int64_t last = tokens_per_expert.back(), T_last = (last * E + K - 1) / K;
  ASSIGN_OR_RETURN(const double fixed, call(last, /*routed=*/false));
  rates->cpu_call_us_per_token = fixed * 1e6 / static_cast<double>(T_last);
  rates->cpu_tokens.clear();
  rates->cpu_us.clear();
  for (size_t i = 0; i < secs.size(); ++i) {
    const int64_t T = (tokens_per_expert[i] * E + K - 1) / K;
    const double us = secs[i] * 1e6;
    const double net = us - rates->cpu_call_us_per_token * static_cast<double>(T);
    rates->cpu_tokens.push_back(tokens_per_expert[i]);
    rates->cpu_us.push_back(std::max(net, 0.01 * us) / static_cast<double>(E));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
