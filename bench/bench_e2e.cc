// hmoe-bench-e2e: the real pair end to end. The model's non-expert part runs
// in this process (Model::Create on --backend, default cuda) over a random
// bf16 checkpoint of a real model's shape, written once into --work-dir
// without the routed experts; the routed experts run in a child
// hmoe-expert-service (--synthetic random experts of the same shape and MoE
// layers, --format), reached over --transport through an ExpertPool and
// PoolRoutedExperts, as hmoe-gpu-worker reaches it.
//
// Measures prefill tok/s (one Forward of a random prompt per --prompts
// length, fresh Sequence, LogitsMode::kLast) and decode tok/s at each
// --batches size (b sequences each prefilled with --decode-prompt tokens,
// then --decode-steps ForwardBatch steps of one token per sequence), with
// Model::stats() deltas (kernel launches, GPU busy time, expert wait per
// step). The denominator is the CPU-expert decode ceiling
//   BW / (MoE layers * top_k * 3 * H * I * bytes_per_weight(format)),
// BW the DRAM read bandwidth measured by bench/dram_probe.h in this run
// before the service starts (best of its access patterns; again after the
// service has loaded, unless --no-probe-after, and the higher of the two
// readings counts), bytes_per_weight the packed
// bytes of one expert (scales and padding included) / (3 * H * I).
//
// Flags: AddFlags below (--help; docs/FLAGS.md). Exit 0 on success, 2 on a bad flag, 1 on any
// other failure (the message names what failed; the service's log is shown
// when it failed to start). The service is stopped (SIGTERM, then waited on)
// on every exit path, also on SIGINT / SIGTERM of this process.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/dram_probe.h"
#include "common/dtype.h"
#include "common/expert_placement.h"
#include "common/experts/synthetic_source.h"
#include "common/experts/weight_format.h"
#include "common/flags.h"
#include "common/model_config.h"
#include "common/routing_stats.h"
#include "common/runtime/numa.h"
#include "common/runtime/thread_pool.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/weight_map.h"
#include "expert_service/kernels/moe.h"
#include "gpu_worker/hot_weights.h"
#include "gpu_worker/model.h"
#include "gpu_worker/server/remote_experts.h"
#include "gpu_worker/transport/expert_pool.h"

namespace hmoe {
namespace {

using ojson = nlohmann::ordered_json;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- presets ----------------------------------------------------------------------
// config.json as the Hugging Face checkpoints spell it (less the fp8
// quantization_config and the MTP layer: our checkpoint is bf16 main stack).
std::optional<ojson> PresetConfig(const std::string& name) {
  if (name == "qwen3-30b")
    return ojson{{"architectures", {"Qwen3MoeForCausalLM"}},
                 {"attention_bias", false},
                 {"bos_token_id", 151643},
                 {"decoder_sparse_step", 1},
                 {"eos_token_id", 151645},
                 {"head_dim", 128},
                 {"hidden_act", "silu"},
                 {"hidden_size", 2048},
                 {"intermediate_size", 6144},
                 {"max_position_embeddings", 40960},
                 {"max_window_layers", 48},
                 {"mlp_only_layers", ojson::array()},
                 {"model_type", "qwen3_moe"},
                 {"moe_intermediate_size", 768},
                 {"norm_topk_prob", true},
                 {"num_attention_heads", 32},
                 {"num_experts", 128},
                 {"num_experts_per_tok", 8},
                 {"num_hidden_layers", 48},
                 {"num_key_value_heads", 4},
                 {"rms_norm_eps", 1e-6},
                 {"rope_scaling", nullptr},
                 {"rope_theta", 1000000.0},
                 {"sliding_window", nullptr},
                 {"tie_word_embeddings", false},
                 {"torch_dtype", "bfloat16"},
                 {"use_sliding_window", false},
                 {"vocab_size", 151936}};
  if (name == "ds-v3")
    return ojson{{"architectures", {"DeepseekV3ForCausalLM"}},
                 {"attention_bias", false},
                 {"bos_token_id", 0},
                 {"eos_token_id", 1},
                 {"first_k_dense_replace", 3},
                 {"hidden_act", "silu"},
                 {"hidden_size", 7168},
                 {"intermediate_size", 18432},
                 {"kv_lora_rank", 512},
                 {"max_position_embeddings", 163840},
                 {"model_type", "deepseek_v3"},
                 {"moe_intermediate_size", 2048},
                 {"moe_layer_freq", 1},
                 {"n_group", 8},
                 {"n_routed_experts", 256},
                 {"n_shared_experts", 1},
                 {"norm_topk_prob", true},
                 {"num_attention_heads", 128},
                 {"num_experts_per_tok", 8},
                 {"num_hidden_layers", 61},
                 {"num_key_value_heads", 128},
                 {"num_nextn_predict_layers", 0},
                 {"q_lora_rank", 1536},
                 {"qk_nope_head_dim", 128},
                 {"qk_rope_head_dim", 64},
                 {"rms_norm_eps", 1e-6},
                 {"rope_interleave", true},
                 {"rope_scaling",
                  {{"beta_fast", 32},
                   {"beta_slow", 1},
                   {"factor", 40},
                   {"mscale", 1.0},
                   {"mscale_all_dim", 1.0},
                   {"original_max_position_embeddings", 4096},
                   {"type", "yarn"}}},
                 {"rope_theta", 10000},
                 {"routed_scaling_factor", 2.5},
                 {"scoring_func", "sigmoid"},
                 {"tie_word_embeddings", false},
                 {"topk_group", 4},
                 {"topk_method", "noaux_tc"},
                 {"torch_dtype", "bfloat16"},
                 {"v_head_dim", 128},
                 {"vocab_size", 129280}};
  if (name == "ds-v2-lite")
    return ojson{{"architectures", {"DeepseekV2ForCausalLM"}},
                 {"attention_bias", false},
                 {"bos_token_id", 100000},
                 {"eos_token_id", 100001},
                 {"first_k_dense_replace", 1},
                 {"hidden_act", "silu"},
                 {"hidden_size", 2048},
                 {"intermediate_size", 10944},
                 {"kv_lora_rank", 512},
                 {"max_position_embeddings", 163840},
                 {"model_type", "deepseek_v2"},
                 {"moe_intermediate_size", 1408},
                 {"moe_layer_freq", 1},
                 {"n_group", 1},
                 {"n_routed_experts", 64},
                 {"n_shared_experts", 2},
                 {"norm_topk_prob", false},
                 {"num_attention_heads", 16},
                 {"num_experts_per_tok", 6},
                 {"num_hidden_layers", 27},
                 {"num_key_value_heads", 16},
                 {"q_lora_rank", nullptr},
                 {"qk_nope_head_dim", 128},
                 {"qk_rope_head_dim", 64},
                 {"rms_norm_eps", 1e-6},
                 {"rope_scaling",
                  {{"beta_fast", 32},
                   {"beta_slow", 1},
                   {"factor", 40},
                   {"mscale", 0.707},
                   {"mscale_all_dim", 0.707},
                   {"original_max_position_embeddings", 4096},
                   {"type", "yarn"}}},
                 {"rope_theta", 10000},
                 {"routed_scaling_factor", 1.0},
                 {"scoring_func", "softmax"},
                 {"tie_word_embeddings", false},
                 {"topk_group", 1},
                 {"topk_method", "greedy"},
                 {"torch_dtype", "bfloat16"},
                 {"v_head_dim", 128},
                 {"vocab_size", 102400}};
  if (name == "tiny") {  // smoke tests: qwen3-30b shrunk; every format's blocks fit (fp8's 128)
    ojson c = *PresetConfig("qwen3-30b");
    c.update(ojson{{"bos_token_id", 0},
                   {"eos_token_id", 1},
                   {"head_dim", 64},
                   {"hidden_size", 128},
                   {"intermediate_size", 256},
                   {"max_position_embeddings", 4096},
                   {"max_window_layers", 2},
                   {"moe_intermediate_size", 128},
                   {"num_attention_heads", 2},
                   {"num_experts", 8},
                   {"num_experts_per_tok", 2},
                   {"num_hidden_layers", 2},
                   {"num_key_value_heads", 1},
                   {"vocab_size", 512}});
    return c;
  }
  if (name == "mixtral")
    return ojson{{"architectures", {"MixtralForCausalLM"}},
                 {"bos_token_id", 1},
                 {"eos_token_id", 2},
                 {"hidden_act", "silu"},
                 {"hidden_size", 4096},
                 {"intermediate_size", 14336},
                 {"max_position_embeddings", 32768},
                 {"model_type", "mixtral"},
                 {"num_attention_heads", 32},
                 {"num_experts_per_tok", 2},
                 {"num_hidden_layers", 32},
                 {"num_key_value_heads", 8},
                 {"num_local_experts", 8},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 1000000.0},
                 {"sliding_window", nullptr},
                 {"tie_word_embeddings", false},
                 {"torch_dtype", "bfloat16"},
                 {"vocab_size", 32000}};
  // tests/fixtures/configs/kimi_k2_published (Kimi-K2-Instruct).
  if (name == "kimi-k2")
    return ojson{{"architectures", {"DeepseekV3ForCausalLM"}},
                 {"attention_bias", false},
                 {"bos_token_id", 163584},
                 {"eos_token_id", 163585},
                 {"first_k_dense_replace", 1},
                 {"hidden_act", "silu"},
                 {"hidden_size", 7168},
                 {"intermediate_size", 18432},
                 {"kv_lora_rank", 512},
                 {"max_position_embeddings", 131072},
                 {"model_type", "kimi_k2"},
                 {"moe_intermediate_size", 2048},
                 {"moe_layer_freq", 1},
                 {"n_group", 1},
                 {"n_routed_experts", 384},
                 {"n_shared_experts", 1},
                 {"norm_topk_prob", true},
                 {"num_attention_heads", 64},
                 {"num_experts_per_tok", 8},
                 {"num_hidden_layers", 61},
                 {"num_key_value_heads", 64},
                 {"num_nextn_predict_layers", 0},
                 {"q_lora_rank", 1536},
                 {"qk_nope_head_dim", 128},
                 {"qk_rope_head_dim", 64},
                 {"rms_norm_eps", 1e-6},
                 {"rope_scaling",
                  {{"beta_fast", 1.0},
                   {"beta_slow", 1.0},
                   {"factor", 32.0},
                   {"mscale", 1.0},
                   {"mscale_all_dim", 1.0},
                   {"original_max_position_embeddings", 4096},
                   {"type", "yarn"}}},
                 {"rope_theta", 50000.0},
                 {"routed_scaling_factor", 2.827},
                 {"scoring_func", "sigmoid"},
                 {"tie_word_embeddings", false},
                 {"topk_group", 1},
                 {"topk_method", "noaux_tc"},
                 {"torch_dtype", "bfloat16"},
                 {"v_head_dim", 128},
                 {"vocab_size", 163840}};
  // tests/fixtures/configs/glm4_5_published (GLM-4.5).
  if (name == "glm-4.5")
    return ojson{{"architectures", {"Glm4MoeForCausalLM"}},
                 {"attention_bias", true},
                 {"eos_token_id", 151329},
                 {"first_k_dense_replace", 3},
                 {"head_dim", 128},
                 {"hidden_act", "silu"},
                 {"hidden_size", 5120},
                 {"intermediate_size", 12288},
                 {"max_position_embeddings", 131072},
                 {"model_type", "glm4_moe"},
                 {"moe_intermediate_size", 1536},
                 {"n_group", 1},
                 {"n_routed_experts", 160},
                 {"n_shared_experts", 1},
                 {"norm_topk_prob", true},
                 {"num_attention_heads", 96},
                 {"num_experts_per_tok", 8},
                 {"num_hidden_layers", 92},
                 {"num_key_value_heads", 8},
                 {"num_nextn_predict_layers", 0},
                 {"partial_rotary_factor", 0.5},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 1000000.0},
                 {"routed_scaling_factor", 2.5},
                 {"tie_word_embeddings", false},
                 {"topk_group", 1},
                 {"torch_dtype", "bfloat16"},
                 {"use_qk_norm", true},
                 {"vocab_size", 151552}};
  return std::nullopt;
}

// ---- flags ------------------------------------------------------------------------
struct Args {
  std::string preset = "ds-v3";
  int layers = 0;
  std::string format = "int4";
  double mem_fraction = 0.6;
  std::string transport = "shm";
  std::string backend = "cuda";
  double gpu_mem_gb = 0;
  int64_t kv_blocks = 0;
  DenseWeights gpu_weights = DenseWeights::kAuto;
  KvDtype kv_dtype = KvDtype::kBf16;
  int defer_experts = 0;
  bool cuda_graphs = true;
  bool log_prefill_plans = false;  // stderr: each large pass's choices and streamed timeline
  bool cuda_expert_slots = true;
  bool cuda_device_calls = true;
  std::string service_cores, worker_cores;  // CPU lists; empty: all
  std::vector<int64_t> defer_sweep;         // batch-1 decode per deferral count (empty: none)
  std::vector<std::string> path_sweep;      // batch-1 decode per worker path (empty: none)
  std::vector<double> hot_sweep;            // batch-1 decode per hot-expert budget, GiB
  std::vector<std::string> prefill_sweep;   // prefill per routed-expert policy (empty: none)
  int64_t prefill_sweep_prompt = 0;         // its prompt (0: the longest --prompts)
  int64_t calibrate_steps = 32;             // the hot sweep's calibration: batch-16 steps
  double router_zipf = 0;                   // Zipf exponent of the router's bias (0: none)
  int threads = 0;
  std::vector<int64_t> prompts{512, 2048, 8192};
  std::vector<int64_t> batches{1, 4, 16};
  int64_t decode_steps = 32;
  int64_t decode_prompt = 32;
  int warmup = 1;
  int reps = 1;
  int service_threads = 0;
  int64_t service_max_tokens = 0;
  double service_timeout_s = 1800;
  int64_t expert_timeout_ms = 120000;
  std::string bin_dir, work_dir, json;
  int64_t vocab = 0;
  int64_t alias_experts = 0;  // > 0: the service's synthetic alias=N (a fit check)
  int64_t probe_mib = 0;
  int probe_reps = 4;
  bool probe_after = true;
};

// A setter of a comma-separated list of integers in [lo, hi] (replacing the
// list), for FlagSet::Custom.
std::function<absl::Status(std::string_view)> IntList(int64_t lo, int64_t hi,
                                                      std::vector<int64_t>* out) {
  return [lo, hi, out](std::string_view v) {
    out->clear();
    for (absl::string_view p : absl::StrSplit(std::string(v), ',', absl::SkipEmpty())) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(p, &n) || n < lo || n > hi)
        return absl::InvalidArgumentError(
            absl::StrCat("\"", std::string(p), "\" is not an integer in [", lo, ", ", hi, "]"));
      out->push_back(n);
    }
    if (out->empty()) return absl::InvalidArgumentError("lists nothing");
    return absl::OkStatus();
  };
}

// A setter that appends each comma-separated word of `words` to `out`
// (`clear`: replacing the list), for FlagSet::Custom.
std::function<absl::Status(std::string_view)> WordList(std::vector<std::string> words,
                                                       std::vector<std::string>* out, bool clear) {
  return [words = std::move(words), out, clear](std::string_view v) {
    if (clear) out->clear();
    for (absl::string_view p : absl::StrSplit(std::string(v), ',')) {
      if (std::find(words.begin(), words.end(), p) == words.end()) {
        std::string either = words[0];
        for (size_t i = 1; i < words.size(); ++i)
          absl::StrAppend(&either, i + 1 < words.size() ? ", " : " or ", words[i]);
        return absl::InvalidArgumentError(absl::StrCat("\"", std::string(p), "\" is not ", either));
      }
      out->emplace_back(p);
    }
    return absl::OkStatus();
  };
}

// The flags, bound to `a`'s fields.
void AddFlags(FlagSet& fs, Args* a) {
  const std::vector<std::pair<std::string, bool>> on_off = {{"on", true}, {"off", false}};
  auto range = [](double lo, double hi, bool open_lo) {
    return [=](double x) { return (open_lo ? x > lo : x >= lo) && x <= hi; };
  };
  auto in = [](double lo, double hi, bool open_lo) {
    return absl::StrCat("a number in ", open_lo ? "(" : "[", lo, ", ", hi, "]");
  };
  auto cpu_list = [](std::string* out) {
    return [out](std::string_view v) {
      cpu_set_t set;
      RETURN_IF_ERROR(ParseCpuList(std::string(v), &set));
      *out = std::string(v);
      return absl::OkStatus();
    };
  };
  fs.Group("model and service");
  fs.Choice("preset", &a->preset,
            {"qwen3-30b", "ds-v3", "ds-v2-lite", "mixtral", "kimi-k2", "glm-4.5", "tiny"},
            "the model's shape (tiny: a 2-layer Qwen3-MoE, H 128, 8 experts of I 128, top-2; "
            "smoke tests only)");
  fs.Int("layers", &a->layers, 0, 4096,
         "decoder layers, dense-first ones included (0: as many as fit the routed experts in "
         "--mem-fraction of RAM at --format, at most the model's)");
  fs.Custom(
      "format", "FORMAT",
      "routed experts: bf16, int8, int4 (int4g64; int4g32, int4g128), or a native checkpoint "
      "format, quantized from the synthetic weights (common/experts/quantize.h): mxfp4, int4bf16 "
      "(compressed-tensors int4, bf16 scales, group 32; int4bf16g64 ...), fp8 (128x128 "
      "blocks), mxfp8",
      [a](std::string_view v) {
        RETURN_IF_ERROR(ParseFormatFlag(v).status());
        a->format = std::string(v);
        return absl::OkStatus();
      },
      a->format);
  fs.Double("mem-fraction", &a->mem_fraction,
            "share of RAM the routed experts may take when --layers is 0", range(0, 0.9, true),
            in(0, 0.9, true));
  fs.Custom(
      "transport", "shm|ucx|grpc", "to the expert service",
      [a](std::string_view v) {
        RETURN_IF_ERROR(ParseTransportKind(std::string(v)).status());
        a->transport = std::string(v);
        return absl::OkStatus();
      },
      a->transport);
  fs.Choice("backend", &a->backend, {"cuda", "cpu"}, "the model's backend");
  fs.Double("gpu-mem-gb", &a->gpu_mem_gb,
            "cuda: memory bound in GiB (0: the device's free memory less 1 GiB)",
            range(0, 1 << 20, false), in(0, 1 << 20, false));
  fs.Int("kv-blocks", &a->kv_blocks, 0, int64_t{1} << 32,
         "cuda: paged KV cache blocks (0: the backend's)");
  fs.Enum<DenseWeights>("gpu-weights", &a->gpu_weights,
                        {{"auto", DenseWeights::kAuto},
                         {"bf16", DenseWeights::kBf16},
                         {"fp8", DenseWeights::kFp8},
                         {"int8", DenseWeights::kInt8},
                         {"int4", DenseWeights::kInt4}},
                        "precision of attention, dense MLPs, shared experts and the LM head");
  fs.Enum<KvDtype>("kv-dtype", &a->kv_dtype,
                   {{"f32", KvDtype::kF32}, {"bf16", KvDtype::kBf16}, {"fp8", KvDtype::kFp8}},
                   "element type of the KV cache");
  fs.Int("defer-experts", &a->defer_experts, 0, 255,
         "Expert Deferral: the N lowest-weighted routed experts of a layer join one layer late "
         "(0: the exact model)");
  fs.Enum<bool>("cuda-graphs", &a->cuda_graphs, on_off, "cuda: one CUDA Graph per decode step");
  fs.Enum<bool>("log-prefill-plans", &a->log_prefill_plans, on_off,
                "cuda: per large pass, each MoE layer's choice and the streamed experts' upload / "
                "compute timeline (stderr)");
  fs.Enum<bool>("cuda-expert-slots", &a->cuda_expert_slots, on_off,
                "cuda: off sends every pass's experts the host-copy way, no slots or graphs");
  fs.Enum<bool>("cuda-expert-calls", &a->cuda_device_calls, {{"device", true}, {"host", false}},
                "cuda, slot passes: who sends each expert call and waits for it (device: kernels "
                "store and poll the shm slot's state; host: host nodes)");
  fs.Custom("service-cores", "LIST",
            "CPUs of the expert service and the DRAM probes (e.g. 0-13; "
            "default: all this process may use)",
            cpu_list(&a->service_cores));
  fs.Custom("worker-cores", "LIST",
            "CPUs of this process (the worker: its CUDA and host-node "
            "threads) once the service runs (default: all)",
            cpu_list(&a->worker_cores));
  fs.Double("router-zipf", &a->router_zipf,
            "routers with e_score_correction_bias (ds-v3): a per-layer bias of S * 0.35 * "
            "ln(1 / rank) over a random ranking of the experts, so popularity is skewed like "
            "Zipf(S) (the routing counts show how much); 0: unbiased",
            range(0, 4, false), in(0, 4, false));
  fs.Int("threads", &a->threads, 0, 4096,
         "worker threads of the model's parallel loops (0: hardware concurrency)");
  fs.Int("alias-experts", &a->alias_experts, 0, int64_t{1} << 30,
         "FIT CHECK, not a speed figure: every routed expert of every layer is one of N "
         "distinct weight sets, held once (the service's --synthetic alias=N; the GPU's copies "
         "alike), so a full-size shape loads in the memory of N experts; --layers 0 then means "
         "all the model's layers, and every output says so (0: off)");
  fs.Int("service-threads", &a->service_threads, 0, 4096,
         "the expert service's --threads, also the DRAM probe's (0: every core)");
  fs.Int("service-max-tokens", &a->service_max_tokens, 1, 1 << 20,
         "the service's --max-tokens (0: the service's)");
  fs.Double("service-timeout-s", &a->service_timeout_s, "seconds to wait for the service to load",
            range(0, 86400, true), in(0, 86400, true));
  fs.Int("expert-timeout-ms", &a->expert_timeout_ms, 1, int64_t{3600} * 1000,
         "deadline of one MoE call");
  fs.String("bin-dir", &a->bin_dir, "DIR",
            "where hmoe-expert-service is (default: this program's dir)");
  fs.String("work-dir", &a->work_dir, "DIR",
            "checkpoint and service log (default /tmp/hmoe-bench-e2e-PRESET-LLAYERS[-vVOCAB]); "
            "reused when its checkpoint matches");
  fs.Int("vocab", &a->vocab, 1, int64_t{1} << 24,
         "smoke tests only: override the vocabulary size (0: the preset's)");
  fs.Group("runs");
  fs.Custom("prompts", "LIST", "prefill prompt lengths", IntList(1, int64_t{1} << 20, &a->prompts),
            absl::StrJoin(a->prompts, ","));
  fs.Custom("batches", "LIST", "decode batch sizes", IntList(1, 4096, &a->batches),
            absl::StrJoin(a->batches, ","));
  fs.Int("decode-steps", &a->decode_steps, 1, 1 << 20, "timed decode steps per batch");
  fs.Int("decode-prompt", &a->decode_prompt, 1, 1 << 20,
         "tokens each decode sequence is prefilled with");
  fs.Int("warmup", &a->warmup, 0, 100,
         "untimed passes before each prefill row and untimed steps (2*N) before each decode row");
  fs.Int("reps", &a->reps, 1, 1000, "timed passes per prefill row");
  fs.Int("probe-bytes", &a->probe_mib, 1, int64_t{1} << 30,
         "DRAM probe buffer in MiB (0: max(8 x LLC, 2 GiB))");
  fs.Int("probe-reps", &a->probe_reps, 1, 100, "timed passes per probe pattern");
  fs.Bool("probe-after", &a->probe_after,
          "a second DRAM probe after the service has loaded (the higher reading counts)");
  fs.String("json", &a->json, "FILE", "also write the results as one JSON object");
  fs.Group("sweeps (after the runs above)");
  fs.Custom("path-sweep", "LIST",
            "batch-1 decode again per worker path, the model reloaded for each: device (slots, "
            "graphs, device calls), host (slots, graphs, host nodes), eager (slots, no graphs, "
            "device calls), copy (no slots)",
            WordList({"device", "host", "eager", "copy"}, &a->path_sweep, /*clear=*/false));
  fs.Custom("defer-sweep", "LIST",
            "batch-1 decode again for each deferral count in LIST (e.g. 0,1,2,3,4; the model is "
            "reloaded per count): tok/s, GPU and CPU busy per step and the bound perfect overlap "
            "allows",
            IntList(0, 255, &a->defer_sweep));
  fs.Custom(
      "hot-sweep", "LIST",
      "cuda: batch-1 decode again per GPU budget in GiB for hot experts (e.g. 0,8,24; 0: none), "
      "the placement planned (PlanPlacement) from the routing counts of a calibration run "
      "(batch-16 decode, --calibrate-steps steps), the hot experts' weights the service's "
      "synthetic ones: tok/s, the share of routed traffic served on the GPU and the ceiling "
      "with hot experts (DRAM bandwidth / CPU-side bytes per token)",
      [a](std::string_view v) {
        a->hot_sweep.clear();
        for (absl::string_view p : absl::StrSplit(std::string(v), ',', absl::SkipEmpty())) {
          double d = 0;
          if (!absl::SimpleAtod(p, &d) || !(d >= 0 && d <= 1e5))
            return absl::InvalidArgumentError(
                absl::StrCat("\"", std::string(p), "\" is not a number of GiB in [0, 100000]"));
          a->hot_sweep.push_back(d);
        }
        if (a->hot_sweep.empty()) return absl::InvalidArgumentError("lists nothing");
        return absl::OkStatus();
      });
  fs.Int("calibrate-steps", &a->calibrate_steps, 1, 1 << 20,
         "the hot sweep's calibration run: batch-16 decode steps");
  fs.Custom("prefill-sweep", "LIST",
            "cuda: prefill of the longest --prompts prompt again per policy of the routed experts "
            "(cpu, stream, auto; ModelOptions::prefill_experts; stream-serial and auto-serial: "
            "the same without uploading the next MoE layer's experts ahead, prefill_prefetch "
            "off), the model reloaded for each with the service's synthetic experts as its "
            "streamed copies: tok/s, the layers' choices, the experts uploaded ahead and used, "
            "and the bound of a perfect split of the experts' work, G + A*S/(A+S) (A: the cpu "
            "row's expert wait, G: its GPU time, S: the stream-serial row's GPU time, else the "
            "stream row's, less G)",
            WordList({"cpu", "stream", "auto", "stream-serial", "auto-serial"}, &a->prefill_sweep,
                     /*clear=*/true));
  fs.Int("prefill-sweep-prompt", &a->prefill_sweep_prompt, 1, int64_t{1} << 20,
         "its prompt length (0: the longest --prompts)");
}

// ---- the worker's checkpoint ------------------------------------------------------
// Every tensor ExpectedWeights names but the routed experts, bf16 (the
// router's e_score_correction_bias f32 zeros, norms 1), in one
// model.safetensors written tensor by tensor as it is generated
// (SafetensorsStreamWriter; one tensor in memory at a time): random tensors
// are slices of one 2 MiB block of random bf16 values (|x| in [2^-9, 2^-5), as
// bench/make_random_checkpoint.py), each starting at its own random offset
// and wrapping around, so router rows differ and routing spreads. Version 2:
// the stream writer's layout. With --router-zipf S the bias of decoder layer
// l is S * kZipfBiasScale * ln(1 / rank) for a random ranking of its experts
// (seeded by l), so popularity follows the ranking: the router picks the
// top-k of score + bias, which is Gumbel-top-k of Zipf(S) weights (k
// distinct experts drawn with weights rank^-S) where the scores vary like
// Gumbel noise of scale kZipfBiasScale. 0.18 matched this checkpoint's
// score spread on paper and gave half of the draws' head share on the
// H200; 0.35 is used. The benchmark prints the counts' skew beside the
// draws'.
constexpr int kCheckpointVersion = 2;
constexpr size_t kBlockValues = size_t{1} << 20;
constexpr double kZipfBiasScale = 0.35;

struct PlannedTensor {
  TensorSpec spec;
  enum Kind { kRandom, kOnes, kZerosF32, kZipfBiasF32 } kind;
  uint64_t bytes;
  int layer = -1;  // kZipfBiasF32: its decoder layer (the ranking's seed)
  double zipf_s = 0;
};

std::vector<PlannedTensor> PlanCheckpoint(const ModelConfig& config, double zipf_s) {
  std::vector<PlannedTensor> out;
  for (const WeightSpec& w : ExpectedWeights(config)) {
    if (w.role == WeightRole::kRoutedExpert) continue;
    uint64_t n = 1;
    for (int64_t d : w.shape) n *= static_cast<uint64_t>(d);
    const bool bias = w.name.size() >= 22 &&
                      w.name.compare(w.name.size() - 22, 22, "e_score_correction_bias") == 0;
    PlannedTensor t{{w.name, DType::kBF16, w.shape}, PlannedTensor::kRandom, 2 * n};
    if (bias && zipf_s > 0)
      t = {{w.name, DType::kF32, w.shape}, PlannedTensor::kZipfBiasF32, 4 * n, w.layer, zipf_s};
    else if (bias)
      t = {{w.name, DType::kF32, w.shape}, PlannedTensor::kZerosF32, 4 * n};
    else if (w.role == WeightRole::kNorm)
      t.kind = PlannedTensor::kOnes;
    out.push_back(std::move(t));
  }
  return out;
}

const std::map<std::string, std::string>& CheckpointMetadata() {
  static const auto* m =
      new std::map<std::string, std::string>{{"format", "pt"}, {"generator", "hmoe-bench-e2e"}};
  return *m;
}

std::vector<TensorSpec> Specs(const std::vector<PlannedTensor>& plan) {
  std::vector<TensorSpec> specs;
  for (const PlannedTensor& t : plan) specs.push_back(t.spec);
  return specs;
}

// The size of the file WriteCheckpointFile writes: length, header (padded to
// 8 bytes, as the stream writer reserves it) and data.
uint64_t CheckpointFileBytes(const std::vector<PlannedTensor>& plan) {
  uint64_t bytes =
      8 + (SafetensorsStreamWriter::HeaderBytes(Specs(plan), CheckpointMetadata()) + 7) / 8 * 8;
  for (const PlannedTensor& t : plan) bytes += t.bytes;
  return bytes;
}

absl::Status WriteCheckpointFile(const std::string& path, const std::vector<PlannedTensor>& plan) {
  const std::vector<TensorSpec> specs = Specs(plan);
  std::unique_ptr<SafetensorsStreamWriter> w;
  ASSIGN_OR_RETURN(
      w, SafetensorsStreamWriter::Create(
             path, specs, SafetensorsStreamWriter::HeaderBytes(specs, CheckpointMetadata())));
  for (const auto& [k, v] : CheckpointMetadata()) w->SetMetadata(k, v);
  std::mt19937_64 rng(1);
  std::vector<uint16_t> block(kBlockValues);
  for (uint16_t& v : block) {
    const uint64_t r = rng();
    v = static_cast<uint16_t>(((r & 1) << 15) | ((118 + (r >> 1) % 4) << 7) | ((r >> 8) & 0x7f));
  }
  std::mt19937_64 offsets(2);
  std::vector<uint8_t> buf;  // one tensor at a time (the largest: the embedding)
  for (const PlannedTensor& t : plan) {
    buf.resize(t.bytes);
    if (t.kind == PlannedTensor::kRandom) {
      // A slice of the block from a random offset, wrapping around.
      const auto* src = reinterpret_cast<const uint8_t*>(block.data());
      const uint64_t block_bytes = kBlockValues * 2;
      uint64_t at = 2 * (offsets() % kBlockValues);
      for (uint64_t done = 0; done < t.bytes; at = 0) {
        const uint64_t n = std::min(t.bytes - done, block_bytes - at);
        std::memcpy(buf.data() + done, src + at, n);
        done += n;
      }
    } else if (t.kind == PlannedTensor::kOnes) {
      auto* v = reinterpret_cast<uint16_t*>(buf.data());
      std::fill(v, v + t.bytes / 2, uint16_t{0x3F80});
    } else if (t.kind == PlannedTensor::kZipfBiasF32) {
      const size_t n = t.bytes / 4;
      std::vector<size_t> rank(n);
      for (size_t i = 0; i < n; ++i) rank[i] = i;
      std::mt19937_64 perm(1000 + static_cast<uint64_t>(t.layer));
      std::shuffle(rank.begin(), rank.end(), perm);
      auto* v = reinterpret_cast<float*>(buf.data());
      for (size_t e = 0; e < n; ++e)
        v[e] = static_cast<float>(-t.zipf_s * kZipfBiasScale *
                                  std::log(static_cast<double>(rank[e] + 1)));
    } else {
      std::fill(buf.begin(), buf.end(), uint8_t{0});
    }
    RETURN_IF_ERROR(w->Append(t.spec, buf.data(), buf.size()));
  }
  return w->Finish();
}

std::string ReadFileOr(const std::string& path, const std::string& def = "") {
  std::ifstream f(path, std::ios::binary);
  if (!f) return def;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Writes DIR/config.json and DIR/model.safetensors unless DIR already holds
// exactly these (its bench-e2e.stamp names the config, the generator version
// and the file's size). Returns whether it wrote.
absl::StatusOr<bool> PrepareCheckpoint(const std::string& dir, const std::string& config_text,
                                       const ModelConfig& config, double zipf_s,
                                       uint64_t* file_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  const std::vector<PlannedTensor> plan = PlanCheckpoint(config, zipf_s);
  *file_bytes = CheckpointFileBytes(plan);
  const std::string ckpt = dir + "/model.safetensors", cfg = dir + "/config.json",
                    stamp_path = dir + "/bench-e2e.stamp";
  ojson stamp_json = {{"version", kCheckpointVersion},
                      {"bytes", *file_bytes},
                      {"config", ojson::parse(config_text)}};
  if (zipf_s > 0) stamp_json["router_zipf"] = {{"s", zipf_s}, {"scale", kZipfBiasScale}};
  const std::string stamp = stamp_json.dump(1);
  const auto size = std::filesystem::file_size(ckpt, ec);
  if (!ec && size == *file_bytes && ReadFileOr(stamp_path) == stamp &&
      ReadFileOr(cfg) == config_text)
    return false;
  std::filesystem::remove(stamp_path, ec);
  std::filesystem::remove(ckpt, ec);
  struct statvfs fs;
  if (::statvfs(dir.c_str(), &fs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (free_bytes < *file_bytes + (uint64_t{1} << 30))
      return absl::ResourceExhaustedError(absl::StrCat(
          dir, ": the checkpoint needs ", HumanBytes(static_cast<int64_t>(*file_bytes)), ", ",
          HumanBytes(static_cast<int64_t>(free_bytes)),
          " free: pass another --work-dir or fewer --layers"));
  }
  {
    std::ofstream out(cfg, std::ios::binary | std::ios::trunc);
    out << config_text;
    if (!out) return absl::DataLossError(absl::StrCat(cfg, ": write failed"));
  }
  const std::string tmp = ckpt + ".tmp";
  absl::Status st = WriteCheckpointFile(tmp, plan);
  if (!st.ok()) {
    std::filesystem::remove(tmp, ec);
    return st;
  }
  std::filesystem::rename(tmp, ckpt, ec);
  if (ec) return absl::DataLossError(absl::StrCat(ckpt, ": rename failed: ", ec.message()));
  std::ofstream(stamp_path, std::ios::binary | std::ios::trunc) << stamp;
  return true;
}

// ---- the expert service child -----------------------------------------------------
std::atomic<pid_t> g_child{0};

void StopChild(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 300; ++i) {  // 30 s for the drain
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

std::string LogTail(const std::string& path, int lines = 40) {
  std::vector<std::string> all = absl::StrSplit(ReadFileOr(path, "(no log)"), '\n');
  if (static_cast<int>(all.size()) > lines) all.erase(all.begin(), all.end() - lines);
  return absl::StrJoin(all, "\n");
}

class ServiceProcess {
 public:
  ~ServiceProcess() { Stop(); }
  // Starts `bin` with `args`, stdout and stderr to `log`, and waits for its
  // port file. FAILED_PRECONDITION (with the log's tail) when it exits first,
  // DEADLINE_EXCEEDED when it does not write the port in time.
  absl::Status Start(const std::string& bin, const std::vector<std::string>& args,
                     const std::string& log, const std::string& port_file, double timeout_s) {
    log_ = log;
    std::error_code ec;
    std::filesystem::remove(port_file, ec);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
      return absl::PermissionDeniedError(
          absl::StrCat(log, ": cannot create: ", std::strerror(errno)));
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(bin.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      // Async-signal-safe calls only until exec.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execv(bin.c_str(), argv.data());
      static const char kMsg[] = "hmoe-bench-e2e: exec of the expert service failed\n";
      (void)!::write(2, kMsg, sizeof(kMsg) - 1);
      ::_exit(127);
    }
    ::close(fd);
    pid_ = pid;
    g_child = pid;
    const double t0 = Now();
    for (;;) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid_ = 0;
        g_child = 0;
        return absl::FailedPreconditionError(
            absl::StrCat("the expert service exited (",
                         WIFEXITED(status) ? absl::StrCat("status ", WEXITSTATUS(status))
                                           : absl::StrCat("signal ", WTERMSIG(status)),
                         ") before serving; ", log, " ends:\n", LogTail(log)));
      }
      const std::string text = ReadFileOr(port_file);
      int port = 0;
      if (!text.empty() && text.back() == '\n' &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
        port_ = port;
        return absl::OkStatus();
      }
      if (Now() - t0 > timeout_s)
        return absl::DeadlineExceededError(
            absl::StrCat("the expert service did not serve within --service-timeout-s ", timeout_s,
                         " s; ", log, " ends:\n", LogTail(log)));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  void Stop() {
    if (pid_ > 0) StopChild(pid_);
    pid_ = 0;
    g_child = 0;
  }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = 0;
  int port_ = 0;
  std::string log_;
};

// ---- machine facts ----------------------------------------------------------------
std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      if (c != std::string::npos)
        return std::string(absl::StripAsciiWhitespace(line.substr(c + 1)));
    }
  return "unknown";
}

// The calling thread's CPUs (threads it starts later inherit them).
absl::Status PinThread(const cpu_set_t& set, const std::string& what) {
  if (sched_setaffinity(0, sizeof(set), &set) != 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", std::strerror(errno)));
  return absl::OkStatus();
}

// `list` as a CPU set; `all` when empty.
cpu_set_t CpusOr(const std::string& list, const cpu_set_t& all) {
  cpu_set_t set = all;
  if (!list.empty()) ParseCpuList(list, &set).IgnoreError();  // checked by AddFlags
  return set;
}

std::string SelfDir() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

ojson ProbeJson(const DramProbe& p) {
  ojson pat = ojson::object();
  for (const DramPattern& d : p.patterns) pat[d.name] = d.gbs;
  return {{"buffer_bytes", p.buffer_bytes},
          {"threads", p.threads},
          {"patterns_gbs", pat},
          {"best_gbs", p.best_gbs},
          {"best", p.best}};
}

ojson StatsJson(const ModelStats& s) {
  return {{"passes", s.passes},
          {"tokens", s.tokens},
          {"kernel_launches", s.kernel_launches},
          {"gpu_busy_ns", s.gpu_busy_ns},
          {"expert_wait_ns", s.expert_wait_ns},
          {"graph_launches", s.graph_launches},
          {"graph_captures", s.graph_captures},
          {"prefill_cpu_layers", s.prefill_cpu_layers},
          {"prefill_stream_layers", s.prefill_stream_layers},
          {"prefill_split_layers", s.prefill_split_layers},
          {"streamed_slots", s.streamed_slots},
          {"prefetched_experts", s.prefetched_experts},
          {"prefetch_used_experts", s.prefetch_used_experts},
          {"gemm_attention_tokens", s.gemm_attention_tokens}};
}

ModelStats Delta(const ModelStats& a, const ModelStats& b) {
  ModelStats d;
  d.passes = b.passes - a.passes;
  d.tokens = b.tokens - a.tokens;
  d.kernel_launches = b.kernel_launches - a.kernel_launches;
  d.gpu_busy_ns = b.gpu_busy_ns - a.gpu_busy_ns;
  d.expert_wait_ns = b.expert_wait_ns - a.expert_wait_ns;
  d.graph_launches = b.graph_launches - a.graph_launches;
  d.graph_captures = b.graph_captures - a.graph_captures;
  d.prefill_cpu_layers = b.prefill_cpu_layers - a.prefill_cpu_layers;
  d.prefill_stream_layers = b.prefill_stream_layers - a.prefill_stream_layers;
  d.prefill_split_layers = b.prefill_split_layers - a.prefill_split_layers;
  d.streamed_slots = b.streamed_slots - a.streamed_slots;
  d.prefetched_experts = b.prefetched_experts - a.prefetched_experts;
  d.prefetch_used_experts = b.prefetch_used_experts - a.prefetch_used_experts;
  d.gemm_attention_tokens = b.gemm_attention_tokens - a.gemm_attention_tokens;
  return d;
}

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

// "12.3" or "-" for a counter the backend does not keep.
// How skewed routing counts are: per MoE layer, the share of its selections
// its busiest 1% / 10% / 25% of experts (at least one) took, averaged over
// layers; with zipf_s > 0 also the same shares of k distinct experts drawn
// per token with Zipf(zipf_s) weights (Gumbel-top-k, 4096 tokens, seeded).
ojson RoutingSkewJson(const RoutingTable& t, double zipf_s) {
  const double fractions[3] = {0.01, 0.10, 0.25};
  ojson top = ojson::array(), zipf = ojson::array();
  for (double f : fractions) {
    double sum = 0;
    int n = 0;
    for (const RoutingTable::Layer& L : t.layers) {
      std::vector<uint64_t> c = L.tokens;
      std::sort(c.rbegin(), c.rend());
      const size_t k = std::max<size_t>(1, static_cast<size_t>(f * static_cast<double>(c.size())));
      double all = 0, head = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        all += static_cast<double>(c[i]);
        if (i < k) head += static_cast<double>(c[i]);
      }
      if (all > 0) {
        sum += head / all;
        ++n;
      }
    }
    top.push_back(n > 0 ? sum / n : 0.0);
    if (zipf_s > 0) {
      const size_t E = static_cast<size_t>(t.num_experts);
      const size_t K =
          static_cast<size_t>(std::clamp<int64_t>(t.experts_per_token, 1, t.num_experts));
      std::vector<double> counts(E, 0.0), keys(E);
      std::vector<size_t> order(E);
      std::mt19937_64 rng(7);
      std::uniform_real_distribution<double> u(1e-12, 1.0);
      for (int tok = 0; tok < 4096; ++tok) {
        for (size_t r = 0; r < E; ++r) {
          keys[r] = -zipf_s * std::log(static_cast<double>(r + 1)) - std::log(-std::log(u(rng)));
          order[r] = r;
        }
        std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(K),
                          order.end(), [&](size_t x, size_t y) { return keys[x] > keys[y]; });
        for (size_t j = 0; j < K; ++j) counts[order[j]] += 1;
      }
      std::sort(counts.rbegin(), counts.rend());
      const size_t k = std::max<size_t>(1, static_cast<size_t>(f * static_cast<double>(E)));
      double all = 0, head = 0;
      for (size_t r = 0; r < E; ++r) {
        all += counts[r];
        if (r < k) head += counts[r];
      }
      zipf.push_back(all > 0 ? head / all : 0.0);
    }
  }
  ojson j = {{"fractions", {0.01, 0.10, 0.25}}, {"top_share", top}};
  if (zipf_s > 0) j["zipf_share"] = zipf;
  return j;
}

std::string Cell(double v, bool kept, const char* fmt = "%.2f") {
  return kept ? absl::StrFormat(fmt, v) : std::string("-");
}

constexpr const char* kFitCheck = "FIT CHECK (aliased experts): not a speed figure";

// A table's leading blank line, and under --alias-experts the fit-check label.
void TableNote(const Args& a) {
  std::printf("\n");
  if (a.alias_experts > 0) std::printf("# %s\n", kFitCheck);
}

// ---- the run ----------------------------------------------------------------------
absl::Status Run(const Args& a) {
  const double t_start = Now();
  // Shape and layer count.
  ojson cfg = *PresetConfig(a.preset);
  if (a.vocab > 0) {
    cfg["vocab_size"] = a.vocab;
    for (const char* id : {"bos_token_id", "eos_token_id"})  // kept inside the vocabulary
      if (cfg.contains(id) && cfg[id].get<int64_t>() >= a.vocab) cfg[id] = a.vocab - 1;
  }
  const int real_layers = cfg["num_hidden_layers"].get<int>();
  const int first_dense =
      cfg.contains("first_k_dense_replace") ? cfg["first_k_dense_replace"].get<int>() : 0;
  ASSIGN_OR_RETURN(const ModelConfig full, ParseModelConfig(cfg.dump(), "preset " + a.preset));
  const int64_t H = full.hidden_size, I = full.moe.intermediate_size, E = full.moe.num_experts;
  const int K = static_cast<int>(full.moe.experts_per_token);
  const std::pair<WeightFormat, int> format_group = *ParseFormatFlag(a.format);  // checked
  const WeightFormat fmt = format_group.first;
  const int group = format_group.second;
  const std::string service_format = WeightFormatName(fmt, group);

  // The backend and the expert service binary, checked before anything takes time.
  ASSIGN_OR_RETURN(const std::string resolved_backend, ResolveBackend(a.backend));
  if (a.router_zipf > 0 && !full.moe.score_correction_bias)
    return absl::InvalidArgumentError(
        absl::StrCat("--router-zipf: ", a.preset,
                     "'s router has no e_score_correction_bias to skew (ds-v3 has)"));
  if (!a.hot_sweep.empty() && resolved_backend != "cuda")
    return absl::InvalidArgumentError("--hot-sweep: hot experts need the cuda backend");
  if (!a.prefill_sweep.empty() && resolved_backend != "cuda")
    return absl::InvalidArgumentError("--prefill-sweep: streamed experts need the cuda backend");
  const std::string bin =
      (std::filesystem::path(a.bin_dir.empty() ? SelfDir() : a.bin_dir) / "hmoe-expert-service")
          .string();
  if (::access(bin.c_str(), X_OK) != 0)
    return absl::NotFoundError(absl::StrCat(
        bin, ": not found or not executable (build hmoe-expert-service, or --bin-dir)"));
  // The service (and the DRAM probes, which stand for it) on --service-cores,
  // this process on --worker-cores once the service runs.
  cpu_set_t all_cpus;
  if (sched_getaffinity(0, sizeof(all_cpus), &all_cpus) != 0)
    return absl::InternalError(absl::StrCat("sched_getaffinity: ", std::strerror(errno)));
  const cpu_set_t service_cpus = CpusOr(a.service_cores, all_cpus);
  const cpu_set_t worker_cpus = CpusOr(a.worker_cores, all_cpus);
  RETURN_IF_ERROR(PinThread(service_cpus, "--service-cores"));
  if (!a.service_cores.empty() || !a.worker_cores.empty())
    std::printf("# CPUs: expert service and DRAM probes %s, worker %s\n",
                a.service_cores.empty() ? "all" : a.service_cores.c_str(),
                a.worker_cores.empty() ? "all" : a.worker_cores.c_str());
  // The probe's pool is the service's: same thread count, same pinning.
  ThreadPoolOptions tpo;
  tpo.max_threads = a.service_threads;
  RETURN_IF_ERROR(ThreadCountsFromEnv(&tpo.max_threads, &tpo.virtual_nodes));  // as the service
  std::unique_ptr<ThreadPool> probe_pool;
  ASSIGN_OR_RETURN(probe_pool, ThreadPool::Create(tpo));
  PackOptions po;
  po.format = fmt;
  po.group = group > 0 ? group : 128;
  ASSIGN_OR_RETURN(const PackedMoeLayer plan, PackedMoeLayer::Plan(H, I, E, po, *probe_pool));
  const int64_t expert_bytes = plan.expert_bytes();
  const double bytes_per_weight = static_cast<double>(expert_bytes) / (3.0 * H * I);
  const MemoryLimits mem = ReadMemoryLimits();
  const int64_t ram =
      mem.cgroup_bytes > 0 ? std::min(mem.machine_bytes, mem.cgroup_bytes) : mem.machine_bytes;
  int layers = a.layers;
  if (a.alias_experts > 0) {
    // Aliased: the service holds N experts whatever the layer count.
    const int64_t held = a.alias_experts * expert_bytes;
    if (static_cast<double>(held) > a.mem_fraction * static_cast<double>(ram))
      return absl::ResourceExhaustedError(absl::StrCat(
          "--alias-experts ", a.alias_experts, ": ", HumanBytes(held), " of ", service_format,
          " experts, over ", a.mem_fraction, " of the ", HumanBytes(ram), " of RAM"));
    for (const std::string& p : a.prefill_sweep)
      if (p != "cpu")
        return absl::InvalidArgumentError(
            absl::StrCat("--prefill-sweep ", p,
                         " with --alias-experts: the pinned host copy of the streamed "
                         "experts holds every layer's experts, not aliased (use cpu)"));
    if (layers == 0) layers = real_layers;
  }
  if (layers == 0) {
    const int64_t fit =
        static_cast<int64_t>(a.mem_fraction * static_cast<double>(ram)) / (E * expert_bytes);
    if (fit < 1)
      return absl::ResourceExhaustedError(absl::StrCat(
          "one MoE layer of ", a.preset, " at ", service_format, " takes ",
          HumanBytes(E * expert_bytes), ", over ", a.mem_fraction, " of the ", HumanBytes(ram),
          " of RAM: use a smaller --format or --mem-fraction / --layers"));
    layers = static_cast<int>(std::min<int64_t>(real_layers, first_dense + fit));
  }
  if (layers > real_layers)
    return absl::InvalidArgumentError(
        absl::StrCat("--layers ", layers, ": ", a.preset, " has ", real_layers));
  if (layers <= first_dense)
    return absl::InvalidArgumentError(absl::StrCat("--layers ", layers, ": ", a.preset, "'s first ",
                                                   first_dense,
                                                   " layers are dense; no MoE layer would remain"));
  cfg["num_hidden_layers"] = layers;
  const std::string config_text = cfg.dump(1) + "\n";
  ASSIGN_OR_RETURN(const ModelConfig config, ParseModelConfig(config_text, "preset " + a.preset));
  const std::vector<int32_t> moe_layers = config.moe_layer_indices();
  for (size_t i = 0; i < moe_layers.size(); ++i)
    if (moe_layers[i] != first_dense + static_cast<int>(i))
      return absl::UnimplementedError(
          absl::StrCat(a.preset, ": MoE layers are not layers ", first_dense, "..", layers - 1));
  const int64_t L_moe = static_cast<int64_t>(moe_layers.size());
  const double routed_bytes_per_token = static_cast<double>(L_moe) * K * expert_bytes;

  const int64_t max_prompt = *std::max_element(a.prompts.begin(), a.prompts.end());
  const int warm_steps = 2 * a.warmup;
  const int64_t decode_len = a.decode_prompt + warm_steps + a.decode_steps;
  const int64_t max_seq = std::max(
      {max_prompt, decode_len, a.prefill_sweep_prompt,
       a.hot_sweep.empty() ? int64_t{0} : a.decode_prompt + warm_steps + a.calibrate_steps});
  const int64_t vocab = config.vocab_size;

  std::printf(
      "# hmoe-bench-e2e %s (%s): %d of %d layers (%lld MoE, first %d dense), H %lld, "
      "%lld experts top-%d, I %lld, vocab %lld\n",
      a.preset.c_str(), config.model_type.c_str(), layers, real_layers,
      static_cast<long long>(L_moe), first_dense, static_cast<long long>(H),
      static_cast<long long>(E), K, static_cast<long long>(I), static_cast<long long>(vocab));
  std::printf(
      "# experts %s: %.4f bytes/weight (%s per expert, %s per layer, %s in all); "
      "transport %s, backend %s\n",
      service_format.c_str(), bytes_per_weight, HumanBytes(expert_bytes).c_str(),
      HumanBytes(E * expert_bytes).c_str(), HumanBytes(L_moe * E * expert_bytes).c_str(),
      a.transport.c_str(), a.backend.c_str());
  if (a.alias_experts > 0)
    std::printf("# %s: every routed expert is one of %lld distinct weight sets (%s held)\n",
                kFitCheck, static_cast<long long>(a.alias_experts),
                HumanBytes(a.alias_experts * expert_bytes).c_str());
  std::fflush(stdout);

  // The worker's checkpoint.
  const std::string work_dir =
      !a.work_dir.empty()
          ? a.work_dir
          : absl::StrCat("/tmp/hmoe-bench-e2e-", a.preset, "-L", layers,
                         a.vocab > 0 ? absl::StrCat("-v", a.vocab) : "",
                         a.router_zipf > 0 ? absl::StrCat("-zipf", a.router_zipf) : "");
  double t0 = Now();
  uint64_t ckpt_bytes = 0;
  ASSIGN_OR_RETURN(const bool wrote,
                   PrepareCheckpoint(work_dir, config_text, config, a.router_zipf, &ckpt_bytes));
  const double ckpt_s = Now() - t0;
  std::printf("# checkpoint %s/model.safetensors: %s, %s in %.1f s\n", work_dir.c_str(),
              HumanBytes(static_cast<int64_t>(ckpt_bytes)).c_str(), wrote ? "written" : "reused",
              ckpt_s);
  std::fflush(stdout);

  // DRAM bandwidth before the service exists.
  const int64_t probe_bytes = a.probe_mib > 0 ? (a.probe_mib << 20) : DefaultProbeBytes();
  ASSIGN_OR_RETURN(const DramProbe bw_before,
                   MeasureDramRead(*probe_pool, probe_bytes, a.probe_reps));
  const int service_threads = probe_pool->num_threads();
  const int numa_nodes = probe_pool->num_nodes();
  probe_pool.reset();
  std::printf("# DRAM read, %d threads, %s buffer: %s\n", bw_before.threads,
              HumanBytes(bw_before.buffer_bytes).c_str(), DramProbeSummary(bw_before).c_str());
  // The denominator: the best the probe read (raised below if the second
  // probe reads more), so that a low first reading cannot flatter us.
  double bw = bw_before.best_gbs;
  std::string bw_source = "before_service";
  std::printf(
      "# routed bytes per token %s -> CPU-expert decode ceiling %.1f tok/s at this reading%s\n",
      HumanBytes(static_cast<int64_t>(routed_bytes_per_token)).c_str(),
      bw * 1e9 / routed_bytes_per_token,
      a.alias_experts > 0 ? absl::StrCat(" (", kFitCheck, ")").c_str() : "");
  std::fflush(stdout);

  // The expert service.
  std::string spec = absl::StrCat("hidden=", H, ",intermediate=", I, ",experts=", E, ",top_k=", K,
                                  ",layers=", layers);
  if (first_dense > 0) absl::StrAppend(&spec, ",first_dense=", first_dense);
  if (a.alias_experts > 0) absl::StrAppend(&spec, ",alias=", a.alias_experts);
  std::vector<std::string> sargs = {"--synthetic", spec,
                                    "--format",    service_format,
                                    "--listen",    "127.0.0.1:0",
                                    "--port-file", work_dir + "/service.port",
                                    "--threads",   std::to_string(a.service_threads)};
  if (a.service_max_tokens > 0) {
    sargs.push_back("--max-tokens");
    sargs.push_back(std::to_string(a.service_max_tokens));
  }
  if (a.transport != "ucx") sargs.push_back("--no-ucx");
  std::printf("# starting %s %s\n", bin.c_str(), absl::StrJoin(sargs, " ").c_str());
  std::fflush(stdout);
  ServiceProcess service;
  t0 = Now();
  RETURN_IF_ERROR(service.Start(bin, sargs, work_dir + "/service.log", work_dir + "/service.port",
                                a.service_timeout_s));
  const double service_s = Now() - t0;
  std::printf("# expert service pid %d serving on port %d after %.1f s (log %s/service.log)\n",
              static_cast<int>(service.pid()), service.port(), service_s, work_dir.c_str());
  std::fflush(stdout);
  RETURN_IF_ERROR(PinThread(worker_cpus, "--worker-cores"));

  ExpertPoolOptions epo;
  epo.targets = {absl::StrCat("127.0.0.1:", service.port())};
  ASSIGN_OR_RETURN(epo.transport, ParseTransportKind(a.transport));
  epo.connect_timeout = absl::Seconds(30);
  std::unique_ptr<ExpertPool> pool;
  ASSIGN_OR_RETURN(pool, ExpertPool::Connect(epo));
  std::unique_ptr<PoolRoutedExperts> experts;
  ASSIGN_OR_RETURN(experts, PoolRoutedExperts::Create(config, pool.get(),
                                                      absl::Milliseconds(a.expert_timeout_ms), ""));

  std::optional<DramProbe> bw_after;
  if (a.probe_after) {
    RETURN_IF_ERROR(PinThread(service_cpus, "--service-cores"));
    std::unique_ptr<ThreadPool> p;
    ASSIGN_OR_RETURN(p, ThreadPool::Create(tpo));
    ASSIGN_OR_RETURN(bw_after, MeasureDramRead(*p, probe_bytes, a.probe_reps));
    p.reset();
    RETURN_IF_ERROR(PinThread(worker_cpus, "--worker-cores"));
    std::printf("# DRAM read again with the service loaded: best %.1f GB/s (%s)%s\n",
                bw_after->best_gbs, bw_after->best.c_str(),
                bw_after->best_gbs > bw ? ": the ceiling uses it" : "");
    if (bw_after->best_gbs > bw) {
      bw = bw_after->best_gbs;
      bw_source = "after_service";
    }
  }
  const double ceiling = bw * 1e9 / routed_bytes_per_token;

  // The model.
  ModelOptions mo;
  mo.backend = a.backend;
  mo.cuda.gpu_mem_gb = a.gpu_mem_gb;
  mo.cuda.kv_blocks = a.kv_blocks;
  mo.deferred_experts = a.defer_experts;
  mo.weights = a.gpu_weights;
  mo.kv_dtype = a.kv_dtype;
  mo.cuda.graphs = a.cuda_graphs;
  mo.cuda.log_prefill_plans = a.log_prefill_plans;
  mo.cuda.expert_slots = a.cuda_expert_slots;
  mo.cuda.slot_calls = a.cuda_device_calls ? SlotCalls::kDeviceSends : SlotCalls::kHostNodes;
  mo.num_threads = a.threads;
  mo.max_seq_len = max_seq;
  t0 = Now();
  std::unique_ptr<Checkpoint> ckpt;
  ASSIGN_OR_RETURN(ckpt, Checkpoint::Open(work_dir));
  std::unique_ptr<Model> model;
  ASSIGN_OR_RETURN(model, Model::Create(config, *ckpt, mo, experts.get()));
  ckpt.reset();
  const double load_s = Now() - t0;
  std::printf(
      "# model loaded (backend %s) in %.1f s; max_seq_len %lld, KV blocks %lld, deferred "
      "experts %d\n",
      model->options().backend.c_str(), load_s, static_cast<long long>(max_seq),
      static_cast<long long>(model->kv_blocks_total()), a.defer_experts);
  std::fflush(stdout);
  const std::string backend = model->options().backend;
  const bool gpu = backend == "cuda";

  std::mt19937_64 rng(42);
  std::vector<float> logits;

  // Prefill.
  ojson prefill = ojson::array();
  TableNote(a);
  std::printf("%-8s %10s %10s %12s %10s %14s\n", "prompt", "ms", "tok/s", "launches", "gpu_ms",
              "expert_wait_ms");
  // `warmups` untimed then a.reps timed prefills of `tokens` on `model`,
  // each in a fresh Sequence: ms per rep and the stats over the timed ones.
  struct PrefillRun {
    double ms = 0;
    ModelStats d;
  };
  auto time_prefill = [&](const std::vector<int32_t>& tokens, int warmups,
                          const std::string& what) -> absl::StatusOr<PrefillRun> {
    for (int w = 0; w < warmups; ++w) {
      auto seq = model->NewSequence();
      RETURN_IF_ERROR(Annotate(model->Forward(*seq, tokens, LogitsMode::kLast, &logits),
                               absl::StrCat(what, " warm-up")));
    }
    double total = 0;
    const ModelStats s0 = model->stats();
    for (int r = 0; r < a.reps; ++r) {
      auto seq = model->NewSequence();
      const double t = Now();
      RETURN_IF_ERROR(Annotate(model->Forward(*seq, tokens, LogitsMode::kLast, &logits), what));
      total += Now() - t;
    }
    return PrefillRun{total / a.reps * 1e3, Delta(s0, model->stats())};
  };
  for (int64_t P : a.prompts) {
    const std::vector<int32_t> tokens = RandomTokens(rng, P, vocab);
    ASSIGN_OR_RETURN(const PrefillRun run,
                     time_prefill(tokens, a.warmup, absl::StrCat("prefill, prompt ", P)));
    const ModelStats& d = run.d;
    const double ms = run.ms;
    const double launches = static_cast<double>(d.kernel_launches) / a.reps;
    const double gpu_ms = static_cast<double>(d.gpu_busy_ns) / a.reps / 1e6;
    const double wait_ms = static_cast<double>(d.expert_wait_ns) / a.reps / 1e6;
    std::printf(
        "%-8lld %10.1f %10.1f %12s %10s %14s\n", static_cast<long long>(P), ms,
        static_cast<double>(P) / ms * 1e3, Cell(launches, d.kernel_launches > 0, "%.0f").c_str(),
        Cell(gpu_ms, d.gpu_busy_ns > 0).c_str(), Cell(wait_ms, d.expert_wait_ns > 0).c_str());
    std::fflush(stdout);
    prefill.push_back({{"prompt", P},
                       {"reps", a.reps},
                       {"ms", ms},
                       {"tok_s", static_cast<double>(P) / ms * 1e3},
                       {"launches", launches},
                       {"gpu_ms", gpu_ms},
                       {"expert_wait_ms", wait_ms},
                       {"stats_delta", StatsJson(d)}});
  }

  // Decode.
  ojson decode = ojson::array();
  TableNote(a);
  std::printf("%-6s %9s %10s %10s %11s %9s %14s %13s %12s %18s\n", "batch", "step_ms", "tok/s",
              "tok/s/seq", "ceiling", "%ceiling", "launches/step", "graphs/step", "gpu_ms/step",
              "expert_wait_ms/step");
  double fraction_b1 = -1;
  // Decode steps of batch b on `m` (its own sequences, prefilled first).
  struct DecodeRun {
    double dt = 0;       // seconds for a.decode_steps steps
    ModelStats d;        // stats over them
    double cpu_ns = -1;  // the expert service's compute time over them (with `control`)
  };
  auto run_decode = [&](const Model& m, int64_t b, ControlClient* control = nullptr,
                        int64_t timed_steps = 0) -> absl::StatusOr<DecodeRun> {
    if (timed_steps <= 0) timed_steps = a.decode_steps;
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::vector<float>> outs(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      seqs.push_back(m.NewSequence());
      prompts.push_back(RandomTokens(rng, a.decode_prompt, vocab));
    }
    std::vector<ForwardStep> steps(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i)
      steps[static_cast<size_t>(i)] = {seqs[static_cast<size_t>(i)].get(),
                                       prompts[static_cast<size_t>(i)], LogitsMode::kLast,
                                       &outs[static_cast<size_t>(i)]};
    RETURN_IF_ERROR(Annotate(m.ForwardBatch(steps), absl::StrCat("decode batch ", b, ": prefill")));
    std::vector<int32_t> next(static_cast<size_t>(b));
    auto step = [&]() -> absl::Status {
      for (int64_t i = 0; i < b; ++i) {
        next[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
        steps[static_cast<size_t>(i)].tokens =
            absl::Span<const int32_t>(&next[static_cast<size_t>(i)], 1);
      }
      return m.ForwardBatch(steps);
    };
    for (int w = 0; w < warm_steps; ++w)
      RETURN_IF_ERROR(Annotate(step(), absl::StrCat("decode batch ", b, ": warm-up step")));
    ShardStats c0;
    if (control) {
      ASSIGN_OR_RETURN(c0, control->Stats());
    }
    const ModelStats s0 = m.stats();
    const double t = Now();
    for (int64_t s = 0; s < timed_steps; ++s)
      RETURN_IF_ERROR(Annotate(step(), absl::StrCat("decode batch ", b, ": step ", s)));
    DecodeRun r;
    r.dt = Now() - t;
    r.d = Delta(s0, m.stats());
    if (control) {
      ASSIGN_OR_RETURN(const ShardStats c1, control->Stats());
      r.cpu_ns = static_cast<double>(c1.compute_ns - c0.compute_ns);
    }
    return r;
  };
  for (int64_t b : a.batches) {
    ASSIGN_OR_RETURN(const DecodeRun run, run_decode(*model, b));
    const double dt = run.dt;
    const ModelStats& d = run.d;
    const double n = static_cast<double>(a.decode_steps);
    const double tok_s = static_cast<double>(b) * n / dt, per_seq = n / dt;
    // Distinct experts a step of b tokens reads per layer under uniform
    // routing (each token's k of E): E (1 - (1 - k/E)^b); b = 1: k, the ceiling above.
    const double distinct = static_cast<double>(E) *
                            (1.0 - std::pow(1.0 - static_cast<double>(K) / static_cast<double>(E),
                                            static_cast<double>(b)));
    const double ceil_b =
        static_cast<double>(b) * bw * 1e9 /
        (static_cast<double>(L_moe) * distinct * static_cast<double>(expert_bytes));
    const double frac = tok_s / ceil_b;
    if (b == 1) fraction_b1 = frac;
    const double launches = static_cast<double>(d.kernel_launches) / n;
    const double graphs = static_cast<double>(d.graph_launches) / n;
    const double gpu_ms = static_cast<double>(d.gpu_busy_ns) / n / 1e6;
    const double wait_ms = static_cast<double>(d.expert_wait_ns) / n / 1e6;
    std::printf("%-6lld %9.2f %10.1f %10.2f %11.1f %8.1f%% %14s %13s %12s %18s\n",
                static_cast<long long>(b), dt / n * 1e3, tok_s, per_seq, ceil_b, 100 * frac,
                Cell(launches, d.kernel_launches > 0, "%.0f").c_str(),
                Cell(graphs, gpu, "%.2f").c_str(), Cell(gpu_ms, d.gpu_busy_ns > 0, "%.3f").c_str(),
                Cell(wait_ms, d.expert_wait_ns > 0, "%.3f").c_str());
    std::fflush(stdout);
    decode.push_back({{"batch", b},
                      {"steps", a.decode_steps},
                      {"prompt", a.decode_prompt},
                      {"step_ms", dt / n * 1e3},
                      {"tok_s", tok_s},
                      {"tok_s_per_seq", per_seq},
                      {"ceiling_tok_s", ceil_b},
                      {"fraction_of_ceiling", frac},
                      {"launches_per_step", launches},
                      {"graph_launches_per_step", graphs},
                      {"gpu_ms_per_step", gpu_ms},
                      {"expert_wait_ms_per_step", wait_ms},
                      {"stats_delta", StatsJson(d)}});
  }
  if (fraction_b1 >= 0)
    std::printf(
        "\n# batch 1: %.1f%% of the CPU-expert decode ceiling (%.1f tok/s at %.1f GB/s)%s\n",
        100 * fraction_b1, ceiling, bw,
        a.alias_experts > 0 ? absl::StrCat(": ", kFitCheck).c_str() : "");
  std::printf(
      "# ceiling for batch > 1: the same bandwidth over the distinct experts a step "
      "reads under uniform routing (an estimate)%s\n",
      gpu ? "" : "; launches / gpu_ms: '-' where the backend keeps no such counter");

  // The hot sweep's calibration: the routing counts of a batch-16 decode
  // run (its 32-token prompts and --calibrate-steps steps: short contexts
  // like the rows it plans for; this checkpoint's router input after a long
  // prefill differs), and how skewed the router is.
  RoutingTable calib = model->routing_stats();
  if (!a.hot_sweep.empty()) {
    const RoutingTable before = model->routing_stats();
    RETURN_IF_ERROR(
        Annotate(run_decode(*model, 16, nullptr, a.calibrate_steps).status(), "calibration"));
    calib = model->routing_stats();
    for (size_t i = 0; i < calib.layers.size() && i < before.layers.size(); ++i)
      for (size_t e = 0; e < calib.layers[i].tokens.size(); ++e)
        calib.layers[i].tokens[e] -= before.layers[i].tokens[e];
  }
  const ojson skew = RoutingSkewJson(calib, a.router_zipf);
  if (!calib.layers.empty())
    std::printf(
        "# routing counts (%llu tokens per MoE layer): the top 1%%/10%%/25%% of a layer's "
        "experts take %.1f/%.1f/%.1f%% of its traffic (uniform: 1/10/25%%%s)\n",
        static_cast<unsigned long long>(calib.routed_tokens()),
        100 * skew["top_share"][0].get<double>(), 100 * skew["top_share"][1].get<double>(),
        100 * skew["top_share"][2].get<double>(),
        a.router_zipf > 0
            ? absl::StrFormat("; top-k draws with Zipf(%g) weights: %.1f/%.1f/%.1f%%",
                              a.router_zipf, 100 * skew["zipf_share"][0].get<double>(),
                              100 * skew["zipf_share"][1].get<double>(),
                              100 * skew["zipf_share"][2].get<double>())
                  .c_str()
            : "");

  // Expert Deferral: batch-1 decode per deferral count (the model reloaded
  // each time; the service stays), against the bound perfect overlap allows:
  // 1 / max(GPU busy, CPU busy) per step.
  // Batch-1 decode with the model reloaded under `so` (a sweep's row).
  struct SweepRow {
    DecodeRun run;
    double step_ms = 0, tok_s = 0, gpu_ms = 0, cpu_ms = 0;  // per step
  };
  // The model again under `so` (the service stays).
  auto reload = [&](const ModelOptions& so) -> absl::Status {
    model.reset();
    ASSIGN_OR_RETURN(ckpt, Checkpoint::Open(work_dir));
    ASSIGN_OR_RETURN(model, Model::Create(config, *ckpt, so, experts.get()));
    ckpt.reset();
    return absl::OkStatus();
  };
  // The GPU's copies of routed experts (hot, streamed) as the service holds
  // them: its --synthetic weights (seed 1) in its format.
  const SyntheticExperts synth{H, I, E, 1, a.alias_experts};
  const int copy_group = group > 0 ? group : 64;
  auto with_gpu_copies = [&](ModelOptions so) {
    so.cuda.expert_source = [synth](int layer) { return SyntheticExpertSource(synth, layer); };
    so.cuda.hot_format = fmt;
    so.cuda.hot_group = copy_group;
    return so;
  };
  auto sweep_row = [&](const ModelOptions& so, ControlClient* control) -> absl::StatusOr<SweepRow> {
    RETURN_IF_ERROR(reload(so));
    SweepRow r;
    ASSIGN_OR_RETURN(r.run, run_decode(*model, 1, control));
    const double n = static_cast<double>(a.decode_steps);
    r.step_ms = r.run.dt / n * 1e3;
    r.tok_s = n / r.run.dt;
    r.gpu_ms = static_cast<double>(r.run.d.gpu_busy_ns) / n / 1e6;
    r.cpu_ms = r.run.cpu_ns / n / 1e6;
    return r;
  };
  ojson sweep = ojson::array();
  double sweep_frac_2 = -1;
  if (!a.defer_sweep.empty()) {
    ControlClient control(MakeExpertChannel(epo.targets[0]));
    TableNote(a);
    std::printf("%-6s %9s %10s %12s %12s %9s %9s %12s %8s %13s\n", "defer", "step_ms", "tok/s",
                "gpu_ms/step", "cpu_ms/step", "gpu_busy", "cpu_busy", "bound_tok/s", "%bound",
                "speedup_bound");
    double step0_ms = -1;
    for (int64_t nd : a.defer_sweep) {
      if (nd >= K) {
        std::printf("%-6lld (skipped: top-k is %lld)\n", static_cast<long long>(nd),
                    static_cast<long long>(K));
        continue;
      }
      ModelOptions so = mo;
      so.deferred_experts = static_cast<int>(nd);
      ASSIGN_OR_RETURN(const SweepRow r, sweep_row(so, &control));
      const DecodeRun& run = r.run;
      const double step_ms = r.step_ms, tok_s = r.tok_s, gpu_ms = r.gpu_ms, cpu_ms = r.cpu_ms;
      if (nd == 0) step0_ms = step_ms;
      const double bound_ms = std::max(gpu_ms, cpu_ms);
      const double bound_tok_s = bound_ms > 0 ? 1e3 / bound_ms : 0;
      const double frac = bound_tok_s > 0 ? tok_s / bound_tok_s : 0;
      const double speedup = step0_ms > 0 && bound_ms > 0 ? step0_ms / bound_ms : 0;
      if (nd == 2) sweep_frac_2 = frac;
      std::printf("%-6lld %9.2f %10.1f %12.3f %12.3f %8.1f%% %8.1f%% %12.1f %7.1f%% %13s\n",
                  static_cast<long long>(nd), step_ms, tok_s, gpu_ms, cpu_ms,
                  100 * gpu_ms / step_ms, 100 * cpu_ms / step_ms, bound_tok_s, 100 * frac,
                  Cell(speedup, step0_ms > 0, "%.2fx").c_str());
      std::fflush(stdout);
      sweep.push_back({{"deferred", nd},
                       {"step_ms", step_ms},
                       {"tok_s", tok_s},
                       {"gpu_ms_per_step", gpu_ms},
                       {"cpu_ms_per_step", cpu_ms},
                       {"gpu_busy", gpu_ms / step_ms},
                       {"cpu_busy", cpu_ms / step_ms},
                       {"bound_tok_s", bound_tok_s},
                       {"fraction_of_bound", frac},
                       {"speedup_bound_vs_no_deferral", speedup},
                       {"stats_delta", StatsJson(run.d)}});
    }
    if (sweep_frac_2 >= 0)
      std::printf("# deferral 2: %.1f%% of the perfect-overlap bound\n", 100 * sweep_frac_2);
  }

  ojson paths = ojson::array();
  if (!a.path_sweep.empty()) {
    ControlClient control(MakeExpertChannel(epo.targets[0]));
    TableNote(a);
    std::printf("%-7s %9s %10s %9s %12s %12s %15s %12s\n", "path", "step_ms", "tok/s", "%ceiling",
                "gpu_ms/step", "cpu_ms/step", "wait_ms/step", "graphs/step");
    for (const std::string& path : a.path_sweep) {
      ModelOptions so = mo;
      so.cuda.expert_slots = path != "copy";
      so.cuda.graphs = path == "device" || path == "host";
      so.cuda.slot_calls = path != "host" ? SlotCalls::kDeviceSends : SlotCalls::kHostNodes;
      ASSIGN_OR_RETURN(const SweepRow r, sweep_row(so, &control));
      const DecodeRun& run = r.run;
      const double n = static_cast<double>(a.decode_steps);
      const double step_ms = r.step_ms, tok_s = r.tok_s, gpu_ms = r.gpu_ms, cpu_ms = r.cpu_ms;
      const double wait_ms = static_cast<double>(run.d.expert_wait_ns) / n / 1e6;
      const double graphs = static_cast<double>(run.d.graph_launches) / n;
      std::printf("%-7s %9.2f %10.1f %8.1f%% %12.3f %12.3f %15.3f %12.2f\n", path.c_str(), step_ms,
                  tok_s, 100 * tok_s / ceiling, gpu_ms, cpu_ms, wait_ms, graphs);
      std::fflush(stdout);
      paths.push_back({{"path", path},
                       {"step_ms", step_ms},
                       {"tok_s", tok_s},
                       {"fraction_of_ceiling", tok_s / ceiling},
                       {"gpu_ms_per_step", gpu_ms},
                       {"cpu_ms_per_step", cpu_ms},
                       {"expert_wait_ms_per_step", wait_ms},
                       {"graph_launches_per_step", graphs},
                       {"stats_delta", StatsJson(run.d)}});
    }
  }

  // Hot experts: batch-1 decode per GPU budget, the placement planned from
  // the counts above; the ceiling with hot experts is the DRAM bandwidth
  // over the CPU-side bytes per token the run measured (the share of routed
  // selections the GPU served).
  ojson hot_rows = ojson::array();
  if (!a.hot_sweep.empty()) {
    ControlClient control(MakeExpertChannel(epo.targets[0]));
    const int64_t hot_expert_bytes = HotExpertBytes(config, fmt, copy_group);
    TableNote(a);
    std::printf("%-8s %8s %9s %8s %9s %10s %8s %12s %12s %12s %12s\n", "hot_gib", "experts",
                "planned", "on_gpu", "step_ms", "tok/s", "speedup", "ceiling_hot", "%ceiling_hot",
                "gpu_ms/step", "cpu_ms/step");
    double tok_s0 = -1;
    for (double gib : a.hot_sweep) {
      ModelOptions so = mo;
      Placement placed;
      if (gib > 0) {
        PlacementOptions plo;
        plo.budget_bytes = static_cast<int64_t>(gib * static_cast<double>(int64_t{1} << 30));
        plo.expert_bytes = hot_expert_bytes;
        ASSIGN_OR_RETURN(placed, PlanPlacement(calib, config, plo));
        so = with_gpu_copies(so);
        so.cuda.hot_experts = std::make_shared<const Placement>(placed);
      }
      const double tl = Now();
      ASSIGN_OR_RETURN(const SweepRow r, sweep_row(so, &control));
      const double row_s = Now() - tl;
      // What the GPU served in this model's passes (prefill of the decode
      // prompt, warm-up and timed steps: all slot passes).
      const RoutingTable used = model->routing_stats();
      double all = 0, on_gpu = 0;
      for (const RoutingTable::Layer& L : used.layers)
        for (size_t e = 0; e < L.tokens.size(); ++e) {
          all += static_cast<double>(L.tokens[e]);
          if (placed.is_hot(L.layer, static_cast<int32_t>(e)))
            on_gpu += static_cast<double>(L.tokens[e]);
        }
      const double share = all > 0 ? on_gpu / all : 0;
      const double cpu_bytes = (1 - share) * routed_bytes_per_token;
      const double ceiling_hot = cpu_bytes > 0 ? bw * 1e9 / cpu_bytes : 0;
      if (tok_s0 < 0) tok_s0 = r.tok_s;
      std::printf("%-8g %8lld %8.1f%% %7.1f%% %9.2f %10.1f %8s %12s %12s %12.3f %12.3f\n", gib,
                  static_cast<long long>(placed.num_hot), 100 * placed.hot_fraction, 100 * share,
                  r.step_ms, r.tok_s, absl::StrFormat("%.2fx", r.tok_s / tok_s0).c_str(),
                  Cell(ceiling_hot, ceiling_hot > 0, "%.1f").c_str(),
                  Cell(100 * r.tok_s / ceiling_hot, ceiling_hot > 0, "%.1f%%").c_str(), r.gpu_ms,
                  r.cpu_ms);
      std::fflush(stdout);
      hot_rows.push_back({{"budget_gib", gib},
                          {"hot_experts", placed.num_hot},
                          {"hot_bytes", placed.bytes},
                          {"planned_hot_fraction", placed.hot_fraction},
                          {"measured_hot_fraction", share},
                          {"cpu_bytes_per_token", cpu_bytes},
                          {"step_ms", r.step_ms},
                          {"tok_s", r.tok_s},
                          {"speedup_vs_first_row", r.tok_s / tok_s0},
                          {"ceiling_hot_tok_s", ceiling_hot},
                          {"fraction_of_ceiling_hot",
                           ceiling_hot > 0 ? ojson(r.tok_s / ceiling_hot) : ojson(nullptr)},
                          {"gpu_ms_per_step", r.gpu_ms},
                          {"cpu_ms_per_step", r.cpu_ms},
                          {"row_seconds", row_s},
                          {"stats_delta", StatsJson(r.run.d)}});
    }
    std::printf(
        "# hot experts: planned from the calibration's routing counts (%s per expert on the "
        "GPU); "
        "on_gpu: the share of routed selections the GPU served in the row's own passes\n",
        HumanBytes(hot_expert_bytes).c_str());
  }

  // Hybrid prefill: the longest prompt per policy; the bound of a perfect
  // split from the same run's cpu and stream rows.
  ojson prefill_rows = ojson::array();
  if (!a.prefill_sweep.empty()) {
    const int64_t P = a.prefill_sweep_prompt > 0 ? a.prefill_sweep_prompt : max_prompt;
    TableNote(a);
    std::printf("%-13s %8s %10s %10s %9s %22s %10s %15s %9s\n", "policy", "prompt", "ms", "tok/s",
                "speedup", "layers cpu/stream/split", "streamed", "ahead/used", "%bound");
    std::map<std::string, double> ms_of, wait_of, gpu_of;
    struct Row {
      std::string policy;
      double ms = 0, load_s = 0;
      ModelStats d;
    };
    std::vector<Row> rows;
    for (const std::string& policy : a.prefill_sweep) {
      ModelOptions so = with_gpu_copies(mo);
      const bool serial = absl::EndsWith(policy, "-serial");
      so.cuda.prefill_experts =
          *ParsePrefillExperts(serial ? policy.substr(0, policy.size() - 7) : policy);
      so.cuda.prefill_prefetch = !serial;
      so.cuda.prefill_stream_tokens = std::max<int64_t>(so.cuda.prefill_stream_tokens, P);
      const double tl = Now();
      RETURN_IF_ERROR(reload(so));
      Row r;
      r.policy = policy;
      r.load_s = Now() - tl;
      const std::vector<int32_t> tokens = RandomTokens(rng, P, vocab);
      // At least one warm-up: auto measures the service in its first pass.
      ASSIGN_OR_RETURN(const PrefillRun run,
                       time_prefill(tokens, std::max(1, a.warmup),
                                    absl::StrCat("prefill sweep (", policy, ")")));
      r.ms = run.ms;
      r.d = run.d;
      std::printf(
          "# prefill sweep: %s, %lld tokens: %.1f ms (load %.1f s); GPU %.1f ms, expert wait "
          "%.1f ms, layers cpu/stream/split %lld/%lld/%lld, experts ahead/used %lld/%lld\n",
          policy.c_str(), static_cast<long long>(P), r.ms, r.load_s,
          static_cast<double>(r.d.gpu_busy_ns) / a.reps / 1e6,
          static_cast<double>(r.d.expert_wait_ns) / a.reps / 1e6,
          static_cast<long long>(r.d.prefill_cpu_layers / a.reps),
          static_cast<long long>(r.d.prefill_stream_layers / a.reps),
          static_cast<long long>(r.d.prefill_split_layers / a.reps),
          static_cast<long long>(r.d.prefetched_experts / a.reps),
          static_cast<long long>(r.d.prefetch_used_experts / a.reps));
      std::fflush(stdout);
      ms_of[policy] = r.ms;
      wait_of[policy] = static_cast<double>(r.d.expert_wait_ns) / a.reps / 1e6;
      gpu_of[policy] = static_cast<double>(r.d.gpu_busy_ns) / a.reps / 1e6;
      rows.push_back(std::move(r));
    }
    // The bound per layer: the routed experts' work split perfectly between
    // the service (the cpu row's expert wait, A) and the stream (the stream
    // row's GPU time less the GPU's own work, S), plus that own work (G: the
    // cpu row's GPU time): G + A * S / (A + S); host-side copies are in
    // neither. The host form takes G = the cpu row less A (its host copies
    // included); the whole-pass form combines the two rows' totals.
    // The streamed side alone: the stream-serial row when swept (with the
    // upload ahead, the stream row's GPU time also hides part of G).
    const std::string srow = ms_of.count("stream-serial") ? "stream-serial" : "stream";
    const bool have_bound = ms_of.count("cpu") && ms_of.count(srow);
    double bound_ms = 0, host_ms = 0, strict_ms = 0;
    if (have_bound) {
      const double A = wait_of["cpu"], G = gpu_of["cpu"];
      const double S = std::max(1e-9, gpu_of[srow] - G);
      bound_ms = G + A * S / (A + S);
      const double Gh = std::max(0.0, ms_of["cpu"] - A);
      const double Sh = std::max(1e-9, ms_of[srow] - Gh);
      host_ms = Gh + A * Sh / (A + Sh);
      strict_ms = ms_of["cpu"] * ms_of[srow] / (ms_of["cpu"] + ms_of[srow]);
    }
    for (const Row& r : rows) {
      const double reps = static_cast<double>(a.reps);
      const double slots = static_cast<double>(P) * K * static_cast<double>(L_moe);
      std::printf(
          "%-13s %8lld %10.1f %10.1f %9s %22s %9.1f%% %15s %9s\n", r.policy.c_str(),
          static_cast<long long>(P), r.ms, static_cast<double>(P) / r.ms * 1e3,
          Cell(ms_of.count("cpu") ? ms_of["cpu"] / r.ms : 0, ms_of.count("cpu") > 0, "%.2fx")
              .c_str(),
          absl::StrFormat("%.0f/%.0f/%.0f", r.d.prefill_cpu_layers / reps,
                          r.d.prefill_stream_layers / reps, r.d.prefill_split_layers / reps)
              .c_str(),
          100 * static_cast<double>(r.d.streamed_slots) / reps / slots,
          absl::StrFormat("%.0f/%.0f", r.d.prefetched_experts / reps,
                          r.d.prefetch_used_experts / reps)
              .c_str(),
          Cell(100 * bound_ms / r.ms, have_bound, "%.1f%%").c_str());
      prefill_rows.push_back(
          {{"policy", r.policy},
           {"prompt", P},
           {"ms", r.ms},
           {"tok_s", static_cast<double>(P) / r.ms * 1e3},
           {"load_s", r.load_s},
           {"layers_cpu", r.d.prefill_cpu_layers / reps},
           {"layers_stream", r.d.prefill_stream_layers / reps},
           {"layers_split", r.d.prefill_split_layers / reps},
           {"streamed_slot_share", static_cast<double>(r.d.streamed_slots) / reps / slots},
           {"expert_wait_ms", static_cast<double>(r.d.expert_wait_ns) / reps / 1e6},
           {"prefetched_experts", r.d.prefetched_experts / reps},
           {"prefetch_used_experts", r.d.prefetch_used_experts / reps},
           {"bound_ms", have_bound ? ojson(bound_ms) : ojson(nullptr)},
           {"bound_stream_row", have_bound ? ojson(srow) : ojson(nullptr)},
           {"host_bound_ms", have_bound ? ojson(host_ms) : ojson(nullptr)},
           {"strict_bound_ms", have_bound ? ojson(strict_ms) : ojson(nullptr)},
           {"fraction_of_bound", have_bound ? ojson(bound_ms / r.ms) : ojson(nullptr)},
           {"stats_delta", StatsJson(r.d)}});
    }
    if (have_bound)
      std::printf(
          "# bound of a perfect split of the routed experts between the service and the "
          "stream: %.1f ms = %.1f tok/s (G + A*S/(A+S) from this run's cpu and %s rows: "
          "G the cpu row's GPU time, A its expert wait, S the %s row's GPU time less G; "
          "with G = the cpu row less A, host copies included: %.1f ms; whole passes "
          "combined: %.1f ms)\n",
          bound_ms, static_cast<double>(P) / bound_ms * 1e3, srow.c_str(), srow.c_str(), host_ms,
          strict_ms);
  }

  // Stop the service before writing, so its shutdown is part of the run.
  model.reset();
  experts.reset();
  pool.reset();
  service.Stop();

  if (!a.json.empty()) {
    ojson J;
    J["bench"] = "hmoe-bench-e2e";
    J["machine"] = {{"cpu", CpuModel()},
                    {"cores", std::thread::hardware_concurrency()},
                    {"service_threads", service_threads},
                    {"numa_nodes", numa_nodes},
                    {"llc_bytes", LlcBytes()},
                    {"memory_bytes", ram},
                    {"avx2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
                    {"avx512f", static_cast<bool>(__builtin_cpu_supports("avx512f"))}};
    J["preset"] = a.preset;
    J["model_type"] = config.model_type;
    J["shape"] = {{"hidden", H},
                  {"layers", layers},
                  {"real_layers", real_layers},
                  {"first_dense", first_dense},
                  {"moe_layers", L_moe},
                  {"experts", E},
                  {"top_k", K},
                  {"moe_intermediate", I},
                  {"shared_experts", config.moe.num_shared_experts},
                  {"vocab", vocab}};
    J["format"] = service_format;
    J["bytes_per_weight"] = bytes_per_weight;
    J["expert_bytes"] = expert_bytes;
    J["routed_bytes_per_token"] = routed_bytes_per_token;
    J["transport"] = a.transport;
    J["backend"] = backend;
    J["layers"] = layers;
    J["dram_read"] = {{"before_service", ProbeJson(bw_before)},
                      {"after_service", bw_after ? ProbeJson(*bw_after) : ojson(nullptr)}};
    J["bw_gbs"] = bw;
    J["bw_source"] = bw_source;
    J["ceiling_tok_s"] = ceiling;
    J["fraction_of_ceiling_b1"] = fraction_b1 >= 0 ? ojson(fraction_b1) : ojson(nullptr);
    J["prefill"] = prefill;
    J["decode"] = decode;
    J["defer_sweep"] = sweep;
    J["path_sweep"] = paths;
    J["routing_skew"] = skew;
    J["hot_sweep"] = hot_rows;
    J["prefill_sweep"] = prefill_rows;
    J["fit_check"] = a.alias_experts > 0;
    if (a.alias_experts > 0) J["fit_check_note"] = kFitCheck;
    J["options"] = {{"gpu_mem_gb", a.gpu_mem_gb},
                    {"kv_blocks", a.kv_blocks},
                    {"gpu_weights", std::string(DenseWeightsName(a.gpu_weights))},
                    {"kv_dtype", std::string(KvDtypeName(a.kv_dtype))},
                    {"defer_experts", a.defer_experts},
                    {"cuda_graphs", a.cuda_graphs},
                    {"cuda_expert_slots", a.cuda_expert_slots},
                    {"cuda_device_calls", a.cuda_device_calls},
                    {"service_cores", a.service_cores},
                    {"worker_cores", a.worker_cores},
                    {"threads", a.threads},
                    {"warmup", a.warmup},
                    {"reps", a.reps},
                    {"max_seq_len", max_seq},
                    {"service_max_tokens", a.service_max_tokens},
                    {"alias_experts", a.alias_experts},
                    {"work_dir", work_dir}};
    J["seconds"] = {{"checkpoint", ckpt_s},
                    {"checkpoint_written", wrote},
                    {"service_start", service_s},
                    {"model_load", load_s},
                    {"total", Now() - t_start}};
    std::ofstream out(a.json);
    out << J.dump(1) << "\n";
    if (!out) return absl::DataLossError(absl::StrCat(a.json, ": write failed"));
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Args args;
  FlagSet fs("hmoe-bench-e2e", "[flags]",
             "The worker's model in this process and hmoe-expert-service --synthetic as a child,\n"
             "end to end: prefill and decode tok/s against the CPU-expert decode ceiling\n"
             "measured in the same run (bench_e2e.cc's header). Exit 0 on success, 2 on a bad\n"
             "flag, 1 on any other failure.");
  AddFlags(fs, &args);
  if (std::optional<int> exit = fs.ParseOrExit(argc, argv)) return *exit;
  // SIGINT / SIGTERM go to a sigwait thread that stops the service and exits.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::thread([sigs] {
    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    std::fprintf(stderr, "hmoe-bench-e2e: signal %d: stopping the expert service\n", sig);
    StopChild(g_child.load());
    std::_Exit(128 + sig);
  }).detach();
  const absl::Status st = Run(args);
  if (!st.ok()) {
    std::fprintf(stderr, "hmoe-bench-e2e: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
