// The tiktoken format (common/text/tiktoken.h) against the `tiktoken` package:
// tests/fixtures/tiktoken/ was written by tests/fixtures/make_tiktoken_fixture.py
// (tiktoken 0.14.0, Kimi's pattern, tokenization_kimi.py's encode()).
#include "common/text/tiktoken.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/text/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::string Dir() { return testing::FixturesDir() + "/tiktoken"; }

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string Fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) h = (h ^ ((u >> (8 * k)) & 0xff)) * 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, h);
  return buf;
}

class TiktokenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Tokenizer::FromModelDir(Dir());
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = t->release();
    auto m =
        TiktokenModel::Parse(ReadAll(Dir() + "/tiktoken.model"), "tiktoken.model",
                             ReadAll(Dir() + "/tokenizer_config.json"), "tokenizer_config.json");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = m->release();
    vectors_ = new json(json::parse(std::ifstream(Dir() + "/vectors.json")));
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete model_;
    delete vectors_;
  }
  static Tokenizer* tok_;
  static TiktokenModel* model_;
  static json* vectors_;
};
Tokenizer* TiktokenTest::tok_ = nullptr;
TiktokenModel* TiktokenTest::model_ = nullptr;
json* TiktokenTest::vectors_ = nullptr;

// Every case: code, CJK, emoji, Arabic / Devanagari / Thai, contractions,
// mixed case, odd spaces, special tokens, the held-out corpus, random mixes.
TEST_F(TiktokenTest, EncodeMatchesTiktokenOnMixedCorpus) {
  int n = 0, with_special = 0;
  for (const auto& c : (*vectors_)["cases"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    std::string text;
    if (c.contains("hex")) {
      // Invalid UTF-8: refused as the interface says; the reference decodes
      // with errors="replace", which SanitizeUtf8 does.
      const std::string raw = FromHex(c["hex"].get<std::string>());
      EXPECT_EQ(tok_->Encode(raw).status().code(), absl::StatusCode::kInvalidArgument);
      text = SanitizeUtf8(raw);
      EXPECT_NE(text, raw);
    } else {
      text = c["text"].get<std::string>();
    }
    const auto want = c["ids"].get<std::vector<int32_t>>();
    auto ids = tok_->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want);
    const auto want_ordinary =
        c.contains("ordinary_ids") ? c["ordinary_ids"].get<std::vector<int32_t>>() : want;
    with_special += c.contains("ordinary_ids");
    std::vector<int32_t> ordinary;
    ASSERT_TRUE(model_->Encode(text, /*allow_special=*/false, &ordinary).ok());
    EXPECT_EQ(ordinary, want_ordinary);
    auto back = tok_->Decode(want);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, text);
    ++n;
  }
  EXPECT_GE(n, 600);
  EXPECT_GE(with_special, 5);
}

// Runs past 25,000 code points and texts past 400,000 (tokenization_kimi.py's
// cuts), a special token cut by them.
TEST_F(TiktokenTest, LongRunsAndChunksMatchTiktoken) {
  int n = 0;
  for (const auto& c : (*vectors_)["long"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    std::string text;
    for (const auto& seg : c["segments"])
      for (int r = seg[1].get<int>(); r > 0; --r) text += seg[0].get<std::string>();
    auto ids = tok_->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(ids->size(), c["n_ids"].get<size_t>());
    EXPECT_EQ(Fnv1a64(*ids), c["fnv1a64"].get<std::string>());
    std::vector<int32_t> ordinary;
    ASSERT_TRUE(model_->Encode(text, false, &ordinary).ok());
    EXPECT_EQ(ordinary.size(), c["ordinary_n_ids"].get<size_t>());
    EXPECT_EQ(Fnv1a64(ordinary), c["ordinary_fnv1a64"].get<std::string>());
    ++n;
  }
  EXPECT_GE(n, 21);
}

// Decoding any ids, broken UTF-8 included, as Encoding.decode (errors="replace").
TEST_F(TiktokenTest, DecodeMatchesTiktoken) {
  int n = 0;
  for (const auto& c : (*vectors_)["decode"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const std::string want = c["text"].get<std::string>();
    auto got = tok_->Decode(ids);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want);
    StreamDecoder stream(*tok_);
    std::string all;
    for (int32_t id : ids) {
      auto piece = stream.Push(id);
      ASSERT_TRUE(piece.ok());
      EXPECT_EQ(SanitizeUtf8(*piece), *piece);
      all += *piece;
    }
    all += stream.Finish();
    EXPECT_EQ(all, want);
    ++n;
  }
  EXPECT_GE(n, 200);
  EXPECT_EQ(tok_->Decode({tok_->vocab_size()}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tok_->Decode({-1}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Streaming holds back a character split across tokens (CJK and emoji here
// are mostly single-byte tokens) and never emits broken UTF-8.
TEST_F(TiktokenTest, StreamingHoldsPartialUtf8) {
  int held = 0;
  for (const auto& c : (*vectors_)["cases"]) {
    if (!c.contains("text")) continue;
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    StreamDecoder stream(*tok_);
    std::string all;
    for (int32_t id : ids) {
      auto piece = stream.Push(id);
      ASSERT_TRUE(piece.ok());
      EXPECT_EQ(SanitizeUtf8(*piece), *piece);
      if (piece->empty() && !tok_->TokenBytes(id, false).empty()) ++held;
      all += *piece;
    }
    all += stream.Finish();
    EXPECT_EQ(all, c["text"].get<std::string>());
  }
  EXPECT_GE(held, 50);
}

std::string Utf8(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    s.push_back(static_cast<char>(0xc0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else if (c < 0x10000) {
    s.push_back(static_cast<char>(0xe0 | (c >> 12)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    s.push_back(static_cast<char>(0xf0 | (c >> 18)));
    s.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
  return s;
}

// Sorted [first, last] ranges of code points, as pattern_probe.json has them.
class CodePointSet {
 public:
  explicit CodePointSet(const json& ranges) {
    for (const auto& r : ranges) r_.emplace_back(r[0].get<uint32_t>(), r[1].get<uint32_t>());
  }
  bool Has(uint32_t c) const {
    auto it = std::upper_bound(r_.begin(), r_.end(), std::make_pair(c, UINT32_MAX));
    return it != r_.begin() && std::prev(it)->second >= c;
  }

 private:
  std::vector<std::pair<uint32_t, uint32_t>> r_;
};

// The pattern's classes (our spelling of Kimi's: complement classes for the
// intersections, \p{sc:Han}, White_Space) over every code point: PREFIX + c
// is one piece exactly where tiktoken makes it one, for letters, capitals,
// Han, a space, punctuation and a digit before c. Code points assigned after
// Unicode 14 (PCRE2 10.42's tables) that tiktoken's newer tables know are
// the known difference ("newer"), counted, not compared.
TEST_F(TiktokenTest, PatternClassesMatchTiktokenOverAllOfUnicode) {
  const json probe = json::parse(std::ifstream(Dir() + "/pattern_probe.json"));
  const CodePointSet newer(probe["newer"]);
  int64_t checked = 0, skipped = 0;
  int failures = 0;
  for (const auto& [prefix, ranges] : probe["joined"].items()) {
    const CodePointSet joined(ranges);
    for (uint32_t c = 0x80; c < 0x110000; ++c) {
      if (c >= 0xd800 && c <= 0xdfff) continue;
      if (newer.Has(c)) {
        ++skipped;
        continue;
      }
      const std::string text = prefix + Utf8(c);
      auto pieces = model_->Split(text);
      ASSERT_TRUE(pieces.ok()) << pieces.status();
      const bool one = pieces->size() == 1 && (*pieces)[0].second == text.size();
      if (one != joined.Has(c)) {
        ADD_FAILURE() << "\"" << prefix << "\" + U+" << std::hex << c << ": tiktoken "
                      << (one ? "splits" : "joins") << ", we " << (one ? "join" : "split");
        if (++failures >= 20) return;
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 6 * 1000000);
  EXPECT_LT(skipped, 6 * 20000);
}

TEST_F(TiktokenTest, SpecialTokensFromConfig) {
  const int32_t n = model_->num_ranks();
  EXPECT_EQ(n, 3820);
  EXPECT_EQ(tok_->vocab_size(), n + 256);
  EXPECT_EQ(tok_->TokenToId("[BOS]"), n);
  EXPECT_EQ(tok_->TokenToId("<|im_end|>"), n + 2);
  EXPECT_EQ(tok_->TokenToId(absl::StrCat("<|reserved_token_", n + 5, "|>")), n + 5);
  EXPECT_EQ(tok_->TokenToId("Zyzzyva"), n - 4);  // a rank, by its bytes
  EXPECT_EQ(tok_->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ(tok_->bos_token_id(), n);
  EXPECT_EQ(tok_->eos_token_id(), n + 1);
  EXPECT_TRUE(tok_->IsSpecial(n));
  EXPECT_TRUE(tok_->IsSpecial(n + 5));    // reserved
  EXPECT_FALSE(tok_->IsSpecial(n + 11));  // "special": false
  EXPECT_FALSE(tok_->IsSpecial(65));
  auto ids = tok_->Encode("[BOS]hi<|tool_calls_section_begin|>x[EOS]", /*add_special_tokens=*/true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), n);  // no template adds another BOS
  EXPECT_EQ(ids->back(), n + 1);
  auto kept = tok_->Decode(*ids, /*skip_special_tokens=*/true);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, "hi<|tool_calls_section_begin|>x");
  EXPECT_EQ(tok_->TokenBytes(n + 2, true), "");
  EXPECT_EQ(tok_->TokenBytes(n + 2, false), "<|im_end|>");
}

// ---- bad input -----------------------------------------------------------------

class TiktokenBadInputTest : public ::testing::Test {
 protected:
  // 256 bytes, then "ab", "abc".
  static std::vector<std::string> Lines() {
    std::vector<std::string> lines;
    for (int b = 0; b < 256; ++b)
      lines.push_back(
          absl::StrCat(absl::Base64Escape(std::string(1, static_cast<char>(b))), " ", b));
    lines.push_back(absl::Base64Escape("ab") + " 256");
    lines.push_back(absl::Base64Escape("abc") + " 257");
    return lines;
  }
  static std::string Join(const std::vector<std::string>& lines) {
    std::string s;
    for (const auto& l : lines) s += l + "\n";
    return s;
  }
  static std::string Config(const std::string& added = R"("258": {"content": "[BOS]"})",
                            const std::string& extra = "") {
    return absl::StrCat(R"({"added_tokens_decoder": {)", added, R"(}, "bos_token": "[BOS]")", extra,
                        "}");
  }
  absl::Status Load(const std::string& ranks, const std::string& config = Config()) {
    std::ofstream(dir_.file("tiktoken.model"), std::ios::binary) << ranks;
    std::ofstream(dir_.file("tokenizer_config.json"), std::ios::binary) << config;
    return Tokenizer::FromModelDir(dir_.path()).status();
  }
  std::string RankPath() const { return dir_.file("tiktoken.model"); }
  std::string ConfigPath() const { return dir_.file("tokenizer_config.json"); }
  testing::TempDir dir_;
};

TEST_F(TiktokenBadInputTest, ValidFileLoads) {
  EXPECT_TRUE(Load(Join(Lines())).ok());
  // CRLF line ends and empty lines are read as tiktoken's loader reads them.
  std::string crlf;
  for (const auto& l : Lines()) crlf += l + "\r\n\n";
  EXPECT_TRUE(Load(crlf).ok());
}

TEST_F(TiktokenBadInputTest, RankFileErrorsNameFileAndLine) {
  struct Case {
    std::string what;
    std::vector<std::string> lines;
    std::vector<std::string> want;
  };
  std::vector<Case> cases;
  {
    auto l = Lines();
    l[257] = absl::Base64Escape("ab") + " 257";  // token of line 257 again
    cases.push_back({"duplicate token", l, {"line 258", "repeats rank 256", "line 257"}});
  }
  {
    auto l = Lines();
    l[257] = absl::Base64Escape("abc") + " 256";
    cases.push_back({"duplicate rank", l, {"line 258", "rank 256 repeats line 257"}});
  }
  {
    auto l = Lines();
    l[100] = "not*base64 100";
    cases.push_back({"non-base64", l, {"line 101", "\"not*base64\" is not base64"}});
  }
  {
    auto l = Lines();
    l[100] = "YWJj= 100";
    cases.push_back({"bad padding", l, {"line 101", "is not base64"}});
  }
  {
    auto l = Lines();
    l.erase(l.begin() + 0x41);  // 'A'
    l.back() = absl::Base64Escape("abc") + " 65";
    cases.push_back({"missing byte", l, {"byte 0x41 has no rank"}});
  }
  {
    auto l = Lines();
    l[257] = absl::Base64Escape("abc") + " 1000";
    cases.push_back({"rank past the end", l, {"line 258", "rank 1000 is not below", "258 ranks"}});
  }
  {
    auto l = Lines();
    l[3] = absl::Base64Escape(std::string(1, '\x03'));
    cases.push_back({"no rank", l, {"line 4", "not \"base64-token rank\""}});
  }
  {
    auto l = Lines();
    l[3] = absl::Base64Escape(std::string(1, '\x03')) + " -3";
    cases.push_back({"negative rank", l, {"line 4", "\"-3\" is not a non-negative"}});
  }
  cases.push_back({"empty", {}, {"no ranks"}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status s = Load(Join(c.lines));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(RankPath()));
    for (const auto& w : c.want) EXPECT_THAT(s.message(), HasSubstr(w));
  }
}

TEST_F(TiktokenBadInputTest, ConfigErrorsNameFile) {
  const std::string ranks = Join(Lines());
  struct Case {
    std::string what, config;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"id colliding with a rank",
       Config(R"("258": {"content": "[BOS]"}, "257": {"content": "<x>"})"),
       {"id 257", "collides with the rank of line 258 of", RankPath()}},
      {"id past the reserved range",
       Config(R"("258": {"content": "[BOS]"}, "514": {"content": "<x>"})"),
       {"id 514", "past the special ids 258..513"}},
      {"one content twice",
       Config(R"("258": {"content": "[BOS]"}, "259": {"content": "[BOS]"})"),
       {"special tokens 258 and 259 are both \"[BOS]\""}},
      {"reserved name taken",
       Config(R"("258": {"content": "[BOS]"}, "259": {"content": "<|reserved_token_260|>"})"),
       {"both \"<|reserved_token_260|>\""}},
      {"id not a number",
       Config(R"("258": {"content": "[BOS]"}, "x1": {"content": "<x>"})"),
       {"key \"x1\" is not an id"}},
      {"empty content",
       Config(R"("258": {"content": "[BOS]"}, "259": {"content": ""})"),
       {"added_tokens_decoder[\"259\"] needs a non-empty content"}},
      {"bos not special",
       Config(R"("259": {"content": "<s>"})"),
       {"bos_token \"[BOS]\" is not a special token"}},
      {"not JSON", "{", {"invalid JSON"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status s = Load(ranks, c.config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(ConfigPath()));
    for (const auto& w : c.want) EXPECT_THAT(s.message(), HasSubstr(w));
  }
  const absl::Status other = Load(
      ranks, Config(R"("258": {"content": "[BOS]"})", R"(, "tokenizer_class": "QWenTokenizer")"));
  EXPECT_EQ(other.code(), absl::StatusCode::kUnimplemented) << other;
  EXPECT_THAT(other.message(), AllOf(HasSubstr("QWenTokenizer"), HasSubstr(ConfigPath())));
}

TEST_F(TiktokenBadInputTest, ModelDirPicksTheFormat) {
  testing::TempDir empty;
  EXPECT_EQ(Tokenizer::FromModelDir(empty.path()).status().code(), absl::StatusCode::kNotFound);
  // tiktoken.model alone: its special tokens are missing, a clear error.
  std::ofstream(dir_.file("tiktoken.model")) << Join(Lines());
  auto alone = Tokenizer::FromModelDir(dir_.path());
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(alone.status().message(), HasSubstr("tokenizer_config.json"));
  ASSERT_TRUE(Load(Join(Lines())).ok());
  // tokenizer.json beside it wins (and a broken one is its own error).
  std::ofstream(dir_.file("tokenizer.json")) << "{";
  auto broken = Tokenizer::FromModelDir(dir_.path());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(broken.status().message(), HasSubstr("tokenizer.json"));
}

}  // namespace
}  // namespace hmoe
