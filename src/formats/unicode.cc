#include "src/formats/unicode.h"

#include <algorithm>
#include <unordered_map>
#include <vector>

namespace fuyou::unicode {
namespace {

// Hangul syllables compose and decompose by arithmetic (Unicode chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

template <typename R>
const R* find_range(const R* table, size_t n, uint32_t cp) {
  const R* end = table + n;
  const R* it = std::upper_bound(table, end, cp, [](uint32_t c, const R& r) { return c < r.lo; });
  if (it == table) return nullptr;
  --it;
  return cp <= it->hi ? it : nullptr;
}

struct Tables {
  std::unordered_map<uint32_t, const Decomposition*> decomp;
  std::unordered_map<uint64_t, uint32_t> compose;
  Tables() {
    decomp.reserve(kDecompositionsCount);
    for (size_t i = 0; i < kDecompositionsCount; ++i) {
      const Decomposition& d = kDecompositions[i];
      decomp[d.cp] = &d;
      if (d.composes) compose[uint64_t{d.first} << 32 | d.second] = d.cp;
    }
  }
};

const Tables& tables() {
  static const Tables t;  // immutable after construction; built on first use
  return t;
}

void decompose_into(uint32_t cp, std::vector<uint32_t>* out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out->push_back(kTBase + s % kTCount);
    return;
  }
  const auto& t = tables().decomp;
  auto it = t.find(cp);
  if (it == t.end()) {
    out->push_back(cp);
    return;
  }
  decompose_into(it->second->first, out);
  if (it->second->second) decompose_into(it->second->second, out);
}

// Full canonical decomposition, then canonical ordering: a stable sort by combining class
// of every run of non-starters.
std::vector<uint32_t> decomposed(std::string_view s) {
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = decode(s, i, &len);
    i += len;
    if (cp == kInvalid) {
      cps.push_back(kInvalid + static_cast<unsigned char>(s[i - 1]));  // carries the byte
      continue;
    }
    decompose_into(cp, &cps);
  }
  for (size_t i = 0; i < cps.size();) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j, [](uint32_t a, uint32_t b) {
      return combining_class(a) < combining_class(b);
    });
    i = j;
  }
  return cps;
}

std::string encode(const std::vector<uint32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (uint32_t cp : cps) {
    if (cp >= kInvalid)
      out += static_cast<char>(cp - kInvalid);
    else
      append_utf8(&out, cp);
  }
  return out;
}

uint32_t compose_pair(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto& c = tables().compose;
  auto it = c.find(uint64_t{a} << 32 | b);
  return it == c.end() ? 0 : it->second;
}

}  // namespace

uint32_t decode(std::string_view s, size_t i, size_t* len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  const size_t left = s.size() - i;
  unsigned char c = p[0];
  *len = 1;
  if (c < 0x80) return c;
  size_t n;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0)
    n = 2, cp = c & 0x1F, min = 0x80;
  else if ((c & 0xF0) == 0xE0)
    n = 3, cp = c & 0x0F, min = 0x800;
  else if ((c & 0xF8) == 0xF0)
    n = 4, cp = c & 0x07, min = 0x10000;
  else
    return kInvalid;
  if (left < n) return kInvalid;
  for (size_t k = 1; k < n; ++k) {
    if ((p[k] & 0xC0) != 0x80) return kInvalid;
    cp = cp << 6 | (p[k] & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  *len = n;
  return cp;
}

void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | cp >> 6);
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | cp >> 12);
    *out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | cp >> 18);
    *out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
    *out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t len;
    if (decode(s, i, &len) == kInvalid) return false;
    i += len;
  }
  return true;
}

bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return find_range(kLetterRanges, kLetterRangesCount, cp) != nullptr;
}

bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return find_range(kNumberRanges, kNumberRangesCount, cp) != nullptr;
}

bool is_whitespace(uint32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const CccRange* r = find_range(kCombiningRanges, kCombiningRangesCount, cp);
  return r ? r->ccc : 0;
}

std::string nfd(std::string_view s) { return encode(decomposed(s)); }

std::string nfc(std::string_view s) {
  // Canonical composition (UAX #15): each character combines with the last starter unless a
  // character between them is a starter or has a combining class >= its own.
  std::vector<uint32_t> cps = decomposed(s);
  std::vector<uint32_t> out;
  out.reserve(cps.size());
  long starter = -1;    // index in `out` of the last starter
  int last_class = -1;  // class of the last character after it; -1: none (adjacent)
  for (uint32_t cp : cps) {
    const int cc = cp >= kInvalid ? 0 : combining_class(cp);
    if (starter >= 0 && cp < kInvalid && (last_class == -1 || last_class < cc)) {
      if (uint32_t c = compose_pair(out[starter], cp)) {
        out[starter] = c;
        continue;
      }
    }
    out.push_back(cp);
    if (cc == 0) {
      starter = static_cast<long>(out.size()) - 1;
      last_class = -1;
    } else {
      last_class = cc;
    }
  }
  return encode(out);
}

}  // namespace fuyou::unicode
