#include "common/text/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hmoe {
namespace {

struct CombiningRun {
  uint32_t first, last;
  uint8_t ccc;
};
struct Decomposition {
  uint32_t cp;
  uint8_t len;
  uint32_t to[4];
};
struct Composition {
  uint32_t first, second, composite;
};

#include "common/text/unicode_nfc_tables.inc"

// Hangul syllables (Unicode ch. 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

int Ccc(uint32_t cp) {
  if (cp < 0x300) return 0;
  const auto* end = std::end(kCombiningRuns);
  const auto* it = std::upper_bound(std::begin(kCombiningRuns), end, cp,
                                    [](uint32_t c, const CombiningRun& r) { return c < r.first; });
  if (it == std::begin(kCombiningRuns)) return 0;
  --it;
  return cp <= it->last ? it->ccc : 0;
}

void Decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (cp >= 0xC0) {
    const auto* end = std::end(kDecompositions);
    const auto* it = std::lower_bound(std::begin(kDecompositions), end, cp,
                                      [](const Decomposition& d, uint32_t c) { return d.cp < c; });
    if (it != end && it->cp == cp) {
      out.insert(out.end(), it->to, it->to + it->len);
      return;
    }
  }
  out.push_back(cp);
}

// The primary composite of (a, b), or 0.
uint32_t Compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* end = std::end(kCompositions);
  const auto* it =
      std::lower_bound(std::begin(kCompositions), end, std::make_pair(a, b),
                       [](const Composition& c, const std::pair<uint32_t, uint32_t>& k) {
                         return c.first != k.first ? c.first < k.first : c.second < k.second;
                       });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

std::vector<uint32_t> DecodeUtf8(absl::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[k])); };
    const uint32_t c = b(i);
    size_t n = c < 0x80 ? 1 : c >= 0xF8 ? 0 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    bool ok = n > 0 && i + n <= s.size();
    for (size_t k = 1; ok && k < n; ++k) ok = (b(i + k) & 0xC0) == 0x80;
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (b(i + k) & 0x3F);
    // Overlong forms, surrogates and code points past U+10FFFF are invalid.
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += n;
  }
  return out;
}

std::string EncodeUtf8(const std::vector<uint32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (uint32_t cp : cps) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

bool IsAscii(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; });
}

// Full canonical decomposition, then the canonical ordering of every run of
// non-starters (a stable sort by combining class).
std::vector<uint32_t> Nfd(absl::string_view text) {
  std::vector<uint32_t> d;
  d.reserve(text.size());
  for (uint32_t cp : DecodeUtf8(text)) Decompose(cp, d);
  for (size_t i = 0; i < d.size();) {
    if (Ccc(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && Ccc(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + static_cast<long>(i), d.begin() + static_cast<long>(j),
                     [](uint32_t a, uint32_t b) { return Ccc(a) < Ccc(b); });
    i = j;
  }
  return d;
}

}  // namespace

std::string NormalizeNfd(absl::string_view text) {
  if (IsAscii(text)) return std::string(text);
  return EncodeUtf8(Nfd(text));
}

std::string NormalizeNfc(absl::string_view text) {
  if (IsAscii(text)) return std::string(text);
  const std::vector<uint32_t> d = Nfd(text);
  // Canonical composition: each character joins the last starter unless a
  // character between them blocks it (class 0, or a class >= its own).
  std::vector<uint32_t> out;
  out.reserve(d.size());
  size_t starter = 0;
  bool have_starter = false;
  int last_ccc = 0;
  for (uint32_t ch : d) {
    const int c = Ccc(ch);
    if (have_starter) {
      const bool adjacent = out.size() == starter + 1;
      if (adjacent || (last_ccc != 0 && last_ccc < c)) {
        if (const uint32_t comp = Compose(out[starter], ch); comp != 0) {
          out[starter] = comp;
          continue;
        }
      }
    }
    if (c == 0) {
      starter = out.size();
      have_starter = true;
    }
    last_ccc = c;
    out.push_back(ch);
  }
  return EncodeUtf8(out);
}

const char* UnicodeNfcVersion() { return kUnicodeVersion; }

}  // namespace hmoe
