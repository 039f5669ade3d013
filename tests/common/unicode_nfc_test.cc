#include "common/text/unicode_nfc.h"

#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace hmoe {
namespace {

// Every code point with a canonical decomposition or a combining class,
// Hangul, and 4000 random mixes of them: NFC and NFD as Python's
// unicodedata computes them (tests/fixtures/make_unicode_vectors.py).
TEST(UnicodeNfc, MatchesPythonUnicodedata) {
  const auto v =
      nlohmann::json::parse(std::ifstream(testing::FixturesDir() + "/unicode_nfc_vectors.json"));
  EXPECT_EQ(v["unicode_version"].get<std::string>(), UnicodeNfcVersion())
      << "regenerate the fixture and the tables from the same Python";
  int n = 0, changed = 0;
  for (const auto& c : v["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::string nfc = c["nfc"].get<std::string>(), nfd = c["nfd"].get<std::string>();
    EXPECT_EQ(NormalizeNfc(text), nfc) << "NFC of " << text;
    EXPECT_EQ(NormalizeNfd(text), nfd) << "NFD of " << text;
    changed += nfc != text;
    ++n;
  }
  EXPECT_GT(n, 7000);
  EXPECT_GT(changed, 2500) << "many cases should be ones NFC changes";
}

TEST(UnicodeNfc, NamedCases) {
  EXPECT_EQ(NormalizeNfc("plain ascii"), "plain ascii");
  EXPECT_EQ(NormalizeNfc("cafe\xcc\x81"), "caf\xc3\xa9");  // e + U+0301 -> U+00E9
  EXPECT_EQ(NormalizeNfd("caf\xc3\xa9"), "cafe\xcc\x81");
  EXPECT_EQ(NormalizeNfc("\xe2\x84\xab"), "\xc3\x85");             // U+212B (singleton) -> U+00C5
  EXPECT_EQ(NormalizeNfc("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8"),  // jamo L V T -> U+AC01
            "\xea\xb0\x81");
  EXPECT_EQ(NormalizeNfc("\xe0\xa5\x98"), "\xe0\xa4\x95\xe0\xa4\xbc");  // U+0958: excluded
  // Marks reordered by class before composing: a + U+0302 + U+0323 -> U+1EAD.
  EXPECT_EQ(NormalizeNfc("a\xcc\x82\xcc\xa3"), "\xe1\xba\xad");
  EXPECT_EQ(NormalizeNfc("\xff"), "\xef\xbf\xbd");  // invalid byte: U+FFFD
}

}  // namespace
}  // namespace hmoe
