#include "common/text/tokenizer.h"

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Tokenizer::FromFile(testing::FixturesDir() + "/tokenizer.json");
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = t->release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  static json Vectors() {
    return json::parse(std::ifstream(testing::FixturesDir() + "/tokenizer_vectors.json"));
  }
  static Tokenizer* tok_;
};
Tokenizer* TokenizerTest::tok_ = nullptr;

// Every vector was produced by the `tokenizers` package for this tokenizer.json.
TEST_F(TokenizerTest, MatchesHuggingFaceVectors) {
  int n = 0;
  for (const auto& v : Vectors()) {
    const std::string text = v["text"].get<std::string>();
    const auto want = v["ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(text);
    auto ids = tok_->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want);
    auto back = tok_->Decode(want);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, v["decoded"].get<std::string>());
    ++n;
  }
  EXPECT_GE(n, 30);
}

// Streaming: the pieces concatenate to Decode(), and every piece is valid UTF-8
// (multi-byte characters split across tokens are held back, never broken).
TEST_F(TokenizerTest, StreamingNeverEmitsBrokenUtf8) {
  int split_chars = 0;
  for (const auto& v : Vectors()) {
    const auto ids = v["ids"].get<std::vector<int32_t>>();
    StreamDecoder stream(*tok_);
    std::string all;
    for (int32_t id : ids) {
      auto piece = stream.Push(id);
      ASSERT_TRUE(piece.ok());
      EXPECT_EQ(SanitizeUtf8(*piece), *piece) << "broken UTF-8 emitted";
      if (piece->empty() && !tok_->TokenBytes(id, false).empty()) ++split_chars;
      all += *piece;
    }
    all += stream.Finish();
    EXPECT_EQ(all, *tok_->Decode(ids));
  }
  EXPECT_GT(split_chars, 0) << "fixtures should include characters split across tokens";
}

TEST_F(TokenizerTest, SpecialTokensAndTemplate) {
  auto bos = tok_->TokenToId("<|begin\xe2\x96\x81of\xe2\x96\x81sentence|>");
  ASSERT_TRUE(bos.has_value());
  EXPECT_TRUE(tok_->IsSpecial(*bos));
  auto plain = tok_->Encode("Hello");
  auto with = tok_->Encode("Hello", /*add_special_tokens=*/true);
  ASSERT_TRUE(plain.ok() && with.ok());
  ASSERT_EQ(with->size(), plain->size() + 1);
  EXPECT_EQ((*with)[0], *bos);
  auto skipped = tok_->Decode(*with, /*skip_special_tokens=*/true);
  EXPECT_EQ(*skipped, "Hello");
}

TEST_F(TokenizerTest, Errors) {
  EXPECT_EQ(tok_->Encode("bad \xff utf8").status().code(), absl::StatusCode::kInvalidArgument);
  auto s = tok_->Decode({1, tok_->vocab_size()}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(tok_->vocab_size())));
  StreamDecoder d(*tok_);
  EXPECT_EQ(d.Push(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromFile("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Tokenizer::FromJson("{", "t.json").status().code(), absl::StatusCode::kInvalidArgument);
  auto nfkc = Tokenizer::FromJson(
      R"({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFKC"}]},
          "model": {"type": "BPE", "vocab": {}}})",
      "t.json");
  EXPECT_EQ(nfkc.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(nfkc.status().message()), HasSubstr("normalizer type \"NFKC\""));
  // Merges as Hugging Face loads them: both sides and the result are tokens.
  for (const std::string& merges :
       {std::string(R"(["a b"])"), std::string(R"(["a c"])"), std::string(R"(["c a"])")}) {
    auto t = Tokenizer::FromJson(
        R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": )" + merges +
            "}}",
        "t.json");
    EXPECT_EQ(t.status().code(),
              merges == R"(["a b"])" ? absl::StatusCode::kOk : absl::StatusCode::kInvalidArgument)
        << merges << ": " << t.status();
  }
  auto nores = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})", "t.json");
  EXPECT_THAT(std::string(nores.status().message()),
              HasSubstr(R"(model.merges entry 0 ("a" + "b") has a result outside model.vocab)"));
  auto badre = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(["}, "behavior": "Isolated"}})",
      "t.json");
  EXPECT_EQ(badre.status().code(), absl::StatusCode::kInvalidArgument);
  // Structurally incomplete files are INVALID_ARGUMENT, not a crash (missing
  // keys read with .at(), ids bounded before the id table is sized).
  const std::string vocab = R"("model": {"type": "BPE", "vocab": {"a": 0}})";
  for (const std::string& body : {
           std::string(R"("pre_tokenizer": {"type": "Sequence"})"),
           std::string(R"("pre_tokenizer": {"type": "Split", "behavior": "Isolated"})"),
           std::string(R"("post_processor": {"type": "TemplateProcessing"})"),
           std::string(R"("post_processor": {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<s>"}}]})"),
           std::string(R"("post_processor": {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<s>"}}], "special_tokens": {"<s>": {}}})"),
           std::string(R"("post_processor": {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {}}], "special_tokens": {}})"),
           std::string(R"("added_tokens": [{"id": 2147483647, "content": "<x>"}])"),
           std::string(R"("added_tokens": [{"id": 4294967301, "content": "<x>"}])"),
           std::string(R"("added_tokens": [{"id": -1, "content": "<x>"}])"),
       }) {
    auto t = Tokenizer::FromJson("{" + vocab + ", " + body + "}", "t.json");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument)
        << body << " -> " << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("t.json")) << body;
  }
  auto big =
      Tokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": 1000000000}}})", "t.json");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument) << big.status();
}

// Split with MergedWithNext, as Hugging Face tokenizers splits: a delimiter
// joins the piece after it unless that piece is a delimiter too, so
// "the-final--countdown" pre-tokenizes to "the", "-final", "-", "-countdown"
// (before: "the", "-final", "--countdown"). With ignore_merges every piece
// in the vocabulary is one token, which shows the pieces.
TEST(Tokenizer, SplitMergedWithNextMatchesHuggingFace) {
  auto t = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "ignore_merges": true, "unk_token": "?",
          "vocab": {"the": 0, "-final": 1, "-": 2, "-countdown": 3, "--countdown": 4, "?": 5,
                    "x-": 6, "x": 7}},
          "pre_tokenizer": {"type": "Split", "pattern": {"String": "-"},
                            "behavior": "MergedWithNext"}})",
      "t.json");
  ASSERT_TRUE(t.ok()) << t.status();
  auto ids = (*t)->Encode("the-final--countdown");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{0, 1, 2, 3}));
  // A final delimiter stands alone; a leading one joins what follows.
  ids = (*t)->Encode("x-");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{7, 2}));
  ids = (*t)->Encode("-final");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{1}));
}

// Normalizers as Hugging Face applies them, between added tokens (NFC as
// Qwen3 ships it, the empty Sequence of DeepSeek-V3, NFD + Replace +
// Prepend); the texts include a 3000-letter word (one BPE piece).
TEST_F(TokenizerTest, NormalizersMatchHuggingFace) {
  const json base = json::parse(std::ifstream(testing::FixturesDir() + "/tokenizer.json"));
  const json all =
      json::parse(std::ifstream(testing::FixturesDir() + "/tokenizer_normalizer_vectors.json"));
  ASSERT_EQ(all.size(), 3u);
  for (const auto& variant : all) {
    json j = base;
    j["normalizer"] = variant["normalizer"];
    SCOPED_TRACE(variant["normalizer"].dump());
    auto t = Tokenizer::FromJson(j.dump(), "t.json");
    ASSERT_TRUE(t.ok()) << t.status();
    for (const auto& c : variant["cases"]) {
      const std::string text = c["text"].get<std::string>();
      SCOPED_TRACE(text.substr(0, 60));
      auto ids = (*t)->Encode(text);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_EQ(*ids, c["ids"].get<std::vector<int32_t>>());
    }
  }
}

// Edge cases, with the ids Hugging Face tokenizers 0.23.3 gives for them.
TEST(Tokenizer, EdgeCasesAsHuggingFaceHasThem) {
  // A merge listed twice takes its last rank: (a, b) after (b, c), so
  // "abc" -> a + bc.
  auto dup = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4},
          "merges": ["a b", "b c", "a b"]}})",
      "t.json");
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_EQ((*dup)->Encode("abc").value(), (std::vector<int32_t>{0, 4}));
  // Replace counts empty matches: x* on "ab" -> "-a-b-".
  auto re = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "-": 2}},
          "normalizer": {"type": "Replace", "pattern": {"Regex": "x*"}, "content": "-"}})",
      "t.json");
  ASSERT_TRUE(re.ok()) << re.status();
  EXPECT_EQ((*re)->Encode("ab").value(), (std::vector<int32_t>{2, 0, 2, 1, 2}));
  // Text normalized away gives no tokens, not ByteLevel's prefix space.
  json j = json::parse(std::ifstream(testing::FixturesDir() + "/tokenizer.json"));
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", ""}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  auto gone = Tokenizer::FromJson(j.dump(), "t.json");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ((*gone)->Encode("a").value(), std::vector<int32_t>{});
  EXPECT_EQ((*gone)->Encode("aab").value(), std::vector<int32_t>{272});
  // BPE options this tokenizer does not implement are UNIMPLEMENTED (the
  // worker then serves ids), not silently ignored.
  for (const std::string& opt :
       {std::string(R"("continuing_subword_prefix": "##")"),
        std::string(R"("end_of_word_suffix": "</w>")"), std::string(R"("dropout": 0.1)")}) {
    auto t = Tokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": 0}, )" + opt + "}}",
                                 "t.json");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented) << opt << ": " << t.status();
  }
}

// SentencePiece-style BPE as Mixtral's / Llama-2's tokenizer.json lays it
// out (Prepend + Replace normalizer, no pre-tokenizer, byte_fallback for
// characters outside the vocabulary, decoder Replace + ByteFallback + Fuse +
// Strip): ids and decodes from Hugging Face tokenizers 0.23.3
// (tests/fixtures/make_sp_bpe_tokenizer.py), streaming included.
TEST(Tokenizer, SentencePieceStyleMatchesHuggingFace) {
  auto t = Tokenizer::FromFile(testing::FixturesDir() + "/sp_bpe/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status();
  const json all = json::parse(std::ifstream(testing::FixturesDir() + "/sp_bpe/vectors.json"));
  int byte_fallbacks = 0;
  for (const auto& v : all) {
    const std::string text = v["text"].get<std::string>();
    SCOPED_TRACE(text);
    const auto ids = v["ids"].get<std::vector<int32_t>>();
    const auto ids_bos = v["ids_bos"].get<std::vector<int32_t>>();
    EXPECT_EQ((*t)->Encode(text).value(), ids);
    EXPECT_EQ((*t)->Encode(text, /*add_special_tokens=*/true).value(), ids_bos);
    EXPECT_EQ((*t)->Decode(ids).value(), v["decoded"].get<std::string>());
    EXPECT_EQ((*t)->Decode(ids_bos, /*skip_special_tokens=*/true).value(),
              v["decoded_bos_skip"].get<std::string>());
    EXPECT_EQ((*t)->Decode(ids_bos).value(), v["decoded_bos_keep"].get<std::string>());
    StreamDecoder stream(**t, /*skip_special_tokens=*/true);
    std::string streamed;
    for (int32_t id : ids_bos) streamed += stream.Push(id).value();
    streamed += stream.Finish();
    EXPECT_EQ(streamed, v["decoded_bos_skip"].get<std::string>());
    for (int32_t id : ids) byte_fallbacks += (*t)->TokenBytes(id, false).size() == 1 && id < 259;
  }
  EXPECT_GT(byte_fallbacks, 5) << "the texts should reach the <0xXX> tokens";
}

// The same model behind a Metaspace pre-tokenizer, as newer Llama / Mistral
// files have it: prepend_scheme "first" (only at the start of the text, not
// after an added token) without split, and "always" with split and a
// Metaspace decoder; ids and decodes from tokenizers 0.23.3.
TEST(Tokenizer, MetaspaceMatchesHuggingFace) {
  const json base = json::parse(std::ifstream(testing::FixturesDir() + "/sp_bpe/tokenizer.json"));
  const json all =
      json::parse(std::ifstream(testing::FixturesDir() + "/sp_bpe/metaspace_vectors.json"));
  ASSERT_EQ(all.size(), 2u);
  for (const auto& variant : all) {
    json j = base;
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = variant["pre_tokenizer"];
    j["decoder"] = variant["decoder"];
    SCOPED_TRACE(variant["pre_tokenizer"].dump());
    auto t = Tokenizer::FromJson(j.dump(), "t.json");
    ASSERT_TRUE(t.ok()) << t.status();
    for (const auto& c : variant["cases"]) {
      const std::string text = c["text"].get<std::string>();
      SCOPED_TRACE(text);
      EXPECT_EQ((*t)->Encode(text).value(), c["ids"].get<std::vector<int32_t>>());
      const auto ids_bos = c["ids_bos"].get<std::vector<int32_t>>();
      EXPECT_EQ((*t)->Encode(text, /*add_special_tokens=*/true).value(), ids_bos);
      EXPECT_EQ((*t)->Decode(ids_bos, /*skip_special_tokens=*/true).value(),
                c["decoded_bos_skip"].get<std::string>());
      EXPECT_EQ((*t)->Decode(ids_bos).value(), c["decoded_bos_keep"].get<std::string>());
    }
  }
}

// A pre-tokenizer regex that PCRE2 gives up on (its match limit) is an
// error naming the pre-tokenizer, not a silent split that changes the ids.
TEST(Tokenizer, RegexMatchLimitIsAnError) {
  auto t = Tokenizer::FromJson(
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}},
          "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a|aa)+b"},
                            "behavior": "Isolated"}})",
      "t.json");
  ASSERT_TRUE(t.ok()) << t.status();
  auto ok = (*t)->Encode("aabc");
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto ids = (*t)->Encode(std::string(60, 'a') + "cb");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
  EXPECT_THAT(std::string(ids.status().message()),
              HasSubstr("t.json: pre_tokenizer Split: the text cannot be split at byte 0"));
}

TEST(Utf8, MaximalSubpartReplacement) {
  const std::string r = "\xef\xbf\xbd";
  EXPECT_EQ(SanitizeUtf8("ok"), "ok");
  EXPECT_EQ(SanitizeUtf8("a\x80z"), "a" + r + "z");
  EXPECT_EQ(SanitizeUtf8("\xe2\x82z"), r + "z");       // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(SanitizeUtf8("\xed\xa0\x80"), r + r + r);  // surrogate: each byte replaced
  EXPECT_EQ(SanitizeUtf8("\xf0\x9f\x98"), r);          // truncated at end
  size_t held = 0;
  EXPECT_EQ(SanitizeUtf8("x\xf0\x9f\x98", true, &held), "x");
  EXPECT_EQ(held, 3u);
  EXPECT_EQ(SanitizeUtf8("\xc0\xaf"), r + r);  // overlong
}

}  // namespace
}  // namespace hmoe
