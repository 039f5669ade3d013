// hmoe convert's packed files: same weights as quantizing at load, and clear
// errors for truncated, corrupted or mismatched files.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "expert_service/server/convert_cli.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/server/packed_file.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

std::string ModelDir() { return ::hmoe::testing::FixturesDir() + "/deepseek_v3_tiny"; }

ShardOptions Opts(int i, int n, SplitMode split, const std::string& format,
                  const std::string& packed = "") {
  ShardOptions o;
  o.model_dir = ModelDir();
  o.packed_dir = packed;
  o.shard_index = i;
  o.num_shards = n;
  o.split = split;
  o.format = *ParseServeFormat(format, &o.group);
  return o;
}

TEST(Convert, PackedShardsEqualQuantizeAtLoad) {
  ::hmoe::testing::TempDir dir;
  struct Case {
    std::string format;
    int n;
    SplitMode split;
  };
  for (const Case& c : {Case{"int4g64", 2, SplitMode::kTp}, Case{"int4g32", 3, SplitMode::kTp},
                        Case{"int8", 3, SplitMode::kEp}, Case{"bf16", 1, SplitMode::kTp}}) {
    SCOPED_TRACE(absl::StrCat(c.format, " ", c.n, " ", SplitModeName(c.split)));
    const std::string out = dir.file(absl::StrCat(c.format, c.n, SplitModeName(c.split)));
    ASSERT_EQ(ConvertCommand({ModelDir(), out, "--format", c.format, "--shards", absl::StrCat(c.n),
                              "--split", SplitModeName(c.split)}),
              0);
    for (int i = 0; i < c.n; ++i) {
      auto direct = ExpertShard::Load(Opts(i, c.n, c.split, c.format));
      auto packed = ExpertShard::Load(Opts(i, c.n, c.split, "bf16", out));
      ASSERT_TRUE(direct.ok()) << direct.status();
      ASSERT_TRUE(packed.ok()) << packed.status();
      EXPECT_EQ((*packed)->info().weight_format, c.format);
      const ShardInfo& info = (*direct)->info();
      auto call = ::hmoe::testing::MakeRandomCall(info, info.moe_layers[1], 6, 4);
      std::vector<float> a(static_cast<size_t>(6 * info.hidden)), b(a.size());
      ASSERT_TRUE((*direct)->Handle(call.call(), a.data(), nullptr).ok());
      ASSERT_TRUE((*packed)->Handle(call.call(), b.data(), nullptr).ok());
      EXPECT_EQ(a, b);  // the same quantized weights, bit for bit
    }
  }
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Experts are quantized `--threads` at a time but written in one order: the
// files do not depend on the thread count.
TEST(Convert, FilesAreTheSameForAnyThreadCount) {
  ::hmoe::testing::TempDir dir;
  for (const char* format : {"int4g32", "int8"}) {
    SCOPED_TRACE(format);
    const std::string one = dir.file(absl::StrCat(format, "-1")),
                      many = dir.file(absl::StrCat(format, "-5"));
    ASSERT_EQ(ConvertCommand({ModelDir(), one, "--format", format, "--shards=2", "--threads=1"}),
              0);
    ASSERT_EQ(ConvertCommand({ModelDir(), many, "--format", format, "--shards=2", "--threads=5"}),
              0);
    for (int i = 0; i < 2; ++i) {
      const std::string name = PackedFileName(SplitMode::kTp, i, 2);
      const std::string a = ReadAll(one + "/" + name), b = ReadAll(many + "/" + name);
      EXPECT_GT(a.size(), 1000u);
      EXPECT_TRUE(a == b) << name << " differs between --threads 1 and 5";
    }
  }
  EXPECT_EQ(ConvertCommand({ModelDir(), dir.file("x"), "--threads=-1"}), 2);
  EXPECT_EQ(ConvertCommand({ModelDir(), dir.file("x"), "--threads=two"}), 2);
}

// A checkpoint whose last MoE layer has a malformed expert: the conversion
// fails naming the tensor after the shard files were partly written, and
// leaves neither those partial files nor finished-looking ones behind.
TEST(Convert, AFailureHalfwayLeavesNoFiles) {
  ::hmoe::testing::TempDir dir;
  const std::string model = dir.file("broken");
  std::filesystem::create_directories(model);
  std::filesystem::copy_file(ModelDir() + "/config.json", model + "/config.json");
  auto cfg = LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  int last_moe = -1;
  for (size_t l = 0; l < cfg->layers.size(); ++l)
    if (cfg->layers[l].moe) last_moe = static_cast<int>(l);
  ASSERT_GT(last_moe, 0);
  const std::string bad = ExpertWeightName(*cfg, last_moe, 3, ExpertProj::kDown);
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  SafetensorsWriter w;
  bool found = false;
  for (const std::string& name : (*ckpt)->Names()) {
    auto t = (*ckpt)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status();
    Shape shape = t->shape();
    size_t bytes = static_cast<size_t>(t->nbytes());
    if (name == bad) {  // one column short; the same leading bytes
      found = true;
      shape.back() -= 1;
      bytes = static_cast<size_t>(DTypeBytes(t->dtype(), NumElements(shape)));
    }
    ASSERT_TRUE(w.Add(name, t->dtype(), shape, t->raw(), bytes).ok()) << name;
  }
  ASSERT_TRUE(found) << bad;
  ASSERT_TRUE(w.Write(model + "/model.safetensors").ok());

  const std::string out = dir.file("out");
  ConvertOptions o;
  o.format = "int8";
  o.shards = 2;
  o.threads = 2;
  absl::Status st = ConvertModel(model, out, o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(bad), absl::string_view::npos) << st;
  ASSERT_TRUE(std::filesystem::exists(out));
  EXPECT_TRUE(std::filesystem::is_empty(out))
      << "left behind: " << std::filesystem::directory_iterator(out)->path();
}

TEST(Convert, TruncatedCorruptedOrMismatchedFilesAreRefused) {
  ::hmoe::testing::TempDir dir;
  const std::string out = dir.file("packed");
  ASSERT_EQ(ConvertCommand({ModelDir(), out, "--format=int8", "--shards=2", "--split=tp"}), 0);
  const std::string f0 = out + "/" + PackedFileName(SplitMode::kTp, 0, 2);
  // Wrong shard layout: no file for it.
  auto s = ExpertShard::Load(Opts(0, 3, SplitMode::kTp, "bf16", out));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound) << s.status();
  // A file renamed to pose as another shard: metadata says otherwise.
  std::filesystem::copy_file(f0, out + "/" + PackedFileName(SplitMode::kTp, 1, 2),
                             std::filesystem::copy_options::overwrite_existing);
  s = ExpertShard::Load(Opts(1, 2, SplitMode::kTp, "bf16", out));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().message().find("shard"), absl::string_view::npos) << s.status();
  // Another model's config.
  auto other = LoadModelConfig(::hmoe::testing::FixturesDir() + "/qwen3_moe_tiny");
  ASSERT_TRUE(other.ok());
  auto p = PackedExperts::Open(out, *other, SplitMode::kTp, 0, 2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  // A checksum entry that is a number, not a string (same file length): an
  // error naming the file, not an exception out of the JSON library.
  {
    std::ifstream in(f0, std::ios::binary);
    const std::string original((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
    in.close();
    const size_t at = original.find("checksums");
    ASSERT_NE(at, std::string::npos);
    const size_t open = original.find(R"(\":\")", at);  // ends a name, opens its value
    ASSERT_NE(open, std::string::npos);
    const size_t close = original.find(R"(\")", open + 5);
    ASSERT_NE(close, std::string::npos);
    std::string edited = original;
    edited.replace(open + 3, 2, "  ");  // the value's opening \" -> spaces
    edited.replace(close, 2, "  ");     // and its closing one
    std::ofstream(f0, std::ios::binary | std::ios::trunc) << edited;
    s = ExpertShard::Load(Opts(0, 2, SplitMode::kTp, "bf16", out));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("bad checksum entry"), absl::string_view::npos)
        << s.status();
    std::ofstream(f0, std::ios::binary | std::ios::trunc) << original;  // restored
  }
  // One flipped byte in the data region: checksum.
  const auto size = std::filesystem::file_size(f0);
  {
    std::fstream f(f0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 3));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(size - 3));
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  s = ExpertShard::Load(Opts(0, 2, SplitMode::kTp, "bf16", out));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  EXPECT_NE(s.status().message().find("checksum"), absl::string_view::npos) << s.status();
  // Truncated.
  std::filesystem::resize_file(f0, size / 2);
  s = ExpertShard::Load(Opts(0, 2, SplitMode::kTp, "bf16", out));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(f0), absl::string_view::npos) << s.status();
  // Bad arguments.
  EXPECT_EQ(ConvertCommand({ModelDir(), out, "--format=fp4"}), 1);
  EXPECT_EQ(ConvertCommand({ModelDir()}), 2);
}

}  // namespace
}  // namespace hmoe
