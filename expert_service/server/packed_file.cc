#include "expert_service/server/packed_file.h"

#include "absl/strings/str_cat.h"

namespace hmoe {

std::string PackedFileName(SplitMode split, int shard, int num_shards) {
  return absl::StrCat("experts-", SplitModeName(split), "-", shard, "of", num_shards,
                      ".safetensors");
}

uint64_t Fnv1a64(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

absl::StatusOr<std::unique_ptr<PackedExperts>> PackedExperts::Open(const std::string& dir,
                                                                   const ModelConfig&) {
  return absl::UnimplementedError(absl::StrCat(dir, ": packed files not supported yet"));
}

absl::StatusOr<ExpertSlice> PackedExperts::Expert(int, int, int64_t, int64_t) const {
  return absl::UnimplementedError("packed files not supported yet");
}

absl::Status ConvertModel(const std::string&, const std::string&, const ConvertOptions&) {
  return absl::UnimplementedError("convert not supported yet");
}

}  // namespace hmoe
