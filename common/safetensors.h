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
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tensor.h"

namespace hmoe {

struct TensorEntry;

struct SafetensorsOptions {
  // Headers larger than this are refused before they are read (the format's
  // own reference implementation uses 100 MB).
  uint64_t max_header_bytes = 100ull << 20;
  // Checkpoint::Get calls it with each tensor it returns, from the calling
  // thread (load progress counts a loader's bytes so); unset: nothing.
  std::function<void(const TensorEntry&)> on_get;
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
  std::function<void(const TensorEntry&)> on_get_;
};

// One tensor of a planned file: what SafetensorsStreamWriter writes in order.
struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
};

// Writes one .safetensors file tensor by tensor, holding none of them: the
// plan (names, dtypes, shapes) fixes every data offset up front (data in plan
// order, contiguous), each Append writes its bytes at once, and Finish writes
// the header into room reserved before the data, padded with spaces. Metadata
// may be set until Finish, so it can describe the data (checksums); the
// header must fit `header_reserve` bytes: HeaderBytes(plan, metadata) with
// every metadata value at its longest. Errors name the file and the tensor:
//   INVALID_ARGUMENT     bad or duplicate plan names; Append out of plan order
//                        or with the wrong byte count
//   FAILED_PRECONDITION  Finish before every planned tensor was appended, or
//                        any call after Finish or after a failed write
//   OUT_OF_RANGE         the header outgrew header_reserve
//   PERMISSION_DENIED    the file cannot be created
//   DATA_LOSS            a write failed (e.g. the disk is full)
// A writer destroyed before a successful Finish removes its file (if it is a
// regular file).
class SafetensorsStreamWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsStreamWriter>> Create(
      const std::string& path, std::vector<TensorSpec> plan, uint64_t header_reserve);
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // The header's length in bytes, unpadded, for `plan` and `metadata`.
  static uint64_t HeaderBytes(const std::vector<TensorSpec>& plan,
                              const std::map<std::string, std::string>& metadata);

  const std::string& path() const { return path_; }
  // The name of the next tensor Append expects ("" once all are written).
  std::string next() const;
  // Writes the next planned tensor: `t` must equal its plan entry and `size`
  // its shape x dtype bytes.
  absl::Status Append(const TensorSpec& t, const void* bytes, size_t size);
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Writes the header and closes the file (data flushed to the OS, not fsynced).
  absl::Status Finish();

 private:
  SafetensorsStreamWriter() = default;
  absl::Status WriteAt(uint64_t offset, const void* bytes, size_t size);
  std::string path_;
  int fd_ = -1;
  std::vector<TensorSpec> plan_;
  std::vector<uint64_t> offsets_;  // data offset of plan_[i]; offsets_.back() = data size
  size_t next_ = 0;
  uint64_t reserve_ = 0;  // header bytes (a multiple of 8) before the data
  bool finished_ = false, failed_ = false;
  bool regular_ = false;  // a regular file (only those are removed when unfinished)
  std::map<std::string, std::string> metadata_;
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
