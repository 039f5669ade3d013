// hmoe convert's packed files: same weights as quantizing at load, and clear
// errors for truncated, corrupted or mismatched files.
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/weight_map.h"
#include "expert_service/convert/convert_cli.h"
#include "expert_service/convert/packed_file.h"
#include "expert_service/server/expert_shard.h"
#include "gmock/gmock.h"
#include "gpu_worker/transport/expert_pool.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_edit.h"
#include "tests/testing/native_checkpoint.h"
#include "tests/testing/producer_fixtures.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
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
  o.format = *ParseWeightFormat(format, &o.group);
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
      // --format given: the files must be in it.
      ShardOptions asked = Opts(i, c.n, c.split, c.format, out);
      asked.format_explicit = true;
      EXPECT_TRUE(ExpertShard::Load(asked).ok());
      asked = Opts(i, c.n, c.split, c.format == "int8" ? "int4g64" : "int8", out);
      asked.format_explicit = true;
      auto refused = ExpertShard::Load(asked);
      EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
      EXPECT_NE(std::string(refused.status().message()).find(" holds " + c.format),
                std::string::npos)
          << refused.status();
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
  // Progress: once per MoE layer, in order, on the calling thread.
  ConvertOptions o;
  o.format = "int8";
  std::vector<std::vector<int>> calls;
  o.progress = [&](int layer, int done, int total) { calls.push_back({layer, done, total}); };
  ASSERT_TRUE(ConvertModel(ModelDir(), dir.file("progress"), o).ok());
  auto cfg = LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok());
  std::vector<std::vector<int>> want;
  int moe = 0;
  for (size_t l = 0; l < cfg->layers.size(); ++l) moe += cfg->layers[l].moe ? 1 : 0;
  for (size_t l = 0, done = 0; l < cfg->layers.size(); ++l) {
    if (cfg->layers[l].moe) want.push_back({static_cast<int>(l), static_cast<int>(++done), moe});
  }
  EXPECT_EQ(calls, want);
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
  auto cfg = LoadModelConfig(ModelDir());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  int last_moe = -1;
  for (size_t l = 0; l < cfg->layers.size(); ++l)
    if (cfg->layers[l].moe) last_moe = static_cast<int>(l);
  ASSERT_GT(last_moe, 0);
  const std::string bad = ExpertWeightName(*cfg, last_moe, 3, ExpertProj::kDown);
  bool found = false;
  ::hmoe::testing::RewriteCheckpoint(
      ModelDir(), model, [&](const std::string& name, const Tensor& t, SafetensorsWriter& w) {
        if (name != bad) return ::hmoe::testing::Keep(name, t, w);
        found = true;  // one column short; the same leading bytes
        Shape shape = t.shape();
        shape.back() -= 1;
        EXPECT_TRUE(w.Add(name, t.dtype(), shape, t.raw(),
                          static_cast<size_t>(DTypeBytes(t.dtype(), NumElements(shape))))
                        .ok());
        return true;
      });
  ASSERT_TRUE(found) << bad;

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

  // Cancelled (hmoe convert's SIGINT) after the first layer: CANCELLED, no
  // .tmp (hundreds of GB for a 671B model) left behind.
  const std::string out_c = dir.file("out_cancelled");
  ConvertOptions oc = o;
  bool first_layer_done = false;
  oc.progress = [&](int, int, int) { first_layer_done = true; };
  oc.cancelled = [&] { return first_layer_done; };
  st = ConvertModel(ModelDir(), out_c, oc);
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_TRUE(first_layer_done);
  EXPECT_TRUE(std::filesystem::is_empty(out_c))
      << "left behind: " << std::filesystem::directory_iterator(out_c)->path();

  // A failure at the very end (here: shard 1's final name is taken by a
  // directory, so its rename fails): an error naming it, no .tmp left.
  const std::string out2 = dir.file("out2");
  const std::string taken = out2 + "/" + PackedFileName(SplitMode::kTp, 1, 2);
  std::filesystem::create_directories(taken + "/occupied");
  st = ConvertModel(ModelDir(), out2, o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find(taken), absl::string_view::npos) << st;
  for (const auto& e : std::filesystem::directory_iterator(out2))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
}

// DeepSeek-V3's own format: a block-scaled fp8 checkpoint converts to the
// same packed weights as quantizing it at load, and to exactly those of an
// f32 checkpoint of its dequantized values (the block scales are applied).
// One conversion's shard files share an id (a hash of every shard's
// checksums); a worker's pool refuses shards packed from different weights,
// which each pass their own checks (same config, own checksums) and would
// otherwise sum into wrong answers.
TEST(Convert, ShardsOfDifferentConversionsAreRefusedTogether) {
  ::hmoe::testing::TempDir dir;
  const std::string other = dir.file("other");
  std::filesystem::create_directories(other);
  // The same model with other weights (fp8-rounded projections).
  ::hmoe::testing::RewriteCheckpoint(ModelDir(), other, ::hmoe::testing::Fp8ProjEdit(false, 16));
  const std::string a = dir.file("a"), b = dir.file("b");
  ASSERT_EQ(ConvertCommand({ModelDir(), a, "--format", "int8", "--shards", "2"}), 0);
  ASSERT_EQ(ConvertCommand({other, b, "--format", "int8", "--shards", "2"}), 0);
  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  std::string ids[2][2];
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < 2; ++c) {
      auto p = PackedExperts::Open(c == 0 ? a : b, *config, SplitMode::kTp, i, 2);
      ASSERT_TRUE(p.ok()) << p.status();
      ids[c][i] = (*p)->conversion_id();
      EXPECT_EQ(ids[c][i].size(), 16u);
    }
  }
  EXPECT_EQ(ids[0][0], ids[0][1]);
  EXPECT_EQ(ids[1][0], ids[1][1]);
  EXPECT_NE(ids[0][0], ids[1][0]);

  ::hmoe::testing::ServiceProcess s0, s1, s1_same;
  ASSERT_TRUE(
      s0.Start({"--model-dir=" + ModelDir(), "--packed-dir=" + a, "--shard=0/2", "--no-ucx"},
               dir.file("p0")));
  ASSERT_TRUE(s1.Start({"--model-dir=" + other, "--packed-dir=" + b, "--shard=1/2", "--no-ucx"},
                       dir.file("p1")));
  ExpertPoolOptions po;
  po.targets = {s0.target(), s1.target()};
  auto mixed = ExpertPool::Connect(po);
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition) << mixed.status();
  EXPECT_NE(mixed.status().message().find("different checkpoints"), std::string_view::npos)
      << mixed.status();
  ASSERT_TRUE(
      s1_same.Start({"--model-dir=" + ModelDir(), "--packed-dir=" + a, "--shard=1/2", "--no-ucx"},
                    dir.file("p2")));
  po.targets = {s0.target(), s1_same.target()};
  auto same = ExpertPool::Connect(po);
  EXPECT_TRUE(same.ok()) << same.status();
}

// Packed files record the checkpoint they came from: a service whose
// --model-dir holds another checkpoint of the same shape (DeepSeek-R1's
// config fits V3's packed files) refuses them; a model dir with the config
// only (an expert-only host) cannot tell and loads.
TEST(Convert, PackedFilesAreCheckedAgainstTheModelDirsCheckpoint) {
  ::hmoe::testing::TempDir dir;
  const std::string other = dir.file("other"), config_only = dir.file("config_only");
  std::filesystem::create_directories(other);
  std::filesystem::create_directories(config_only);
  ::hmoe::testing::RewriteCheckpoint(ModelDir(), other, ::hmoe::testing::Fp8ProjEdit(false, 16));
  std::filesystem::copy_file(ModelDir() + "/config.json", config_only + "/config.json");
  const std::string out = dir.file("out");
  ASSERT_EQ(ConvertCommand({ModelDir(), out, "--format", "int8"}), 0);

  auto config = LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = Checkpoint::Open(ModelDir());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto fp = RoutedExpertsFingerprint(**ckpt, *config);
  ASSERT_TRUE(fp.ok()) << fp.status();

  auto same = ExpertShard::Load(Opts(0, 1, SplitMode::kTp, "int8", out));
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ((*same)->info().source_fingerprint, *fp);
  ShardOptions o = Opts(0, 1, SplitMode::kTp, "int8", out);
  o.model_dir = other;
  auto wrong = ExpertShard::Load(o);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_NE(std::string(wrong.status().message()).find("was converted from another checkpoint"),
            std::string::npos)
      << wrong.status();
  o.model_dir = config_only;
  auto unknown = ExpertShard::Load(o);
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_EQ((*unknown)->info().source_fingerprint, *fp);  // what the files say
  // Quantized at load: the checkpoint's own.
  ShardOptions at_load = Opts(0, 1, SplitMode::kTp, "int8");
  at_load.model_dir = other;
  auto direct = ExpertShard::Load(at_load);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ((*direct)->info().source_fingerprint.size(), 16u);
  EXPECT_NE((*direct)->info().source_fingerprint, *fp);
}

TEST(Convert, Fp8CheckpointPacksLikeQuantizeAtLoad) {
  ::hmoe::testing::TempDir dir;
  const int64_t B = 16;
  const std::string fp8 = dir.file("fp8"), f32 = dir.file("f32");
  std::filesystem::create_directories(fp8);
  std::filesystem::create_directories(f32);
  ::hmoe::testing::RewriteCheckpoint(ModelDir(), fp8, ::hmoe::testing::Fp8ProjEdit(true, B),
                                     ::hmoe::testing::Fp8Config(B));
  ::hmoe::testing::RewriteCheckpoint(ModelDir(), f32, ::hmoe::testing::Fp8ProjEdit(false, B));
  for (const char* format : {"int4g64", "int8", "bf16"}) {
    SCOPED_TRACE(format);
    const std::string out = dir.file(absl::StrCat("packed-", format));
    ASSERT_EQ(ConvertCommand({fp8, out, "--format", format, "--shards=2", "--threads=3"}), 0);
    for (int i = 0; i < 2; ++i) {
      ShardOptions from_fp8 = Opts(i, 2, SplitMode::kTp, format), from_f32 = from_fp8;
      from_fp8.model_dir = fp8;
      from_f32.model_dir = f32;
      ShardOptions packed_opts = Opts(i, 2, SplitMode::kTp, "bf16", out);
      packed_opts.model_dir = fp8;
      auto direct = ExpertShard::Load(from_fp8);
      auto packed = ExpertShard::Load(packed_opts);
      auto dequantized = ExpertShard::Load(from_f32);
      ASSERT_TRUE(direct.ok()) << direct.status();
      ASSERT_TRUE(packed.ok()) << packed.status();
      ASSERT_TRUE(dequantized.ok()) << dequantized.status();
      const ShardInfo& info = (*direct)->info();
      auto call = ::hmoe::testing::MakeRandomCall(info, info.moe_layers[0], 5, 9);
      std::vector<float> a(static_cast<size_t>(5 * info.hidden)), b(a.size()), c(a.size());
      ASSERT_TRUE((*direct)->Handle(call.call(), a.data(), nullptr).ok());
      ASSERT_TRUE((*packed)->Handle(call.call(), b.data(), nullptr).ok());
      ASSERT_TRUE((*dequantized)->Handle(call.call(), c.data(), nullptr).ok());
      EXPECT_EQ(a, b);  // bit for bit
      // Exactly the weights of the f32 checkpoint holding the dequantized
      // values (block scales applied, nothing else lost on the way).
      EXPECT_EQ(b, c);
      // And fp8 really changed them: the bf16 original's shard differs.
      auto original = ExpertShard::Load(Opts(i, 2, SplitMode::kTp, format));
      ASSERT_TRUE(original.ok()) << original.status();
      std::vector<float> d(a.size());
      ASSERT_TRUE((*original)->Handle(call.call(), d.data(), nullptr).ok());
      EXPECT_NE(b, d);
    }
  }
}

// fp8 experts whose blocks the config cannot describe are refused by name,
// as the worker refuses them: non-square blocks (UNIMPLEMENTED), no
// quantization_config at all (before: read as 128x128 blocks).
TEST(Convert, Fp8WithoutUsableBlockSizesIsRefused) {
  ::hmoe::testing::TempDir dir;
  const int64_t B = 16;
  const std::string odd = dir.file("odd"), none = dir.file("none");
  std::filesystem::create_directories(odd);
  std::filesystem::create_directories(none);
  ::hmoe::testing::RewriteCheckpoint(
      ModelDir(), odd, ::hmoe::testing::Fp8ProjEdit(true, B), [](nlohmann::json& j) {
        j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {16, 8}}};
      });
  ::hmoe::testing::RewriteCheckpoint(ModelDir(), none, ::hmoe::testing::Fp8ProjEdit(true, B));
  ShardOptions o = Opts(0, 1, SplitMode::kTp, "int8");
  o.model_dir = odd;
  auto s = ExpertShard::Load(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented) << s.status();
  EXPECT_THAT(std::string(s.status().message()),
              ::testing::HasSubstr("fp8 weight blocks must be square, got 16x8"));
  o.model_dir = none;
  s = ExpertShard::Load(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_THAT(std::string(s.status().message()),
              ::testing::HasSubstr("has no quantization_config"));
  EXPECT_NE(ConvertCommand({none, dir.file("out"), "--format", "int8"}), 0);
}

// The fixture's first MoE layer.
int FirstMoeLayer() {
  auto cfg = LoadModelConfig(ModelDir());
  if (!cfg.ok()) return -1;
  for (size_t l = 0; l < cfg->layers.size(); ++l)
    if (cfg->layers[l].moe) return static_cast<int>(l);
  return -1;
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
  // A tensor with its own bytes and checksum but another shape: refused,
  // naming the file and the tensor.
  {
    const std::string original = ReadAll(f0);
    auto packed = SafetensorsFile::Open(f0);
    ASSERT_TRUE(packed.ok()) << packed.status();
    SafetensorsWriter w;
    for (const auto& [k, v] : (*packed)->metadata()) w.SetMetadata(k, v);
    const std::string victim = absl::StrCat(FirstMoeLayer(), ".0.gate.q");
    bool found = false;
    for (const auto& e : (*packed)->entries()) {
      auto t = (*packed)->Get(e.name);
      ASSERT_TRUE(t.ok());
      Shape shape = t->shape();
      if (e.name == victim) {
        found = true;
        shape = {shape[0] / 2, shape[1] * 2};  // the same bytes
      }
      ASSERT_TRUE(
          w.Add(e.name, t->dtype(), shape, t->raw(), static_cast<size_t>(t->nbytes())).ok());
    }
    ASSERT_TRUE(found) << victim;
    ASSERT_TRUE(w.Write(f0).ok());
    s = ExpertShard::Load(Opts(0, 2, SplitMode::kTp, "bf16", out));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find(absl::StrCat(FirstMoeLayer(), ".0.gate")),
              absl::string_view::npos)
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

// Reads every routed expert matrix of `packed` back and calls `check` with
// its checkpoint name ("...experts.3.down_proj.weight"); the matrices read
// (a failed read is a test failure and ends the walk).
int ForEachPackedMatrix(const PackedExperts& packed, const ModelConfig& cfg,
                        const std::function<void(const std::string&, const QuantMatrix&)>& check) {
  int n = 0;
  for (size_t l = 0; l < cfg.layers.size(); ++l) {
    if (!cfg.layers[l].moe) continue;
    for (int64_t e = 0; e < cfg.moe.num_experts; ++e) {
      auto q = packed.Expert(static_cast<int>(l), e);
      EXPECT_TRUE(q.ok()) << q.status();
      if (!q.ok()) return n;
      const QuantMatrix* got[3] = {&q->gate, &q->up, &q->down};
      const ExpertProj projs[3] = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};
      for (int i = 0; i < 3; ++i, ++n)
        check(ExpertWeightName(cfg, static_cast<int>(l), static_cast<int>(e), projs[i]), *got[i]);
    }
  }
  return n;
}

// A checkpoint whose routed experts ship quantized converts to its own
// format by default, codes and scales kept bit for bit; --format still
// re-quantizes.
TEST(Convert, KeepsTheCheckpointsNativeFormatByDefault) {
  for (WeightFormat f :
       {WeightFormat::kInt4Bf16, WeightFormat::kMxfp4, WeightFormat::kFp8, WeightFormat::kMxfp8}) {
    SCOPED_TRACE(std::string(WeightFormatName(f)));
    ::hmoe::testing::TempDir dir;
    const std::string model = dir.file("model"), out = dir.file("out");
    std::filesystem::create_directories(model);
    const ::hmoe::testing::NativeCheckpoint nc = ::hmoe::testing::MakeNative(model, f);
    auto cfg = LoadModelConfig(model);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    EXPECT_EQ(DefaultConvertFormat(*cfg, model).value(),
              WeightFormatName(f, Traits(f).default_group));
    ConvertOptions o;  // no format: the checkpoint's
    ASSERT_TRUE(ConvertModel(model, out, o).ok());
    auto packed = PackedExperts::Open(out, *cfg, SplitMode::kTp, 0, 1);
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_EQ((*packed)->format(), f);
    const int compared =
        ForEachPackedMatrix(**packed, *cfg, [&](const std::string& name, const QuantMatrix& got) {
          const QuantMatrix& want = nc.written.at(name);
          EXPECT_EQ(got.packed, want.packed);
          EXPECT_EQ(got.scale, want.scale);
          EXPECT_EQ(got.scale_bf16, want.scale_bf16);
          EXPECT_EQ(got.scale_e8m0, want.scale_e8m0);
        });
    EXPECT_GT(compared, 0);
    // --format re-quantizes (from the dequantized weights).
    o.format = "int8";
    ASSERT_TRUE(ConvertModel(model, dir.file("int8"), o).ok());
    auto i8 = PackedExperts::Open(dir.file("int8"), *cfg, SplitMode::kTp, 0, 1);
    ASSERT_TRUE(i8.ok()) << i8.status();
    EXPECT_EQ((*i8)->format(), WeightFormat::kInt8);
  }
  auto bf16 = LoadModelConfig(ModelDir());
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(DefaultConvertFormat(*bf16, ModelDir()).value(), "int4g64");
}

// The producers' own checkpoints (tests/fixtures/native_producers): hmoe
// convert's default keeps each format, and the packed file's values are the
// producer's dequantization (tests/testing/producer_fixtures.h's rule).
TEST(Convert, ProducerCheckpointsKeepTheProducersValues) {
  for (const ::hmoe::testing::ProducerFixture& fx : ::hmoe::testing::ProducerFixtures()) {
    SCOPED_TRACE(fx.dir);
    const std::string model = ::hmoe::testing::ProducerFixtureDir(fx);
    ::hmoe::testing::TempDir dir;
    auto cfg = LoadModelConfig(model);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    EXPECT_EQ(DefaultConvertFormat(*cfg, model).value(), WeightFormatName(fx.format, fx.group));
    ASSERT_TRUE(ConvertModel(model, dir.file("out"), ConvertOptions()).ok());
    auto packed = PackedExperts::Open(dir.file("out"), *cfg, SplitMode::kTp, 0, 1);
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_EQ((*packed)->format(), fx.format);
    auto producer = SafetensorsFile::Open(model + "/producer_dequant.safetensors");
    ASSERT_TRUE(producer.ok()) << producer.status();
    std::vector<::hmoe::testing::Mismatch> mismatches;
    int64_t elements = 0;
    const int matrices =
        ForEachPackedMatrix(**packed, *cfg, [&](const std::string& name, const QuantMatrix& got) {
          auto p = (*producer)->Get(name);
          ASSERT_TRUE(p.ok()) << p.status();
          ::hmoe::testing::CompareWithProducer(got, *p, name, &mismatches, &elements);
        });
    EXPECT_EQ(static_cast<size_t>(matrices), (*producer)->entries().size());
    EXPECT_TRUE(mismatches.empty()) << ::hmoe::testing::Describe(mismatches, elements);
  }
}

}  // namespace
}  // namespace hmoe
