#include "common/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Writes a safetensors file from a raw header string and `data_bytes` of data.
void WriteRaw(const std::string& path, const std::string& header, size_t data_bytes,
              uint64_t claimed_len = UINT64_MAX) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = claimed_len == UINT64_MAX ? header.size() : claimed_len;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header;
  for (size_t i = 0; i < data_bytes; ++i) out.put(static_cast<char>(i));
}

std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  uint64_t b, uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
}

class SafetensorsTest : public ::testing::Test {
 protected:
  testing::TempDir dir_;
  std::string path_ = dir_.file("m.safetensors");

  absl::Status OpenRaw(const std::string& header, size_t data, uint64_t claimed = UINT64_MAX) {
    WriteRaw(path_, header, data, claimed);
    return SafetensorsFile::Open(path_).status();
  }
};

TEST_F(SafetensorsTest, WriterReaderRoundTrip) {
  SafetensorsWriter w;
  std::vector<uint16_t> bf(6);
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = F32ToBf16(static_cast<float>(i) * 0.5f);
  std::vector<float> f = {1.5f, -2.0f};
  std::vector<uint8_t> f8 = {0x38, 0x40, 0xb8};
  ASSERT_TRUE(w.Add("b.weight", DType::kBF16, {2, 3}, bf.data(), bf.size() * 2).ok());
  ASSERT_TRUE(w.Add("a.bias", DType::kF32, {2}, f.data(), f.size() * 4).ok());
  ASSERT_TRUE(w.Add("c.fp8", DType::kF8E4M3, {3}, f8.data(), f8.size()).ok());
  ASSERT_TRUE(w.Add("empty", DType::kF32, {0, 4}, nullptr, 0).ok());
  EXPECT_EQ(w.Add("a.bias", DType::kF32, {2}, f.data(), 8).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(w.Add("bad", DType::kF32, {3}, f.data(), 8).code(), absl::StatusCode::kInvalidArgument);
  w.SetMetadata("format", "pt");
  ASSERT_TRUE(w.Write(path_).ok());

  auto file = SafetensorsFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->entries().size(), 4u);
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  auto t = (*file)->Get("b.weight");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->dtype(), DType::kBF16);
  EXPECT_EQ(t->shape(), (Shape{2, 3}));
  EXPECT_THAT(t->ToF32(), ::testing::ElementsAre(0, 0.5f, 1, 1.5f, 2, 2.5f));
  EXPECT_THAT((*file)->Get("c.fp8")->ToF32(), ::testing::ElementsAre(1.0f, 2.0f, -1.0f));
  EXPECT_THAT((*file)->Get("a.bias")->ToF32(), ::testing::ElementsAre(1.5f, -2.0f));
  auto missing = (*file)->Get("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), AllOf(HasSubstr(path_), HasSubstr("nope")));
  // Tensors outlive the file object (they share the mapping).
  Tensor keep = *t;
  file->reset();
  EXPECT_EQ(keep.ToF32()[5], 2.5f);
}

TEST_F(SafetensorsTest, MissingFile) {
  auto s = SafetensorsFile::Open(dir_.file("absent.safetensors")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("absent.safetensors"));
}

TEST_F(SafetensorsTest, ShorterThanLengthField) {
  std::ofstream(path_, std::ios::binary) << "abc";
  auto s = SafetensorsFile::Open(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("8-byte header length")));
}

TEST_F(SafetensorsTest, HeaderOverLimit) {
  auto s = OpenRaw("{}", 0, 200ull << 20);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("exceeds the limit")));
  // A smaller configured limit applies too.
  WriteRaw(path_, "{" + Entry("x", "F32", "[1]", 0, 4) + "}", 4);
  SafetensorsOptions opt;
  opt.max_header_bytes = 10;
  EXPECT_EQ(SafetensorsFile::Open(path_, opt).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, HeaderPastEndOfFile) {
  auto s = OpenRaw("{}", 0, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("runs past the end")));
}

TEST_F(SafetensorsTest, InvalidJson) {
  auto s = OpenRaw("{\"x\": {\"dtype\": ", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("invalid JSON")));
  s = OpenRaw("[1, 2]", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not an object"));
}

TEST_F(SafetensorsTest, UnknownDtype) {
  auto s = OpenRaw("{" + Entry("layer.w", "F4_WHAT", "[2]", 0, 2) + "}", 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("\"layer.w\""),
                                              HasSubstr("unknown dtype \"F4_WHAT\"")));
}

TEST_F(SafetensorsTest, ShapeDtypeMismatch) {
  auto s = OpenRaw("{" + Entry("w", "BF16", "[2,3]", 0, 10) + "}", 10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("\"w\""),
                                              HasSubstr("needs 12 bytes"), HasSubstr("span 10")));
}

TEST_F(SafetensorsTest, OffsetsOutsideDataRegion) {
  auto s = OpenRaw("{" + Entry("big", "F32", "[4]", 0, 16) + "}", 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(path_), HasSubstr("\"big\""), HasSubstr("outside")));
}

TEST_F(SafetensorsTest, OverlappingRanges) {
  auto s = OpenRaw(
      "{" + Entry("a", "F32", "[2]", 0, 8) + "," + Entry("b", "F32", "[2]", 4, 12) + "}", 12);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(path_), HasSubstr("\"a\""),
                                              HasSubstr("\"b\""), HasSubstr("overlap")));
}

TEST_F(SafetensorsTest, OutOfOrderOffsets) {
  auto s = OpenRaw("{" + Entry("rev", "F32", "[0]", 8, 4) + "}", 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(path_), HasSubstr("\"rev\""), HasSubstr("out of order")));
}

TEST_F(SafetensorsTest, GapsAndTrailingBytes) {
  auto s = OpenRaw(
      "{" + Entry("a", "F32", "[1]", 0, 4) + "," + Entry("b", "F32", "[1]", 8, 12) + "}", 12);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("\"b\""), HasSubstr("gap")));
  s = OpenRaw("{" + Entry("a", "F32", "[1]", 0, 4) + "}", 9);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cover 4"));
}

TEST_F(SafetensorsTest, DuplicateNames) {
  auto s = OpenRaw(
      "{" + Entry("dup", "F32", "[1]", 0, 4) + "," + Entry("dup", "F32", "[1]", 4, 8) + "}", 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(path_), HasSubstr("duplicate key \"dup\"")));
  // Inside one entry too: the last "dtype" must not silently win.
  s = OpenRaw(R"({"w":{"dtype":"F32","dtype":"BF16","shape":[1],"data_offsets":[0,4]}})", 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(R"(duplicate key "dtype" in "w")"));
}

// The unsigned dtypes of the safetensors format read like the others.
TEST_F(SafetensorsTest, UnsignedDtypesOpen) {
  WriteRaw(path_,
           "{" + Entry("u16", "U16", "[2]", 0, 4) + "," + Entry("u32", "U32", "[1]", 4, 8) + "," +
               Entry("u64", "U64", "[1]", 8, 16) + "}",
           16);
  auto f = SafetensorsFile::Open(path_);
  ASSERT_TRUE(f.ok()) << f.status();
  auto t = (*f)->Get("u32");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kU32);
  // WriteRaw's data bytes count up from 0: u32 is bytes 4..7.
  EXPECT_EQ(t->ToF32(), std::vector<float>{static_cast<float>(0x07060504u)});
  EXPECT_EQ((*f)->Get("u16")->ToF32(), (std::vector<float>{256.0f, 770.0f}));
}

TEST_F(SafetensorsTest, MalformedEntries) {
  for (const std::string& h :
       {std::string("{\"w\": 3}"),
        std::string("{\"w\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0,0]}}"),
        std::string("{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}"),
        std::string("{\"w\": {\"dtype\": 7, \"shape\": [1], \"data_offsets\": [0,4]}}"),
        std::string("{\"__metadata__\": {\"k\": 1}}"),
        std::string("{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
                    "\"data_offsets\": [0,0]}}"),
        // Elements under 2^62 whose bytes are not: the byte count must not wrap
        // to the span the offsets give.
        std::string("{\"w\": {\"dtype\": \"U8\", \"shape\": [2305843009213693952], "
                    "\"data_offsets\": [0,0]}}"),
        std::string("{\"w\": {\"dtype\": \"F64\", \"shape\": [576460752303423489], "
                    "\"data_offsets\": [0,0]}}"),
        // A zero dimension next to one past int64.
        std::string("{\"w\": {\"dtype\": \"F32\", \"shape\": [0, 18446744073709551615], "
                    "\"data_offsets\": [0,0]}}")}) {
    auto s = OpenRaw(h, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << h << " -> " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path_));
  }
}

// The stream writer: data in plan order, the header written last into the
// reserved room; the file reads back like the collecting writer's.
TEST_F(SafetensorsTest, StreamWriterWritesInPlanOrderAndFinishesWithTheHeader) {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b = {F32ToBf16(0.5f), F32ToBf16(-1.0f), F32ToBf16(3.0f)};
  std::vector<uint8_t> c = {7, 8, 9};  // odd sizes: no padding between tensors
  const std::vector<TensorSpec> plan = {{"z.second", DType::kF32, {2, 3}},
                                        {"a.first", DType::kBF16, {3}},
                                        {"m.u8", DType::kU8, {1, 3}},
                                        {"empty", DType::kF32, {0}}};
  // Reserve for the longest value "sum" can take; the real one is shorter.
  const uint64_t reserve =
      SafetensorsStreamWriter::HeaderBytes(plan, {{"sum", std::string(20, '9')}});
  auto w = SafetensorsStreamWriter::Create(path_, plan, reserve);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->next(), "z.second");
  // Out of order, wrong bytes, wrong shape: refused, naming the file and tensor.
  auto s = (*w)->Append(plan[1], b.data(), 6);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(path_), HasSubstr("a.first"), HasSubstr("next is \"z.second\"")));
  s = (*w)->Append(plan[0], a.data(), 20);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("needs 24 bytes, got 20")));
  s = (*w)->Append({"z.second", DType::kF32, {3, 2}}, a.data(), 24);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("planned as F32 [2, 3]"));
  ASSERT_TRUE((*w)->Append(plan[0], a.data(), 24).ok());
  ASSERT_TRUE((*w)->Append(plan[1], b.data(), 6).ok());
  // Finish before the plan is written: names the first missing tensor.
  s = (*w)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("2 planned tensor(s) unwritten, the first \"m.u8\""));
  ASSERT_TRUE((*w)->Append(plan[2], c.data(), 3).ok());
  ASSERT_TRUE((*w)->Append(plan[3], nullptr, 0).ok());
  EXPECT_EQ((*w)->next(), "");
  (*w)->SetMetadata("sum", "12345");
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ((*w)->Append(plan[3], nullptr, 0).code(), absl::StatusCode::kFailedPrecondition);
  w->reset();  // a finished file stays

  auto file = SafetensorsFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("sum"), "12345");
  // Data in plan order: z.second first although the header lists it last.
  EXPECT_EQ((*file)->Find("z.second")->begin, 0u);
  EXPECT_EQ((*file)->Find("a.first")->begin, 24u);
  EXPECT_EQ((*file)->Find("m.u8")->begin, 30u);
  EXPECT_THAT((*file)->Get("z.second")->ToF32(), ::testing::ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_THAT((*file)->Get("a.first")->ToF32(), ::testing::ElementsAre(0.5f, -1.0f, 3.0f));
  auto u8 = (*file)->Get("m.u8");
  ASSERT_TRUE(u8.ok());
  EXPECT_EQ(std::memcmp(u8->raw(), c.data(), 3), 0);
  // The header length is the reserve rounded up to 8, padded with spaces.
  std::ifstream in(path_, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
  EXPECT_EQ(header_len, (reserve + 7) / 8 * 8);
  EXPECT_GT(header_len, SafetensorsStreamWriter::HeaderBytes(plan, {{"sum", "12345"}}));
}

TEST_F(SafetensorsTest, StreamWriterRefusesBadPlansAndOversizedHeaders) {
  for (const std::vector<TensorSpec>& plan :
       {std::vector<TensorSpec>{{"x", DType::kF32, {1}}, {"x", DType::kF32, {1}}},
        std::vector<TensorSpec>{{"__metadata__", DType::kF32, {1}}},
        std::vector<TensorSpec>{{"n", DType::kF32, {-1}}}}) {
    auto w = SafetensorsStreamWriter::Create(path_, plan, 4096);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
    EXPECT_THAT(std::string(w.status().message()), HasSubstr(path_));
  }
  const std::vector<TensorSpec> plan = {{"x", DType::kF32, {1}}};
  auto w =
      SafetensorsStreamWriter::Create(path_, plan, SafetensorsStreamWriter::HeaderBytes(plan, {}));
  ASSERT_TRUE(w.ok());
  float one = 1;
  ASSERT_TRUE((*w)->Append(plan[0], &one, 4).ok());
  (*w)->SetMetadata("longer", "than the room reserved for the header");
  auto s = (*w)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("reserved"));
  w->reset();  // an unfinished file is removed
  EXPECT_FALSE(std::filesystem::exists(path_));
  auto denied = SafetensorsStreamWriter::Create(dir_.file("no/such/dir/x.safetensors"), plan, 64);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
}

// A full disk: the write error surfaces as DATA_LOSS naming the file.
TEST_F(SafetensorsTest, StreamWriterReportsAFailedWrite) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this machine";
  const std::vector<TensorSpec> plan = {{"x", DType::kF32, {2}}};
  auto w = SafetensorsStreamWriter::Create("/dev/full", plan, 128);
  ASSERT_TRUE(w.ok()) << w.status();
  float v[2] = {1, 2};
  auto s = (*w)->Append(plan[0], v, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("/dev/full"), HasSubstr("write failed")));
  EXPECT_EQ((*w)->Finish().code(), absl::StatusCode::kFailedPrecondition);
  w->reset();
  EXPECT_TRUE(std::filesystem::exists("/dev/full"));  // only regular files are removed
}

// Random corruption of a valid file: every outcome is a status, never a crash
// (this test earns its keep under ASan).
TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  SafetensorsWriter w;
  std::vector<float> v(64, 1.0f);
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(w.Add("t" + std::to_string(i), DType::kF32, {4, 4}, v.data() + 16 * i, 64).ok());
  ASSERT_TRUE(w.Write(path_).ok());
  std::ifstream in(path_, std::ios::binary);
  std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::mt19937 rng(11);
  int rejected = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      size_t pos = rng() % std::min<size_t>(bad.size(), 8 + 300);
      bad[pos] = static_cast<char>(rng());
    }
    if (rng() % 5 == 0) bad.resize(rng() % bad.size());
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bad;
    auto f = SafetensorsFile::Open(path_);
    if (!f.ok()) {
      ++rejected;
      EXPECT_THAT(std::string(f.status().message()), HasSubstr(path_));
      continue;
    }
    for (const auto& e : (*f)->entries()) {
      auto t = (*f)->Get(e.name);
      ASSERT_TRUE(t.ok());
      (void)t->ToF32();  // touches every byte the header claims
    }
  }
  EXPECT_GT(rejected, 100);
}

class CheckpointTest : public ::testing::Test {
 protected:
  testing::TempDir dir_;
  void Shard(const std::string& name, const std::vector<std::string>& tensors) {
    SafetensorsWriter w;
    float x[2] = {1, 2};
    for (const auto& t : tensors) ASSERT_TRUE(w.Add(t, DType::kF32, {2}, x, 8).ok());
    ASSERT_TRUE(w.Write(dir_.file(name)).ok());
  }
  void Index(const std::string& body) {
    std::ofstream(dir_.file("model.safetensors.index.json"))
        << "{\"metadata\": {}, \"weight_map\": {" << body << "}}";
  }
};

TEST_F(CheckpointTest, ShardedIndex) {
  Shard("model-00001-of-00002.safetensors", {"a", "b"});
  Shard("model-00002-of-00002.safetensors", {"c"});
  Index(R"("a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
           "c": "model-00002-of-00002.safetensors")");
  auto ck = Checkpoint::Open(dir_.path());
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_THAT((*ck)->Names(), ::testing::ElementsAre("a", "b", "c"));
  EXPECT_EQ((*ck)->Get("c")->ToF32()[1], 2.0f);
  EXPECT_EQ((*ck)->Get("zz").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, MissingShard) {
  Shard("model-00001-of-00002.safetensors", {"a"});
  Index(R"("a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors")");
  auto s = Checkpoint::Open(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("model-00002-of-00002.safetensors"),
                                              HasSubstr("\"c\""), HasSubstr("missing")));
}

TEST_F(CheckpointTest, IndexNamesTensorShardLacks) {
  Shard("s1.safetensors", {"a"});
  Index(R"("a": "s1.safetensors", "ghost": "s1.safetensors")");
  auto s = Checkpoint::Open(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("\"ghost\""), HasSubstr("s1.safetensors"),
                                              HasSubstr("does not contain it")));
}

TEST_F(CheckpointTest, BadIndex) {
  Shard("s1.safetensors", {"a"});
  std::ofstream(dir_.file("model.safetensors.index.json"))
      << "{\"weight_map\": {\"a\": \"s1.safetensors\", \"a\": \"s1.safetensors\"}}";
  auto s = Checkpoint::Open(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("index.json"), HasSubstr("duplicate key \"a\"")));
  std::ofstream(dir_.file("model.safetensors.index.json"), std::ios::trunc)
      << "{\"weight_map\": {\"a\": \"../etc/passwd\"}}";
  EXPECT_EQ(Checkpoint::Open(dir_.path()).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(dir_.file("model.safetensors.index.json"), std::ios::trunc) << "{\"metadata\": {}";
  EXPECT_EQ(Checkpoint::Open(dir_.path()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointTest, TensorInTwoShards) {
  Shard("x1.safetensors", {"a", "b"});
  Shard("x2.safetensors", {"b"});
  auto s = Checkpoint::Open(dir_.path()).status();  // no index: every *.safetensors
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("\"b\""), HasSubstr("x1.safetensors"), HasSubstr("x2.safetensors")));
}

TEST_F(CheckpointTest, EmptyDirectory) {
  auto s = Checkpoint::Open(dir_.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Checkpoint::Open(dir_.file("nope")).status().code(), absl::StatusCode::kNotFound);
}

// The header parse is linear in the entry count: 200,000 entries parse in
// about a second; a parse quadratic in them (a rescan of the top-level
// object per entry) takes minutes and runs into the test timeout.
TEST_F(SafetensorsTest, AHeaderOfManyEntriesParses) {
  constexpr int kEntries = 200000;
  std::string header = "{";
  header.reserve(kEntries * 64);
  for (int i = 0; i < kEntries; ++i) {
    if (i > 0) header += ',';
    header += Entry("t" + std::to_string(i), "U8", "[1]", i, i + 1);
  }
  header += "}";
  WriteRaw(path_, header, kEntries);
  auto f = SafetensorsFile::Open(path_);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f.value()->entries().size(), static_cast<size_t>(kEntries));
  EXPECT_NE(f.value()->Find("t199999"), nullptr);
}

}  // namespace
}  // namespace hmoe
