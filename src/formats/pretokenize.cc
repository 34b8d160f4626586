// Normalizers, pre-tokenizers and decoders of the tokenizer pipeline.
//
// The regex pre-tokenizers are scanners written from the patterns, alternative by
// alternative, with the leftmost-first semantics of the backtracking engine the tokenizers
// library uses (Oniguruma): at each position the first alternative that matches wins, even
// when a later one would match more. Comments give each alternative and how backtracking
// resolves it.
#include <algorithm>
#include <cctype>
#include <string>

#include "fuyou/error.h"
#include "src/formats/tokenizer_impl.h"
#include "src/formats/unicode.h"

namespace fuyou::tok {
namespace {

using Ranges = std::vector<std::pair<size_t, size_t>>;

// The input as code points with their byte offsets (off has one more entry: the end).
struct Cps {
  std::vector<uint32_t> cp;
  std::vector<size_t> off;
  explicit Cps(std::string_view s) {
    for (size_t i = 0; i < s.size();) {
      size_t len;
      cp.push_back(unicode::decode(s, i, &len));
      off.push_back(i);
      i += len;
    }
    off.push_back(s.size());
  }
  size_t size() const { return cp.size(); }
};

bool is_ws(uint32_t c) { return unicode::is_whitespace(c); }
bool is_l(uint32_t c) { return unicode::is_letter(c); }
bool is_n(uint32_t c) { return unicode::is_number(c); }
bool is_other(uint32_t c) { return !is_ws(c) && !is_l(c) && !is_n(c); }  // [^\s\p{L}\p{N}]
bool is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }

template <typename Pred>
size_t run_end(const Cps& t, size_t i, Pred pred) {
  while (i < t.size() && pred(t.cp[i])) ++i;
  return i;
}

// Length of a contraction at i ('s 't 're 've 'm 'll 'd), 0 if none. With `fold`, letters
// match case-insensitively as under (?i), where Unicode folding also maps U+017F (long s) to s.
size_t contraction(const Cps& t, size_t i, bool fold) {
  if (t.cp[i] != '\'' || i + 1 >= t.size()) return 0;
  auto low = [&](size_t k) -> uint32_t {
    if (k >= t.size()) return 0;
    uint32_t c = t.cp[k];
    if (!fold) return c;
    if (c == 0x17F) return 's';
    return c < 0x80 && c >= 'A' && c <= 'Z' ? c + 32 : c;
  };
  uint32_t a = low(i + 1), b = low(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at a whitespace position: the run, less its last character when a
// non-space follows and the run has two or more characters (that last space then starts
// the next piece, " word").
size_t whitespace_tail(const Cps& t, size_t i) {
  size_t j = run_end(t, i, is_ws);
  if (j == t.size() || j - i < 2) return j;
  return j - 1;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t gpt2_match(const Cps& t, size_t i) {
  if (size_t c = contraction(t, i, false)) return i + c;
  const bool space = t.cp[i] == ' ' && i + 1 < t.size();
  for (auto cls : {is_l, is_n, is_other}) {
    if (cls(t.cp[i])) return run_end(t, i, cls);
    if (space && cls(t.cp[i + 1])) return run_end(t, i + 1, cls);
  }
  return whitespace_tail(t, i);  // only whitespace is left
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+        with D = 3 (Llama 3, cl100k) or 1 (Qwen2)
size_t llama3_match(const Cps& t, size_t i, size_t max_digits) {
  const size_t n = t.size();
  if (size_t c = contraction(t, i, true)) return i + c;
  const uint32_t c0 = t.cp[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+: one optional leading character of any other kind (space,
  // punctuation, tab), then letters.
  if (is_l(c0)) return run_end(t, i, is_l);
  if (!is_crlf(c0) && !is_n(c0) && i + 1 < n && is_l(t.cp[i + 1])) return run_end(t, i + 1, is_l);
  if (is_n(c0)) return std::min(run_end(t, i, is_n), i + max_digits);
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t k = i;
  if (c0 == ' ' && k + 1 < n && is_other(t.cp[k + 1])) ++k;
  if (is_other(t.cp[k])) return run_end(t, run_end(t, k, is_other), is_crlf);
  // Only whitespace is left. \s*[\r\n]+: the greedy \s* gives back characters until
  // [\r\n]+ can match, so the match ends after the run's last \r or \n.
  size_t j = run_end(t, i, is_ws);
  for (size_t e = j; e > i; --e)
    if (is_crlf(t.cp[e - 1])) return e;
  return whitespace_tail(t, i);
}

}  // namespace

Ranges regex_matches(Pattern p, std::string_view s) {
  Cps t(s);
  Ranges out;
  for (size_t i = 0; i < t.size();) {
    size_t j =
        p == Pattern::kGpt2 ? gpt2_match(t, i) : llama3_match(t, i, p == Pattern::kQwen2 ? 1 : 3);
    FY_CHECK(j > i, "pre-tokenizer scanner made no progress at ", i);
    out.emplace_back(t.off[i], t.off[j]);
    i = j;
  }
  return out;
}

namespace {

Ranges literal_matches(std::string_view s, std::string_view lit) {
  Ranges out;
  if (lit.empty()) return out;
  for (size_t i = s.find(lit); i != std::string_view::npos; i = s.find(lit, i + lit.size()))
    out.emplace_back(i, i + lit.size());
  return out;
}

Ranges digit_matches(std::string_view s) {
  Cps t(s);
  Ranges out;
  for (size_t i = 0; i < t.size(); ++i)
    if (is_n(t.cp[i])) out.emplace_back(t.off[i], t.off[i + 1]);
  return out;
}

// Splits `piece` around `matches` the way NormalizedString::split does for each behavior.
// Empty pieces are dropped, as PreTokenizedString::split drops them.
void split_piece(const Piece& piece, const Ranges& matches, SplitBehavior behavior, bool invert,
                 std::vector<Piece>* out) {
  struct Part {
    size_t b, e;
    bool match;
  };
  std::vector<Part> parts;
  size_t pos = 0;
  for (auto [b, e] : matches) {
    if (b > pos) parts.push_back({pos, b, false});
    parts.push_back({b, e, true});
    pos = e;
  }
  if (pos < piece.text.size()) parts.push_back({pos, piece.text.size(), false});
  if (invert)
    for (auto& p : parts) p.match = !p.match;
  std::vector<std::pair<size_t, size_t>> kept;
  bool prev = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (auto& p : parts) kept.emplace_back(p.b, p.e);
      break;
    case SplitBehavior::kRemoved:
      for (auto& p : parts)
        if (!p.match) kept.emplace_back(p.b, p.e);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (auto& p : parts) {
        if (p.match && !prev && !kept.empty())
          kept.back().second = p.e;
        else
          kept.emplace_back(p.b, p.e);
        prev = p.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !prev && !kept.empty())
          kept.back().first = it->b;
        else
          kept.emplace_back(it->b, it->e);
        prev = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (auto& p : parts) {
        if (p.match && prev && !kept.empty())
          kept.back().second = p.e;
        else
          kept.emplace_back(p.b, p.e);
        prev = p.match;
      }
      break;
  }
  for (auto [b, e] : kept)
    if (e > b) out->push_back({piece.text.substr(b, e - b), piece.at_start && b == 0});
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  for (size_t i = s.find(from); i != std::string::npos; i = s.find(from, pos)) {
    out.append(s, pos, i - pos);
    out += to;
    pos = i + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

struct ByteTable {
  std::string to_char[256];
  int from_char[512];
  ByteTable() {
    // GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves; the others
    // (controls, space, soft hyphen...) take the code points from U+0100 up, in byte order,
    // so every byte becomes a visible character and BPE never sees whitespace or controls.
    std::fill(std::begin(from_char), std::end(from_char), -1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      int cp = printable ? b : next++;
      unicode::append_utf8(&to_char[b], static_cast<uint32_t>(cp));
      from_char[cp] = b;
    }
  }
};

const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

}  // namespace

const std::string& byte_to_char(uint8_t b) { return byte_table().to_char[b]; }

int char_to_byte(uint32_t cp) { return cp < 512 ? byte_table().from_char[cp] : -1; }

std::string normalize(const std::vector<NormalizerStep>& steps, std::string s) {
  const size_t input = s.size(), limit = kNormalizedGrowth * input + kNormalizedSlack;
  auto bound = [&](const NormalizerStep& st, size_t bytes) {
    if (bytes <= limit) return;
    const char* names[] = {"Prepend", "Replace", "NFC", "NFD", "Strip"};
    throw ConfigError(
        str(st.where, " (", names[st.kind],
            st.kind == NormalizerStep::kReplace
                ? str(" of '", printable(st.a, 20), "' by ", st.b.size(), " bytes")
                : std::string(),
            "): the text grows from ", input, " to ", bytes, " bytes, beyond the limit of ",
            kNormalizedGrowth, " x the input + ", kNormalizedSlack,
            " bytes (the normalizer multiplies its input; is this the right tokenizer.json?)"));
  };
  for (const auto& st : steps) {
    switch (st.kind) {
      case NormalizerStep::kPrepend:
        bound(st, s.size() + st.a.size());
        if (!s.empty()) s = st.a + s;
        break;
      case NormalizerStep::kReplace: {
        size_t count = 0;
        for (size_t i = s.find(st.a); i != std::string::npos; i = s.find(st.a, i + st.a.size()))
          ++count;
        bound(st, s.size() - count * st.a.size() + count * st.b.size());
        s = replace_all(std::move(s), st.a, st.b);
        break;
      }
      case NormalizerStep::kNfc:
        s = unicode::nfc(s);
        bound(st, s.size());
        break;
      case NormalizerStep::kNfd:
        s = unicode::nfd(s);
        bound(st, s.size());
        break;
      case NormalizerStep::kStrip: {
        Cps t(s);
        size_t b = 0, e = t.size();
        if (st.left)
          while (b < e && is_ws(t.cp[b])) ++b;
        if (st.right)
          while (e > b && is_ws(t.cp[e - 1])) --e;
        s = s.substr(t.off[b], t.off[e] - t.off[b]);
        break;
      }
    }
  }
  return s;
}

void pre_tokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>* pieces) {
  for (const auto& st : steps) {
    std::vector<Piece> next;
    for (Piece& p : *pieces) {
      switch (st.kind) {
        case PreTokenizerStep::kByteLevel: {
          // Each piece separately: the prefix space goes on every piece the steps before
          // produced, as the library does.
          if (st.add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text = " " + p.text;
          std::vector<Piece> parts;
          if (st.use_regex)
            split_piece(p, regex_matches(Pattern::kGpt2, p.text), SplitBehavior::kIsolated, false,
                        &parts);
          else if (!p.text.empty())
            parts.push_back(p);
          for (Piece& q : parts) {
            std::string mapped;
            mapped.reserve(q.text.size() * 2);
            for (unsigned char b : q.text) mapped += byte_to_char(b);
            next.push_back({std::move(mapped), q.at_start});
          }
          break;
        }
        case PreTokenizerStep::kSplit: {
          Ranges m = st.pattern == Pattern::kString ? literal_matches(p.text, st.literal)
                                                    : regex_matches(st.pattern, p.text);
          split_piece(p, m, st.behavior, st.invert, &next);
          break;
        }
        case PreTokenizerStep::kMetaspace: {
          p.text = replace_all(std::move(p.text), " ", st.replacement);
          bool prepend = st.prepend == PreTokenizerStep::Prepend::kAlways ||
                         (st.prepend == PreTokenizerStep::Prepend::kFirst && p.at_start);
          if (prepend && p.text.compare(0, st.replacement.size(), st.replacement) != 0)
            p.text = st.replacement + p.text;
          if (st.split)
            split_piece(p, literal_matches(p.text, st.replacement), SplitBehavior::kMergedWithNext,
                        false, &next);
          else if (!p.text.empty())
            next.push_back(std::move(p));
          break;
        }
        case PreTokenizerStep::kDigits:
          split_piece(p, digit_matches(p.text),
                      st.individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous,
                      false, &next);
          break;
      }
    }
    *pieces = std::move(next);
  }
}

namespace {

// String::from_utf8_lossy: each maximal prefix of an invalid sequence becomes one U+FFFD.
std::string lossy_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    if (unicode::decode(s, i, &len) != unicode::kInvalid) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    unsigned char c = p[i];
    size_t need = c >= 0xC2 && c <= 0xDF   ? 2
                  : c >= 0xE0 && c <= 0xEF ? 3
                  : c >= 0xF0 && c <= 0xF4 ? 4
                                           : 1;
    size_t k = 1;
    while (k < need && i + k < s.size()) {
      unsigned char d = p[i + k];
      unsigned char lo = 0x80, hi = 0xBF;
      if (k == 1) {
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
      }
      if (d < lo || d > hi) break;
      ++k;
    }
    out += "\xef\xbf\xbd";
    i += k;
  }
  return out;
}

}  // namespace

std::string decode_tokens(const std::vector<DecoderStep>& steps, std::vector<std::string> tokens,
                          bool have_decoder) {
  if (!have_decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const auto& st : steps) {
    std::vector<std::string> next;
    switch (st.kind) {
      case DecoderStep::kByteLevel: {
        std::string bytes;
        for (const auto& t : tokens) {
          std::string mapped;
          bool ok = true;
          for (size_t i = 0; i < t.size() && ok;) {
            size_t len;
            int b = char_to_byte(unicode::decode(t, i, &len));
            if (b < 0)
              ok = false;
            else
              mapped += static_cast<char>(b);
            i += len;
          }
          bytes += ok ? mapped : t;  // a token outside the byte alphabet stays as written
        }
        next.push_back(lossy_utf8(bytes));
        break;
      }
      case DecoderStep::kReplace:
        for (auto& t : tokens) next.push_back(replace_all(std::move(t), st.a, st.b));
        break;
      case DecoderStep::kByteFallback: {
        std::string pending;
        size_t pending_count = 0;
        auto flush = [&] {
          if (!pending_count) return;
          if (unicode::valid_utf8(pending)) {
            next.push_back(pending);
          } else {
            for (size_t k = 0; k < pending_count; ++k) next.push_back("\xef\xbf\xbd");
          }
          pending.clear();
          pending_count = 0;
        };
        for (auto& t : tokens) {
          auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && hex(t[3]) &&
              hex(t[4])) {
            pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++pending_count;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case DecoderStep::kFuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        next.push_back(std::move(all));
        break;
      }
      case DecoderStep::kStrip:
        for (auto& t : tokens) {
          Cps c(t);
          size_t b = 0, e = c.size();
          std::string_view ch = st.a;
          auto is = [&](size_t k) { return t.compare(c.off[k], c.off[k + 1] - c.off[k], ch) == 0; };
          for (int k = 0; k < st.start && b < e && is(b); ++k) ++b;
          for (int k = 0; k < st.stop && e > b && is(e - 1); ++k) --e;
          next.push_back(t.substr(c.off[b], c.off[e] - c.off[b]));
        }
        break;
      case DecoderStep::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i)
          next.push_back(replace_all(std::move(tokens[i]), st.a, i == 0 && st.prepend ? "" : " "));
        break;
    }
    tokens = std::move(next);
  }
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

}  // namespace fuyou::tok
