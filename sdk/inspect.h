// `hmoe inspect MODEL_DIR`: what a model is, what it costs, and whether a box
// can run it: architecture, layer kinds, parameter counts (total, active per
// token, routed experts), routed-expert bytes per format, and the decode
// ceiling for a DRAM bandwidth: tok/s <= BW / (L_moe * k * 3 * H * I * bytes/weight).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/weight_map.h"

namespace hmoe {

struct InspectOptions {
  double dram_gbps = 100.0;   // CPU DRAM read bandwidth for the decode ceiling
  bool check_weights = true;  // open the checkpoint (if any) and check the weight map
  bool json = false;          // machine-readable output
};

// Storage formats for routed experts and their bytes per weight, scales
// included. K is the reduction length of the matrix (H for gate/up, I for down).
enum class ExpertFormat { kBf16, kInt8, kInt4G64 };
const char* ExpertFormatName(ExpertFormat f);
// bf16: 2; int8: 1 + 4/K (f32 scale per output row); int4g64: 0.5 + 4/64 (f32 scale per 64).
double ExpertBytesPerWeight(ExpertFormat f, int64_t k);

struct ModelReport {
  ModelConfig config;
  ParamCounts params;
  int64_t moe_layers = 0;
  double routed_bytes[3] = {0, 0, 0};        // all routed experts, per ExpertFormat
  double bytes_per_token[3] = {0, 0, 0};     // routed weights read per decoded token
  double decode_ceiling_tps[3] = {0, 0, 0};  // at options.dram_gbps
  // Checkpoint, when MODEL_DIR holds one.
  bool has_checkpoint = false;
  int64_t checkpoint_files = 0;
  int64_t checkpoint_tensors = 0;
  double checkpoint_bytes = 0;
  std::string weight_check;  // "ok" or the CheckWeights error
};

absl::StatusOr<ModelReport> InspectModel(const std::string& model_dir,
                                         const InspectOptions& options);
std::string FormatReport(const ModelReport& report, const InspectOptions& options);

}  // namespace hmoe
