// Packed expert files: what `hmoe convert` writes and the service loads
// without re-quantizing. One safetensors file per shard (mmap-ready, 8-byte
// aligned tensors), named experts-<split>-<i>of<n>.safetensors, holding for
// every MoE layer L and owned expert E the shard's slice quantized exactly as
// QuantizeExpert (common/experts/quantize.h) quantizes it (so loading one
// gives the same packed weights, bit for bit, as quantizing at load):
//   "L.E.gate.q", "L.E.up.q"  [I_slice][H]  int8 | bf16 | int4 as U8 [rows][ceil(cols/2)]
//   "L.E.down.q"              [H][I_slice]  (two values per byte, low nibble first)
//   "L.E.<proj>.s"            f32 scales of the slice: int8 [rows][1],
//                             int4 [rows][ceil(cols/group)]; none for bf16.
// Header metadata: hmoe_packed_version, format, model_type, hidden, intermediate,
// num_experts, layers, shard, num_shards, split, i_begin, i_end, expert_begin,
// expert_end and "checksums" (FNV-1a 64 of every tensor's bytes, JSON).
// A file that does not match the model, is truncated or fails a checksum is
// refused with an error naming the file and the field or tensor.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/experts/checkpoint_source.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/transport/moe_call.h"
#include "common/weight_map.h"

namespace hmoe {

std::string PackedFileName(SplitMode split, int shard, int num_shards);

class PackedExperts {
 public:
  // Opens dir/PackedFileName(split, shard, num_shards) and checks it against `cfg`.
  static absl::StatusOr<std::unique_ptr<PackedExperts>> Open(const std::string& dir,
                                                             const ModelConfig& cfg,
                                                             SplitMode split, int shard,
                                                             int num_shards);
  WeightFormat format() const { return format_; }
  int group() const { return group_; }
  int64_t i_begin() const { return i_begin_; }
  int64_t i_end() const { return i_end_; }
  int64_t expert_begin() const { return e_begin_; }
  int64_t expert_end() const { return e_end_; }
  // Identifies the conversion's weights: the same in every shard file of one
  // `hmoe convert` run (a hash of all shards' checksums and the layout), so
  // the worker can refuse shards packed from different checkpoints. Empty in
  // files written before it existed.
  const std::string& conversion_id() const { return conversion_id_; }
  // RoutedExpertsFingerprint of the checkpoint converted; empty in files
  // written before it was recorded.
  const std::string& source_fingerprint() const { return source_fingerprint_; }
  // Expert `e` (global id, owned by the file) of `layer`: the shard's slice,
  // checksummed and shape-checked.
  absl::StatusOr<QuantExpert> Expert(int layer, int64_t e) const;

 private:
  std::string path_;
  std::unique_ptr<SafetensorsFile> file_;
  std::map<std::string, std::string> sums_;
  std::string conversion_id_;
  std::string source_fingerprint_;
  WeightFormat format_ = WeightFormat::kBf16;
  int group_ = 64;
  int64_t hidden_ = 0, i_begin_ = 0, i_end_ = 0, e_begin_ = 0, e_end_ = 0;
};

struct ConvertOptions {
  // The files' weight format ("int4g64", "mxfp4", ...); empty: the
  // checkpoint's own (DefaultConvertFormat).
  std::string format;
  int shards = 1;
  SplitMode split = SplitMode::kTp;
  int threads = 0;  // experts quantized at once; 0: the CPUs this process may use (<= 64)
  // Called after each MoE layer is written (on the calling thread): its
  // decoder layer index, MoE layers done so far and in all.
  std::function<void(int layer, int done, int total)> progress;
  // Asked between batches of experts; true stops the conversion (CANCELLED,
  // no .tmp left): `hmoe convert` on SIGINT / SIGTERM.
  std::function<bool()> cancelled;
};
// Reads MODEL_DIR (bf16/fp8), quantizes, writes one packed file per shard into
// out_dir. Streams: each expert is written as soon as it is quantized, so
// memory holds `threads` experts (each as f32 while it is quantized: ~16 bytes
// per weight), not the model. The files are the same for any `threads`.
// Files are written as <name>.tmp, flushed to disk (fsync) and renamed once
// every shard's file is complete, then the directory is synced: a crash or
// power loss leaves the previous conversion's files or the new ones, never
// empty files under the final names. On failure no .tmp is left.
absl::Status ConvertModel(const std::string& model_dir, const std::string& out_dir,
                          const ConvertOptions& opts);

// The format `hmoe convert` writes without --format: the one the checkpoint
// stores its routed experts in when the service reads it natively (mxfp4,
// int4bf16g32, fp8, mxfp8: kept as stored, no second rounding), else
// int4g64. `dir` names the checkpoint in errors.
absl::StatusOr<std::string> DefaultConvertFormat(const ModelConfig& cfg, const std::string& dir);

uint64_t Fnv1a64(const void* data, size_t n);

// The options of shard `shard`/`num_shards` of a model.
PackOptions ShardPackOptions(int64_t intermediate, int64_t num_experts, SplitMode split, int shard,
                             int num_shards, WeightFormat format, int group);

}  // namespace hmoe
