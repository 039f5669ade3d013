#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/small_file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace hmoe {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Finds the first duplicate key of the top-level object and of the objects
// it holds but __metadata__ (with `nested_key`: only of the one so named).
// A SAX pass: nlohmann's callback parser rescans the parent object after
// every nested object it keeps, which is quadratic in the tensor count.
class DuplicateKeyFinder : public nlohmann::json_sax<json> {
 public:
  explicit DuplicateKeyFinder(const std::string& nested_key) : nested_key_(nested_key) {}
  const std::string& duplicate() const { return duplicate_; }
  const std::string& error() const { return error_; }

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 2) nested_keys_.clear();
    return true;
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) {
      current_top_key_ = k;
      if (!top_keys_.insert(k).second && duplicate_.empty())
        duplicate_ = absl::StrCat("\"", k, "\"");
    } else if (depth_ == 2) {
      // (__metadata__ is a string map the reference reader takes as it comes.)
      const bool track = nested_key_.empty() ? current_top_key_ != "__metadata__"
                                             : current_top_key_ == nested_key_;
      if (track && !nested_keys_.insert(k).second && duplicate_.empty())
        duplicate_ = absl::StrCat("\"", k, "\" in \"", current_top_key_, "\"");
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error_ = e.what();
    return false;
  }

 private:
  const std::string nested_key_;
  int depth_ = 0;
  std::string current_top_key_;
  std::set<std::string> top_keys_;
  std::set<std::string> nested_keys_;
  std::string duplicate_;
  std::string error_;
};

// Parses `text` as JSON, refusing duplicate keys in the top-level object and
// in the objects it holds but __metadata__ (with `nested_key`: only in the
// one so named). Linear in the size of `text` (n log n in the key count).
// Never throws.
absl::StatusOr<json> ParseStrictJson(std::string_view text, const std::string& what,
                                     const std::string& nested_key = "") {
  DuplicateKeyFinder finder(nested_key);
  const bool parsed = json::sax_parse(text.begin(), text.end(), &finder,
                                      nlohmann::detail::input_format_t::json, /*strict=*/true);
  if (!parsed)
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid JSON: ", finder.error()));
  if (!finder.duplicate().empty())
    return absl::InvalidArgumentError(absl::StrCat(what, ": duplicate key ", finder.duplicate()));
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, ": invalid JSON"));
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(what, ": JSON is not an object"));
  return j;
}

// Reads a non-negative integer array from `v` into `out`.
bool ReadU64Array(const json& v, std::vector<uint64_t>& out) {
  if (!v.is_array()) return false;
  for (const auto& x : v) {
    if (!x.is_number_unsigned() && !(x.is_number_integer() && x.get<int64_t>() >= 0)) return false;
    out.push_back(x.get<uint64_t>());
  }
  return true;
}

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
};

}  // namespace

SafetensorsFile::~SafetensorsFile() = default;

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path, const SafetensorsOptions& options) {
  // O_NONBLOCK: a FIFO must not block the open; only a regular file is
  // mapped.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    if (err == ELOOP || err == ENXIO)
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": cannot open: ", std::strerror(err)));
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": file is ", file_size,
                                            " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  uint8_t len_bytes[8];
  if (::pread(fd, len_bytes, 8, 0) != 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": cannot read the header length"));
  }
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > options.max_header_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   options.max_header_bytes, " bytes"));
  }
  if (header_len > file_size - 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_len,
                                            " runs past the end of the file (", file_size,
                                            " bytes)"));
  }
  void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (addr == MAP_FAILED)
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": mmap failed: ", std::strerror(errno)));
  auto* mapping = new Mapping{addr, file_size};
  std::shared_ptr<const void> owner(mapping, [](const void* p) {
    auto* m = static_cast<const Mapping*>(p);
    ::munmap(m->addr, m->size);
    delete m;
  });

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->mapping_ = owner;
  const auto* base = static_cast<const uint8_t*>(addr);
  file->data_ = base + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  const std::string_view header(reinterpret_cast<const char*>(base + 8), header_len);
  ASSIGN_OR_RETURN(json j, ParseStrictJson(header, absl::StrCat(path, ": header")));

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__ value for \"", m.key(), "\" is not a string"));
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat(path, ": tensor \"", name, "\"");
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": entry must be an object with dtype, shape and data_offsets"));
    if (!v["dtype"].is_string())
      return absl::InvalidArgumentError(absl::StrCat(where, ": dtype is not a string"));
    const std::string dtype_name = v["dtype"].get<std::string>();
    auto dtype = ParseDType(dtype_name);
    if (!dtype)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown dtype \"", dtype_name, "\""));
    std::vector<uint64_t> shape_u, offsets;
    if (!ReadU64Array(v["shape"], shape_u))
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape is not an array of non-negative integers"));
    if (!ReadU64Array(v["data_offsets"], offsets) || offsets.size() != 2)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets is not a pair of non-negative integers"));
    TensorEntry e;
    e.name = name;
    e.dtype = *dtype;
    // Element and byte counts with overflow protection: a dimension, an
    // element count or a byte count past 2^62 cannot be real (a zero
    // dimension does not excuse a huge one).
    constexpr unsigned __int128 kLimit = static_cast<unsigned __int128>(1) << 62;
    unsigned __int128 numel = 1, bytes = 0;
    for (uint64_t d : shape_u) {
      numel *= d;
      if (d > kLimit || numel > kLimit)
        return absl::InvalidArgumentError(absl::StrCat(where, ": shape is impossibly large"));
      e.shape.push_back(static_cast<int64_t>(d));
    }
    bytes = (numel * static_cast<unsigned>(DTypeBits(e.dtype)) + 7) / 8;
    if (bytes > kLimit)
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape is impossibly large"));
    e.begin = offsets[0];
    e.end = offsets[1];
    if (e.begin > e.end)
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": data_offsets are out of order (begin ", e.begin, " > end ", e.end, ")"));
    if (e.end > data_size)
      return absl::DataLossError(absl::StrCat(where, ": data_offsets [", e.begin, ", ", e.end,
                                              ") lie outside the data region of ", data_size,
                                              " bytes"));
    const uint64_t want = static_cast<uint64_t>(bytes);
    if (e.end - e.begin != want)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape ", ShapeString(e.shape), " of ", dtype_name, " needs ", want,
                       " bytes but data_offsets span ", e.end - e.begin));
    file->entries_.push_back(std::move(e));
  }

  // Ranges must tile the data region exactly: no overlap, no gap, no tail.
  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : file->entries_) by_offset.push_back(&e);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const TensorEntry* a, const TensorEntry* b) {
                     return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
                   });
  uint64_t cursor = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry* e : by_offset) {
    if (e->begin < cursor)
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor \"", e->name, "\" bytes [", e->begin, ", ", e->end, ") overlap tensor \"",
          prev->name, "\" bytes [", prev->begin, ", ", prev->end, ")"));
    if (e->begin > cursor)
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor \"", e->name,
                                                     "\" starts at byte ", e->begin,
                                                     " leaving a gap after byte ", cursor));
    cursor = e->end;
    prev = e;
  }
  if (cursor != data_size)
    return absl::InvalidArgumentError(absl::StrCat(path, ": data region is ", data_size,
                                                   " bytes but its tensors cover ", cursor));
  for (size_t i = 0; i < file->entries_.size(); ++i) file->index_[file->entries_[i].name] = i;
  return file;
}

const TensorEntry* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

absl::StatusOr<Tensor> SafetensorsFile::Get(const std::string& name) const {
  const TensorEntry* e = Find(name);
  if (e == nullptr) return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  // Read-only mapping: callers must not write through the returned tensor.
  void* p = const_cast<uint8_t*>(data_ + e->begin);
  return Tensor(e->dtype, e->shape, p, mapping_);
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir,
                                                             const SafetensorsOptions& options) {
  auto ckpt = std::make_unique<Checkpoint>();
  ckpt->dir_ = dir;
  ckpt->on_get_ = options.on_get;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));

  auto add_file = [&](const std::string& path) -> absl::StatusOr<size_t> {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path, options));
    for (const auto& e : f->entries()) {
      auto it = ckpt->where_.find(e.name);
      if (it != ckpt->where_.end())
        return absl::InvalidArgumentError(absl::StrCat("tensor \"", e.name, "\" appears in both ",
                                                       ckpt->files_[it->second]->path(), " and ",
                                                       path));
      ckpt->where_[e.name] = ckpt->files_.size();
    }
    ckpt->files_.push_back(std::move(f));
    return ckpt->files_.size() - 1;
  };

  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  absl::StatusOr<std::string> index_text = ReadSmallFile(index_path, kMaxIndexJsonBytes);
  if (!index_text.ok() && !absl::IsNotFound(index_text.status())) return index_text.status();
  if (index_text.ok()) {
    const std::string& text = *index_text;
    ASSIGN_OR_RETURN(json j, ParseStrictJson(text, index_path, "weight_map"));
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": missing object \"weight_map\""));
    std::map<std::string, size_t> shard_index;
    std::vector<std::pair<std::string, std::string>> mapped;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for \"",
                                                       it.key(), "\" is not a file name"));
      const std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for \"",
                                                       it.key(), "\" names \"", shard,
                                                       "\", not a file in ", dir));
      mapped.emplace_back(it.key(), shard);
      if (shard_index.count(shard)) continue;
      const std::string shard_path = (fs::path(dir) / shard).string();
      if (!fs::exists(shard_path, ec))
        return absl::NotFoundError(absl::StrCat(index_path, ": shard ", shard_path,
                                                " (holding tensor \"", it.key(), "\") is missing"));
      ASSIGN_OR_RETURN(size_t idx, add_file(shard_path));
      shard_index[shard] = idx;
    }
    for (const auto& [name, shard] : mapped) {
      const auto& file = ckpt->files_[shard_index[shard]];
      if (file->Find(name) == nullptr)
        return absl::NotFoundError(absl::StrCat(index_path, ": maps tensor \"", name,
                                                "\" to shard ", file->path(),
                                                ", which does not contain it"));
    }
    return ckpt;
  }
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  if (fs::exists(single, ec)) {
    RETURN_IF_ERROR(add_file(single).status());
    return ckpt;
  }
  std::vector<std::string> paths;
  for (const auto& ent : fs::directory_iterator(dir, ec))
    if (ent.path().extension() == ".safetensors") paths.push_back(ent.path().string());
  if (paths.empty())
    return absl::NotFoundError(
        absl::StrCat(dir, ": no model.safetensors.index.json, model.safetensors or *.safetensors"));
  std::sort(paths.begin(), paths.end());
  for (const auto& p : paths) RETURN_IF_ERROR(add_file(p).status());
  return ckpt;
}

const TensorEntry* Checkpoint::Find(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : files_[it->second]->Find(name);
}

absl::StatusOr<Tensor> Checkpoint::Get(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    return absl::NotFoundError(absl::StrCat(dir_, ": checkpoint has no tensor \"", name, "\""));
  absl::StatusOr<Tensor> t = files_[it->second]->Get(name);
  if (t.ok() && on_get_) {
    if (const TensorEntry* e = files_[it->second]->Find(name)) on_get_(*e);
  }
  return t;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> out;
  for (const auto& [name, idx] : where_) out.push_back(name);
  return out;
}

absl::Status SafetensorsWriter::Add(const std::string& name, DType dtype, Shape shape,
                                    const void* bytes, size_t size) {
  if (name == "__metadata__" || name.empty())
    return absl::InvalidArgumentError(absl::StrCat("tensor name \"", name, "\" is reserved"));
  if (tensors_.count(name))
    return absl::AlreadyExistsError(absl::StrCat("tensor \"", name, "\" added twice"));
  if (dtype == DType::kI4)
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": I4 is not a safetensors dtype"));
  const auto want = static_cast<size_t>(DTypeBytes(dtype, NumElements(shape)));
  if (size != want)
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": shape ",
                                                   ShapeString(shape), " needs ", want,
                                                   " bytes, got ", size));
  Pending p{dtype, std::move(shape), {}};
  p.bytes.assign(static_cast<const uint8_t*>(bytes), static_cast<const uint8_t*>(bytes) + size);
  tensors_.emplace(name, std::move(p));
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Add(const std::string& name, const Tensor& t) {
  if (!t.contiguous())
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" is not contiguous"));
  return Add(name, t.dtype(), t.shape(), t.raw(), static_cast<size_t>(t.nbytes()));
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  std::vector<TensorSpec> plan;
  for (const auto& [name, p] : tensors_) plan.push_back({name, p.dtype, p.shape});
  const uint64_t header = SafetensorsStreamWriter::HeaderBytes(plan, metadata_);
  ASSIGN_OR_RETURN(auto w, SafetensorsStreamWriter::Create(path, std::move(plan), header));
  for (const auto& [k, v] : metadata_) w->SetMetadata(k, v);
  for (const auto& [name, p] : tensors_)
    RETURN_IF_ERROR(w->Append({name, p.dtype, p.shape}, p.bytes.data(), p.bytes.size()));
  return w->Finish();
}

namespace {

// The header JSON of `plan` at `offsets` (as SafetensorsFile reads it).
std::string HeaderText(const std::vector<TensorSpec>& plan, const std::vector<uint64_t>& offsets,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (size_t i = 0; i < plan.size(); ++i) {
    header[plan[i].name] = {{"dtype", std::string(DTypeName(plan[i].dtype))},
                            {"shape", plan[i].shape},
                            {"data_offsets", {offsets[i], offsets[i + 1]}}};
  }
  return header.dump();
}

std::vector<uint64_t> PlanOffsets(const std::vector<TensorSpec>& plan) {
  std::vector<uint64_t> offsets{0};
  for (const TensorSpec& t : plan)
    offsets.push_back(offsets.back() +
                      static_cast<uint64_t>(DTypeBytes(t.dtype, NumElements(t.shape))));
  return offsets;
}

}  // namespace

uint64_t SafetensorsStreamWriter::HeaderBytes(const std::vector<TensorSpec>& plan,
                                              const std::map<std::string, std::string>& metadata) {
  return HeaderText(plan, PlanOffsets(plan), metadata).size();
}

absl::StatusOr<std::unique_ptr<SafetensorsStreamWriter>> SafetensorsStreamWriter::Create(
    const std::string& path, std::vector<TensorSpec> plan, uint64_t header_reserve) {
  std::set<std::string> names;
  for (const TensorSpec& t : plan) {
    if (t.name == "__metadata__" || t.name.empty())
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor name \"", t.name, "\" is reserved"));
    if (!names.insert(t.name).second)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", t.name, "\" is planned twice"));
    if (t.dtype == DType::kI4)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", t.name, "\": I4 is not a safetensors dtype"));
    for (int64_t d : t.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor \"", t.name, "\" has shape ", ShapeString(t.shape)));
    }
  }
  std::unique_ptr<SafetensorsStreamWriter> w(new SafetensorsStreamWriter());
  w->path_ = path;
  w->offsets_ = PlanOffsets(plan);
  w->plan_ = std::move(plan);
  w->reserve_ = (header_reserve + 7) / 8 * 8;
  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0)
    return absl::PermissionDeniedError(
        absl::StrCat(path, ": cannot open for writing: ", std::strerror(errno)));
  struct stat st;
  w->regular_ = ::fstat(w->fd_, &st) == 0 && S_ISREG(st.st_mode);
  return w;
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && regular_) ::unlink(path_.c_str());
}

std::string SafetensorsStreamWriter::next() const {
  return next_ < plan_.size() ? plan_[next_].name : std::string();
}

absl::Status SafetensorsStreamWriter::WriteAt(uint64_t offset, const void* bytes, size_t size) {
  const auto* p = static_cast<const uint8_t*>(bytes);
  while (size > 0) {
    const ssize_t n =
        ::pwrite(fd_, p, std::min<size_t>(size, size_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      failed_ = true;
      return absl::DataLossError(absl::StrCat(path_, ": write failed at byte ", offset, ": ",
                                              n < 0 ? std::strerror(errno) : "no progress"));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Append(const TensorSpec& t, const void* bytes, size_t size) {
  const std::string& name = t.name;
  if (finished_ || failed_)
    return absl::FailedPreconditionError(absl::StrCat(path_, ": Append of \"", name, "\" after ",
                                                      finished_ ? "Finish" : "a failed write"));
  if (next_ >= plan_.size() || plan_[next_].name != name)
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor \"", name, "\" appended out of plan order (next is ",
                     next_ < plan_.size() ? absl::StrCat("\"", plan_[next_].name, "\"")
                                          : std::string("none: all were written"),
                     ")"));
  const TensorSpec& planned = plan_[next_];
  if (t.dtype != planned.dtype || t.shape != planned.shape)
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor \"", name, "\" appended as ",
                                                   DTypeName(t.dtype), " ", ShapeString(t.shape),
                                                   ", planned as ", DTypeName(planned.dtype), " ",
                                                   ShapeString(planned.shape)));
  const uint64_t want = offsets_[next_ + 1] - offsets_[next_];
  if (size != want)
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor \"", name, "\": shape ", ShapeString(plan_[next_].shape),
                     " of ", DTypeName(plan_[next_].dtype), " needs ", want, " bytes, got ", size));
  RETURN_IF_ERROR(WriteAt(8 + reserve_ + offsets_[next_], bytes, size));
  ++next_;
  return absl::OkStatus();
}

absl::Status SafetensorsStreamWriter::Finish() {
  if (finished_ || failed_)
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": Finish after ", finished_ ? "Finish" : "a failed write"));
  if (next_ < plan_.size())
    return absl::FailedPreconditionError(absl::StrCat(path_, ": Finish with ", plan_.size() - next_,
                                                      " planned tensor(s) unwritten, the first \"",
                                                      plan_[next_].name, "\""));
  std::string text = HeaderText(plan_, offsets_, metadata_);
  if (text.size() > reserve_)
    return absl::OutOfRangeError(absl::StrCat(path_, ": the header needs ", text.size(),
                                              " bytes, more than the ", reserve_, " reserved"));
  text.append(reserve_ - text.size(), ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(reserve_ >> (8 * i));
  RETURN_IF_ERROR(WriteAt(0, len, 8));
  RETURN_IF_ERROR(WriteAt(8, text.data(), text.size()));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    failed_ = true;
    return absl::DataLossError(absl::StrCat(path_, ": close failed: ", std::strerror(errno)));
  }
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace hmoe
