// The bits of Unicode the tokenizer needs, without a library: UTF-8 decoding that never
// fails (an invalid byte decodes as itself, flagged, so byte-level tokenizers keep every
// input byte), the \p{L} / \p{N} / \s classes of the pre-tokenizer regexes, and NFC / NFD.
// Tables are generated into unicode_tables.cc by tests/reference/gen_unicode_tables.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fuyou::unicode {

struct Range {
  uint32_t lo, hi;  // inclusive
};
struct CccRange {
  uint32_t lo, hi;
  uint8_t ccc;
};
struct Decomposition {
  uint32_t cp;
  uint32_t first;
  uint32_t second;   // 0 for a singleton mapping
  uint8_t composes;  // a primary composite: NFC recomposes first + second into cp
};

extern const char* const kUnicodeVersion;
extern const Range kLetterRanges[];
extern const size_t kLetterRangesCount;
extern const Range kNumberRanges[];
extern const size_t kNumberRangesCount;
extern const CccRange kCombiningRanges[];
extern const size_t kCombiningRangesCount;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionsCount;

// A code point marking an invalid UTF-8 byte: outside Unicode, so it is in no class.
constexpr uint32_t kInvalid = 0x110000;

// Decodes the code point at s[i]; sets *len to its byte length (1 for an invalid byte,
// which returns kInvalid).
uint32_t decode(std::string_view s, size_t i, size_t* len);
void append_utf8(std::string* out, uint32_t cp);
bool valid_utf8(std::string_view s);

bool is_letter(uint32_t cp);      // \p{L}
bool is_number(uint32_t cp);      // \p{N}
bool is_whitespace(uint32_t cp);  // \s (White_Space, as Oniguruma's \s in Unicode mode)
uint8_t combining_class(uint32_t cp);

// Canonical normalization forms of valid UTF-8 (invalid bytes pass through unchanged).
std::string nfd(std::string_view s);
std::string nfc(std::string_view s);

}  // namespace fuyou::unicode
