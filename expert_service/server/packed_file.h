// Packed expert files: what `hmoe convert` writes and the service loads
// without re-quantizing. One safetensors file per shard (mmap-ready, 8-byte
// aligned tensors), named experts-<split>-<i>of<n>.safetensors, holding for
// every MoE layer L and owned expert E the shard's slice:
//   "L.E.gate.q", "L.E.up.q"  [I_slice][H]   int8 (int4 values in [-8, 7] packed
//   "L.E.down.q"              [H][I_slice]    two per byte, low nibble first, as U8
//   [rows][ceil(cols/2)]) "L.E.<proj>.s"            f32 scales: int8 [rows] (per row of the whole
//   matrix);
//                             int4 [rows][groups] for the absolute groups (col / group)
//                             the slice touches; bf16 weights have ".q" as BF16 and no ".s".
// Header metadata: hmoe_packed_version, format, model_type, hidden, intermediate,
// num_experts, layers, shard, num_shards, split, i_begin, i_end, expert_begin,
// expert_end and "checksums" (FNV-1a 64 of every tensor's bytes, JSON).
// A file that does not match the model, is truncated or fails a checksum is
// refused with an error naming the file and the field or tensor.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "expert_service/server/expert_shard.h"

namespace hmoe {

std::string PackedFileName(SplitMode split, int shard, int num_shards);

class PackedExperts {
 public:
  // Opens dir/PackedFileName(split, shard, num_shards) and checks it against `cfg`.
  static absl::StatusOr<std::unique_ptr<PackedExperts>> Open(const std::string& dir,
                                                             const ModelConfig& cfg,
                                                             SplitMode split, int shard,
                                                             int num_shards);
  ServeFormat format() const { return format_; }
  int group() const { return group_; }
  // Expert `e` of `layer`, intermediate slice [i0, i1): must be inside the file's part.
  absl::StatusOr<ExpertSlice> Expert(int layer, int e, int64_t i0, int64_t i1) const;

 private:
  std::string path_;
  std::unique_ptr<SafetensorsFile> file_;
  std::map<std::string, std::string> sums_;
  int64_t cfg_cols_down_ =
      0;  // the model's intermediate size (int8 scales of down are per whole row)
  ServeFormat format_ = ServeFormat::kBf16;
  int group_ = 64;
  int64_t hidden_ = 0, i_begin_ = 0, i_end_ = 0, e_begin_ = 0, e_end_ = 0;
};

struct ConvertOptions {
  std::string format = "int4g64";
  int shards = 1;
  SplitMode split = SplitMode::kTp;
};
// Reads MODEL_DIR (bf16/fp8), quantizes, writes one packed file per shard into out_dir.
absl::Status ConvertModel(const std::string& model_dir, const std::string& out_dir,
                          const ConvertOptions& opts);

uint64_t Fnv1a64(const void* data, size_t n);

// A routed expert's projection [rows][cols] as f32 (bf16/f16/f32 converted,
// fp8 dequantized with its block scale_inv); shape checked.
absl::StatusOr<std::vector<float>> LoadExpertMatrix(const Checkpoint& ckpt, const ModelConfig& cfg,
                                                    int layer, int expert, ExpertProj proj,
                                                    int64_t rows, int64_t cols);

}  // namespace hmoe
