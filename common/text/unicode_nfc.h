// Unicode normalization forms C and D (UAX #15, canonical only) of UTF-8
// text, as Hugging Face tokenizers' "NFC" / "NFD" normalizers apply them.
// The tables (unicode_nfc_tables.inc) are generated from Python's
// unicodedata by gen_unicode_nfc_tables.py; Hangul is algorithmic.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace hmoe {

// `text` is valid UTF-8 (the tokenizer checks first); an invalid byte is
// carried through as U+FFFD. ASCII text is returned unchanged at once.
std::string NormalizeNfc(absl::string_view text);
std::string NormalizeNfd(absl::string_view text);

// The Unicode version of the tables, e.g. "14.0.0".
const char* UnicodeNfcVersion();

}  // namespace hmoe
