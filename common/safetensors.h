// Safetensors: a strict mmap reader for one file and for sharded checkpoints
// (model.safetensors.index.json), and a writer.
//
// File layout: u64 little-endian header length N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data region; offsets are relative to the data region.
//
// Every failure names the file (and the tensor where there is one):
//   NOT_FOUND         file, shard or tensor missing
//   DATA_LOSS         file shorter than its header claims; offsets past the data region
//   INVALID_ARGUMENT  header over the size limit, bad JSON, unknown dtype,
//                     shape x dtype != byte range, begin > end, overlapping or
//                     non-contiguous ranges, duplicate names, bad index file
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace hmoe {

struct SafetensorsOptions {
  // Headers larger than this are refused before they are read (the format's
  // own reference implementation uses 100 MB).
  uint64_t max_header_bytes = 100ull << 20;
};

struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // byte offsets within the data region
  uint64_t end = 0;
};

// One memory-mapped .safetensors file. Tensors returned by Get() share
// ownership of the mapping, so they stay valid after the file object is gone.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path, const SafetensorsOptions& options = {});
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorEntry* Find(const std::string& name) const;
  absl::StatusOr<Tensor> Get(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::shared_ptr<const void> mapping_;
  const uint8_t* data_ = nullptr;  // start of the data region
  std::vector<TensorEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors.index.json with its shards, or a
// single model.safetensors, or (no index) every *.safetensors in the directory.
// Tensor names must be unique across shards.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir,
                                                          const SafetensorsOptions& options = {});

  const std::string& dir() const { return dir_; }
  bool Has(const std::string& name) const { return where_.count(name) > 0; }
  const TensorEntry* Find(const std::string& name) const;
  absl::StatusOr<Tensor> Get(const std::string& name) const;
  std::vector<std::string> Names() const;  // sorted
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
};

// Collects tensors and writes one .safetensors file (tensors sorted by name,
// contiguous, header padded with spaces to a multiple of 8 bytes).
class SafetensorsWriter {
 public:
  // Copies `bytes` (must equal DTypeBytes(dtype, numel(shape))).
  absl::Status Add(const std::string& name, DType dtype, Shape shape, const void* bytes,
                   size_t size);
  absl::Status Add(const std::string& name, const Tensor& t);  // contiguous tensors only
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  absl::Status Write(const std::string& path) const;

 private:
  struct Pending {
    DType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace hmoe
