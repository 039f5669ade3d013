// One expert-service shard: its routed experts (loaded from a checkpoint, our
// packed files, or generated), quantized to the serving format, and the
// validated MoE call on them. No gRPC here: the front ends (gRPC stream,
// shared memory, UCX) all call ExpertShard::Handle.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/moe_call.h"

namespace hmoe {

// Weight formats the shard serves in. Weights are quantized once at load
// (from bf16/f32/fp8), or loaded already quantized from `hmoe convert` output.
enum class ServeFormat { kBf16, kInt8, kInt4 };

struct ShardOptions {
  std::string model_dir;   // Hugging Face checkpoint (bf16/f32/fp8 safetensors)
  std::string packed_dir;  // or: `hmoe convert` output (then model_dir gives config.json)
  // or: random weights "hidden=H,intermediate=I,experts=E,top_k=K,layers=L[,seed=S]"
  std::string synthetic;
  int shard_index = 0;
  int num_shards = 1;
  SplitMode split = SplitMode::kTp;
  ServeFormat format = ServeFormat::kBf16;
  int group = 64;            // int4 group along K
  int64_t max_tokens = 256;  // capacity of one request (sizes shm slots too)
  // Benchmark seam: validate every call but answer zeros without computing,
  // so that transport overhead can be measured apart from the experts.
  bool null_compute = false;

  absl::Status Validate() const;
  std::string ToString() const;
};

absl::StatusOr<ServeFormat> ParseServeFormat(const std::string& s,
                                             int* group);  // bf16|int8|int4g64..
std::string ServeFormatName(ServeFormat f, int group);

// The plain scalar MoE on dequantized weights: the reference every path is
// compared with. Weights are the quantized values (w = q * s) kept in f32;
// h = bf16(SiLU(g) * u) as in the kernels' BF16 definition.
struct ExpertSlice {
  std::vector<float> gate, up;  // [I_slice][H]
  std::vector<float> down;      // [H][I_slice]
};

class MoeCompute {
 public:
  virtual ~MoeCompute() = default;
  // out [tokens][hidden] f32, overwritten.
  virtual absl::Status Run(int layer_slot, const MoeCall& call, float* out) = 0;
};

class ExpertShard : public MoeHandler {
 public:
  struct LoadProgress {
    std::atomic<int64_t> layers_loaded{0};
    std::atomic<int64_t> layers_total{0};
    std::atomic<int64_t> weight_bytes{0};
  };

  static absl::StatusOr<std::unique_ptr<ExpertShard>> Load(const ShardOptions& opts,
                                                           LoadProgress* progress = nullptr);

  const ShardInfo& info() const override { return info_; }
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* compute_ns) override;

  // New calls fail UNAVAILABLE ("draining"); in-flight ones finish.
  void SetDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }

  struct Counters {
    std::atomic<uint64_t> requests{0}, failed{0}, invalid{0}, tokens{0}, compute_ns{0},
        in_flight{0};
  };
  const Counters& counters() const { return counters_; }
  int64_t weight_bytes() const { return weight_bytes_; }

  // The experts of one layer, [local expert] (for tests and convert).
  const std::vector<ExpertSlice>& layer_experts(int layer_slot) const {
    return layers_[static_cast<size_t>(layer_slot)];
  }

 private:
  ExpertShard() = default;
  absl::Status Compute(int slot, const MoeCall& call, float* out);

  ShardInfo info_;
  ServeFormat format_ = ServeFormat::kBf16;
  bool null_compute_ = false;
  std::vector<int> slot_of_layer_;                // layer -> slot or -1
  std::vector<std::vector<ExpertSlice>> layers_;  // [slot][local expert]
  int64_t weight_bytes_ = 0;
  std::mutex compute_mu_;
  std::atomic<bool> draining_{false};
  Counters counters_;
};

// Quantizes a full expert matrix [rows][cols] in place to the serving format
// (values replaced by q * scale): int8 per row, int4 per group of `group` along
// cols (a last partial group is its own group), bf16 by rounding.
void QuantizeInPlace(ServeFormat f, int group, int64_t rows, int64_t cols, float* w);

}  // namespace hmoe
