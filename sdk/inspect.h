// `hmoe inspect MODEL_DIR`: what a model is, what it costs, and whether a box
// can run it: architecture, layer kinds, parameter counts (total, active per
// token, routed experts), routed-expert bytes per format, the decode
// ceiling for a DRAM bandwidth: tok/s <= BW / (L_moe * k * 3 * H * I * bytes/weight),
// and with a GPU memory bound the worker's memory plan (gpu_worker/memory_plan.h).
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/weight_map.h"
#include "gpu_worker/memory_plan.h"

namespace hmoe {

struct InspectOptions {
  double dram_gbps = 100.0;   // CPU DRAM read bandwidth for the decode ceiling
  bool check_weights = true;  // open the checkpoint (if any) and check the weight map
  bool json = false;          // machine-readable output
  // With plan.gpu_mem_gb > 0: the CUDA worker's GPU memory plan for it.
  PlanRequest plan;
};

// Storage formats for routed experts and their bytes per weight, scales
// included. K is the reduction length of the matrix (H for gate/up, I for down).
// The formats checkpoints ship: mxfp4, int4bf16g32 (compressed-tensors
// int4), fp8 (128x128 blocks), mxfp8.
enum class ExpertFormat { kBf16, kInt8, kInt4G64, kMxfp4, kInt4Bf16G32, kFp8, kMxfp8 };
inline constexpr int kNumExpertFormats = 7;
const char* ExpertFormatName(ExpertFormat f);
// bf16: 2; int8: 1 + 4/K (f32 scale per output row); int4g64: 0.5 + 4/64 (f32
// scale per 64); mxfp4: 0.5 + 1/32 (e8m0 per 32); int4bf16g32: 0.5 + 2/32;
// fp8: 1 + 4/128^2 (f32 per 128x128 block); mxfp8: 1 + 1/32.
double ExpertBytesPerWeight(ExpertFormat f, int64_t k);

struct ModelReport {
  ModelConfig config;
  ParamCounts params;
  int64_t moe_layers = 0;
  double routed_bytes[kNumExpertFormats] = {};        // all routed experts, per ExpertFormat
  double bytes_per_token[kNumExpertFormats] = {};     // routed weights read per decoded token
  double decode_ceiling_tps[kNumExpertFormats] = {};  // at options.dram_gbps
  // The format the config's quantization stores routed experts in, as
  // `hmoe convert` keeps it by default ("" unquantized; "fp8 (dequantized)"
  // for blocks the service does not read natively), and its row above (-1: none).
  std::string expert_format;
  int expert_format_row = -1;
  // Checkpoint, when MODEL_DIR holds one.
  bool has_checkpoint = false;
  int64_t checkpoint_files = 0;
  int64_t checkpoint_tensors = 0;
  double checkpoint_bytes = 0;
  std::string weight_check;        // "ok" or the CheckWeights error
  std::optional<MemoryPlan> plan;  // InspectOptions::plan's, when asked for
};

absl::StatusOr<ModelReport> InspectModel(const std::string& model_dir,
                                         const InspectOptions& options);
std::string FormatReport(const ModelReport& report, const InspectOptions& options);

}  // namespace hmoe
