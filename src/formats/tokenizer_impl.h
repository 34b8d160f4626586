// The tokenizer pipeline's parts, as the tokenizers library runs them: added tokens split
// out first, then normalizer, pre-tokenizer, BPE model per piece; and the decoder.
// tokenizer.cc parses tokenizer.json into these; pretokenize.cc and bpe.cc run them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fuyou/tokenizer.h"

namespace fuyou::tok {

// ---- normalizers ----------------------------------------------------------------------
struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kNfc, kNfd, kStrip } kind;
  std::string a;                     // Prepend: prefix; Replace: pattern
  std::string b;                     // Replace: content
  bool left = false, right = false;  // Strip
  std::string where;                 // "FILE: normalizer.normalizers[2]", for errors
};
// The normalized text of one input. Replace and Prepend can make it longer, and a Sequence of
// Replaces multiplies (x60 per step for a one-byte pattern and a 60-byte content): each step's
// output is bounded by kNormalizedGrowth x the input's bytes + kNormalizedSlack, checked
// before it is built; ConfigError naming the step otherwise.
inline constexpr size_t kNormalizedGrowth = 64;
inline constexpr size_t kNormalizedSlack = 4096;
std::string normalize(const std::vector<NormalizerStep>& steps, std::string s);

// ---- pre-tokenizers -------------------------------------------------------------------
// The regexes recognised by their exact text.
enum class Pattern { kGpt2, kLlama3, kQwen2, kString };
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum Kind { kByteLevel, kSplit, kMetaspace, kDigits } kind;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Split
  Pattern pattern = Pattern::kGpt2;
  std::string literal;  // kString pattern
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // Metaspace
  std::string replacement = "\xe2\x96\x81";  // U+2581
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = true;
  // Digits
  bool individual_digits = false;
};

// A piece of text on its way to the model, with whether it starts the original input (what
// Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  bool at_start = false;
};
void pre_tokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>* pieces);

// Byte ranges [begin, end) of the matches of one of the recognised regexes in `s`.
std::vector<std::pair<size_t, size_t>> regex_matches(Pattern p, std::string_view s);
// GPT-2's byte <-> printable character table (bytes_to_unicode).
const std::string& byte_to_char(uint8_t b);  // UTF-8 of the character for byte b
int char_to_byte(uint32_t cp);               // -1 when cp is not in the table

// ---- BPE model ------------------------------------------------------------------------
struct BpeModel {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // by id; empty strings for unused ids
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id)
  int32_t unk_id = -1;                         // -1: no unk token
  std::string unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  int32_t byte_ids[256];  // "<0xXX>" ids for byte fallback, -1 when absent

  void tokenize(std::string_view piece, std::vector<int32_t>* out) const;
};

// ---- decoders -------------------------------------------------------------------------
struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // Replace pattern/content; Strip/Metaspace character
  int start = 0, stop = 0;
  bool prepend = true;  // Metaspace: drop the replacement in the first token
};
std::string decode_tokens(const std::vector<DecoderStep>& steps, std::vector<std::string> tokens,
                          bool have_decoder);

// ---- added tokens ---------------------------------------------------------------------
struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

}  // namespace fuyou::tok

namespace fuyou {

struct Tokenizer::Impl {
  std::string source;
  tok::BpeModel model;
  std::vector<tok::NormalizerStep> normalizer;
  std::vector<tok::PreTokenizerStep> pre_tokenizer;
  std::vector<tok::DecoderStep> decoder;
  bool have_decoder = false;
  std::vector<tok::AddedToken> added;
  // Matching forms of the added tokens: the content for normalized=false ones (matched in
  // the raw text), the normalized content for the others (matched after normalization).
  std::vector<std::pair<std::string, size_t>> raw_patterns, normalized_patterns;
  std::unordered_map<int32_t, size_t> added_by_id;
  uint32_t vocab_size = 0;
  std::string description;
};

}  // namespace fuyou
