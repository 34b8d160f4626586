// tokenizer.json parsing and the encode / decode pipeline.
#include "fuyou/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "src/formats/tokenizer_impl.h"
#include "src/formats/unicode.h"

namespace fuyou {
namespace {

using json = nlohmann::json;
using tok::DecoderStep;
using tok::NormalizerStep;
using tok::PreTokenizerStep;

// The regex texts recognised, exactly as tokenizer.json carries them (after JSON unescaping).
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Field access that names the file and the JSON path in every error.
class Node {
 public:
  Node(const json& j, std::string path, const std::string& source)
      : j_(j), path_(std::move(path)), source_(source) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw ConfigError(str(source_, ": ", path_.empty() ? "top level" : path_, ": ", why));
  }
  const json& raw() const { return j_; }
  const std::string& path() const { return path_; }
  std::string where() const { return str(source_, ": ", path_.empty() ? "top level" : path_); }
  bool is_null() const { return j_.is_null(); }
  bool has(const std::string& k) const {
    return j_.is_object() && j_.contains(k) && !j_[k].is_null();
  }
  Node at(const std::string& k) const {
    if (!j_.is_object()) fail("expected an object");
    if (!j_.contains(k)) Node(json(), sub(k), source_).fail("missing");
    return Node(j_[k], sub(k), source_);
  }
  Node at(size_t i) const { return Node(j_[i], str(path_, "[", i, "]"), source_); }
  std::string string() const {
    if (!j_.is_string()) fail(str("expected a string, got ", j_.dump()));
    return j_.get<std::string>();
  }
  bool boolean() const {
    if (!j_.is_boolean()) fail(str("expected true or false, got ", j_.dump()));
    return j_.get<bool>();
  }
  int64_t integer(int64_t lo, int64_t hi) const {
    if (!j_.is_number_integer()) fail(str("expected an integer, got ", j_.dump()));
    if (j_.is_number_unsigned() && j_.get<uint64_t>() > static_cast<uint64_t>(hi))
      fail(str("value ", j_.dump(), " is not in ", lo, "..", hi));
    int64_t v = j_.get<int64_t>();
    if (v < lo || v > hi) fail(str("value ", v, " is not in ", lo, "..", hi));
    return v;
  }
  bool bool_or(const std::string& k, bool d) const { return has(k) ? at(k).boolean() : d; }
  std::string string_or(const std::string& k, const std::string& d) const {
    return has(k) ? at(k).string() : d;
  }
  size_t array_size() const {
    if (!j_.is_array()) fail("expected an array");
    return j_.size();
  }
  std::string type() const { return at("type").string(); }

 private:
  std::string sub(const std::string& k) const { return path_.empty() ? k : path_ + "." + k; }
  const json& j_;
  std::string path_;
  const std::string& source_;
};

std::string one_char(const Node& n) {
  std::string s = n.string();
  size_t len;
  if (s.empty() || unicode::decode(s, 0, &len) == unicode::kInvalid || len != s.size())
    n.fail(str("expected a single character, got '", s, "'"));
  return s;
}

// Real tokenizers nest a Sequence at most once or twice; the bound keeps a hostile file from
// recursing until the stack runs out.
constexpr int kMaxSequenceDepth = 8;

// Item i of a normalizer / pre-tokenizer / decoder Sequence. A null item is refused: the
// tokenizers library fails to load such a file, and skipping it would encode differently.
Node sequence_item(const Node& list, size_t i, int depth) {
  if (depth >= kMaxSequenceDepth)
    list.fail(str("Sequences nest more than ", kMaxSequenceDepth, " levels deep"));
  Node item = list.at(i);
  if (item.is_null()) item.fail("is null; each item of a Sequence must be an object with a type");
  if (!item.raw().is_object())
    item.fail(str("expected an object with a type, got ", item.raw().dump()));
  return item;
}

// Replace patterns: {"String": "x"} only; a regex would need an engine.
std::string string_pattern(const Node& n) {
  if (n.has("String")) return n.at("String").string();
  if (n.has("Regex"))
    n.fail(str("unsupported Replace regex '", n.at("Regex").string(), "' (only String patterns)"));
  n.fail("expected {\"String\": ...}");
}

void parse_normalizer(const Node& n, std::vector<NormalizerStep>* out, int depth = 0) {
  if (n.is_null()) return;
  std::string t = n.type();
  if (t == "Sequence") {
    Node list = n.at("normalizers");
    for (size_t i = 0; i < list.array_size(); ++i)
      parse_normalizer(sequence_item(list, i, depth), out, depth + 1);
    return;
  }
  if (t == "Prepend") {
    out->push_back({NormalizerStep::kPrepend, n.at("prepend").string(), ""});
  } else if (t == "Replace") {
    std::string from = string_pattern(n.at("pattern"));
    if (from.empty()) n.at("pattern").fail("empty pattern");
    out->push_back({NormalizerStep::kReplace, from, n.at("content").string()});
  } else if (t == "NFC") {
    out->push_back({NormalizerStep::kNfc, "", ""});
  } else if (t == "NFD") {
    out->push_back({NormalizerStep::kNfd, "", ""});
  } else if (t == "Strip") {
    NormalizerStep s{NormalizerStep::kStrip, "", ""};
    s.left = n.bool_or("strip_left", true);
    s.right = n.bool_or("strip_right", true);
    out->push_back(s);
  } else {
    n.fail(str("unsupported normalizer ", t,
               " (supported: Sequence, Prepend, Replace, NFC, NFD, Strip)"));
  }
  out->back().where = n.where();
}

tok::SplitBehavior parse_behavior(const Node& n) {
  std::string b = n.string();
  if (b == "Isolated") return tok::SplitBehavior::kIsolated;
  if (b == "Removed") return tok::SplitBehavior::kRemoved;
  if (b == "MergedWithPrevious") return tok::SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return tok::SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return tok::SplitBehavior::kContiguous;
  n.fail(str("unknown split behavior '", b, "'"));
}

void parse_pre_tokenizer(const Node& n, std::vector<PreTokenizerStep>* out, int depth = 0) {
  if (n.is_null()) return;
  std::string t = n.type();
  PreTokenizerStep s{};
  if (t == "Sequence") {
    Node list = n.at("pretokenizers");
    for (size_t i = 0; i < list.array_size(); ++i)
      parse_pre_tokenizer(sequence_item(list, i, depth), out, depth + 1);
    return;
  } else if (t == "ByteLevel") {
    s.kind = PreTokenizerStep::kByteLevel;
    s.add_prefix_space = n.bool_or("add_prefix_space", true);
    s.use_regex = n.bool_or("use_regex", true);
  } else if (t == "Split") {
    s.kind = PreTokenizerStep::kSplit;
    Node p = n.at("pattern");
    if (p.has("String")) {
      s.pattern = tok::Pattern::kString;
      s.literal = p.at("String").string();
      if (s.literal.empty()) p.fail("empty split pattern");
    } else {
      std::string re = p.at("Regex").string();
      if (re == kGpt2Regex)
        s.pattern = tok::Pattern::kGpt2;
      else if (re == kLlama3Regex)
        s.pattern = tok::Pattern::kLlama3;
      else if (re == kQwen2Regex)
        s.pattern = tok::Pattern::kQwen2;
      else
        p.fail(str("unsupported pre-tokenizer regex '", re,
                   "' (supported: the GPT-2, Llama 3 "
                   "(cl100k) and Qwen2 patterns)"));
    }
    s.behavior = parse_behavior(n.at("behavior"));
    s.invert = n.bool_or("invert", false);
  } else if (t == "Metaspace") {
    s.kind = PreTokenizerStep::kMetaspace;
    s.replacement = one_char(n.at("replacement"));
    s.split = n.bool_or("split", true);
    if (n.has("prepend_scheme")) {
      std::string ps = n.at("prepend_scheme").string();
      if (ps == "always")
        s.prepend = PreTokenizerStep::Prepend::kAlways;
      else if (ps == "first")
        s.prepend = PreTokenizerStep::Prepend::kFirst;
      else if (ps == "never")
        s.prepend = PreTokenizerStep::Prepend::kNever;
      else
        n.at("prepend_scheme").fail(str("'", ps, "' is not always, first or never"));
    } else {
      // Files from before prepend_scheme existed say add_prefix_space.
      s.prepend = n.bool_or("add_prefix_space", true) ? PreTokenizerStep::Prepend::kAlways
                                                      : PreTokenizerStep::Prepend::kNever;
    }
  } else if (t == "Digits") {
    s.kind = PreTokenizerStep::kDigits;
    s.individual_digits = n.bool_or("individual_digits", false);
  } else {
    n.fail(str("unsupported pre-tokenizer ", t,
               " (supported: Sequence, ByteLevel, Split, Metaspace, Digits)"));
  }
  out->push_back(s);
}

void parse_decoder(const Node& n, std::vector<DecoderStep>* out, int depth = 0) {
  if (n.is_null()) return;
  std::string t = n.type();
  DecoderStep s{};
  if (t == "Sequence") {
    Node list = n.at("decoders");
    for (size_t i = 0; i < list.array_size(); ++i)
      parse_decoder(sequence_item(list, i, depth), out, depth + 1);
    return;
  } else if (t == "ByteLevel") {
    s.kind = DecoderStep::kByteLevel;
  } else if (t == "Replace") {
    s.kind = DecoderStep::kReplace;
    s.a = string_pattern(n.at("pattern"));
    s.b = n.at("content").string();
  } else if (t == "ByteFallback") {
    s.kind = DecoderStep::kByteFallback;
  } else if (t == "Fuse") {
    s.kind = DecoderStep::kFuse;
  } else if (t == "Strip") {
    s.kind = DecoderStep::kStrip;
    s.a = one_char(n.at("content"));
    s.start = static_cast<int>(n.at("start").integer(0, 1 << 20));
    s.stop = static_cast<int>(n.at("stop").integer(0, 1 << 20));
  } else if (t == "Metaspace") {
    s.kind = DecoderStep::kMetaspace;
    s.a = one_char(n.at("replacement"));
    if (n.has("prepend_scheme"))
      s.prepend = n.at("prepend_scheme").string() != "never";
    else
      s.prepend = n.bool_or("add_prefix_space", true);
  } else {
    n.fail(str("unsupported decoder ", t,
               " (supported: Sequence, ByteLevel, Replace, ByteFallback, "
               "Fuse, Strip, Metaspace)"));
  }
  out->push_back(s);
}

// Ids are indices into dense tables (id -> token string), so an id far beyond the number of
// tokens would make a hostile file allocate gigabytes. Real files number their tokens from
// 0 without gaps (added tokens follow the model's vocabulary, or repeat its ids), so every
// id is below the count of vocabulary entries plus added tokens.
void parse_model(const Node& n, uint64_t id_limit, tok::BpeModel* m) {
  std::string t = n.has("type") ? n.type() : "BPE";
  if (t != "BPE") n.at("type").fail(str("unsupported model type ", t, " (supported: BPE)"));
  if (n.has("dropout")) {
    const json& d = n.at("dropout").raw();
    if (!d.is_number() || d.get<double>() != 0.0)
      n.at("dropout").fail("BPE dropout is not supported (encoding would be random)");
  }
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (n.has(k) && !n.at(k).string().empty())
      n.at(k).fail("not supported (byte-level and SentencePiece BPE do not use it)");
  m->fuse_unk = n.bool_or("fuse_unk", false);
  m->byte_fallback = n.bool_or("byte_fallback", false);
  m->ignore_merges = n.bool_or("ignore_merges", false);
  Node vocab = n.at("vocab");
  if (!vocab.raw().is_object()) vocab.fail("expected an object of token: id");
  std::vector<bool> used;
  for (auto it = vocab.raw().begin(); it != vocab.raw().end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= id_limit)
      vocab.fail(str("token '", it.key(), "' has id ", it.value().dump(),
                     "; ids are integers in 0..", id_limit - 1, " (below the ", id_limit,
                     " vocabulary entries and added tokens together)"));
    int32_t v = static_cast<int32_t>(it.value().get<uint64_t>());
    m->vocab[it.key()] = v;
    if (static_cast<size_t>(v) >= m->id_to_token.size()) {
      m->id_to_token.resize(v + 1);
      used.resize(v + 1, false);
    }
    // Two tokens with one id would decode that id as whichever came last.
    if (used[v])
      vocab.fail(str("tokens '", printable(m->id_to_token[v], 60), "' and '",
                     printable(it.key(), 60), "' both have id ", v, "; each id names one token"));
    used[v] = true;
    m->id_to_token[v] = it.key();
  }
  std::fill(std::begin(m->byte_ids), std::end(m->byte_ids), -1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = m->vocab.find(name);
    if (it != m->vocab.end()) m->byte_ids[b] = it->second;
  }
  if (n.has("unk_token")) {
    m->unk_token = n.at("unk_token").string();
    auto it = m->vocab.find(m->unk_token);
    // The library refuses to encode an unknown piece with an unk_token outside the vocabulary.
    if (it == m->vocab.end())
      n.at("unk_token").fail(str("'", printable(m->unk_token, 60), "' is not in the vocabulary"));
    m->unk_id = it->second;
  }
  Node merges = n.at("merges");
  const size_t count = merges.array_size();
  m->merges.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    Node e = merges.at(i);
    std::string a, b;
    if (e.raw().is_string()) {
      // "a b": exactly one space, as the library requires of this older form.
      std::string s = e.string();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        e.fail(str("merge '", s, "' is not two tokens separated by one space"));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      if (e.array_size() != 2) e.fail("a merge is a pair of tokens");
      a = e.at(0).string();
      b = e.at(1).string();
    }
    auto ia = m->vocab.find(a), ib = m->vocab.find(b), in = m->vocab.find(a + b);
    if (ia == m->vocab.end() || ib == m->vocab.end() || in == m->vocab.end())
      e.fail(str("merge of '", a, "' and '", b, "': '",
                 ia == m->vocab.end()   ? a
                 : ib == m->vocab.end() ? b
                                        : a + b,
                 "' is not in the vocabulary"));
    uint64_t key = static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32 |
                   static_cast<uint32_t>(ib->second);
    m->merges.emplace(
        key, tok::BpeModel::Merge{static_cast<int32_t>(i), in->second});  // first rank wins
  }
}

// Added tokens in `s`, leftmost-longest and non-overlapping, with the library's
// single_word / lstrip / rstrip adjustments. Returns segments: (text range, added index or
// npos).
struct Segment {
  size_t b, e;
  size_t added;  // index into Impl::added, npos for plain text
};

bool word_char(uint32_t cp) {
  return unicode::is_letter(cp) || unicode::is_number(cp) || cp == '_';
}

// The number of vocabulary entries plus added tokens: what every id must stay below.
uint64_t id_space(const Node& root) {
  Node model = root.at("model");
  Node vocab = model.at("vocab");
  if (!vocab.raw().is_object()) vocab.fail("expected an object of token: id");
  uint64_t n = vocab.raw().size();
  if (root.has("added_tokens")) n += root.at("added_tokens").array_size();
  if (n == 0) vocab.fail("the vocabulary is empty and there are no added tokens");
  if (n > static_cast<uint64_t>(INT32_MAX))
    vocab.fail(str(n, " tokens is more than ids can number"));
  return n;
}

// The segments of s[from, end): added tokens and the text between them. `from` is 0, or where
// a scan of the whole of `s` resumes after an added token (Encoding::splits), so that the
// segments are those of the whole past it; the text before it is still read as context (the
// character before a single_word token).
std::vector<Segment> split_added(const Tokenizer::Impl& t, std::string_view s,
                                 const std::vector<std::pair<std::string, size_t>>& patterns,
                                 size_t from = 0) {
  // Empty text has no segments at all, so nothing downstream (a prefix space, a Metaspace
  // prepend) can turn it into tokens.
  std::vector<Segment> out;
  if (s.size() <= from) return out;
  if (patterns.empty()) {
    out.push_back({from, s.size(), std::string::npos});
    return out;
  }
  // Leftmost-longest matches first, as the Aho-Corasick automaton finds them.
  std::vector<std::pair<size_t, size_t>> matches;  // (position, pattern index)
  for (size_t i = from; i < s.size();) {
    size_t best = std::string::npos, best_len = 0;
    for (size_t p = 0; p < patterns.size(); ++p) {
      const std::string& pat = patterns[p].first;
      if (pat.size() > best_len && s.compare(i, pat.size(), pat) == 0)
        best = p, best_len = pat.size();
    }
    if (best == std::string::npos) {
      ++i;
      continue;
    }
    matches.emplace_back(i, best);
    i += best_len;
  }
  auto cp_before = [&](size_t at) -> uint32_t {
    size_t k = at;
    while (k > 0 && (static_cast<unsigned char>(s[k - 1]) & 0xC0) == 0x80) --k;
    if (k > 0) --k;
    size_t len;
    return at == 0 ? 0 : unicode::decode(s, k, &len);
  };
  size_t pos = from;
  for (auto [b, p] : matches) {
    const tok::AddedToken& a = t.added[patterns[p].second];
    size_t e = b + patterns[p].first.size();
    if (b < pos) continue;  // swallowed by the previous token's rstrip
    if (a.single_word) {
      size_t len;
      bool left_ok = b == 0 || !word_char(cp_before(b));
      bool right_ok = e == s.size() || !word_char(unicode::decode(s, e, &len));
      if (!left_ok || !right_ok) continue;
    }
    if (a.lstrip)
      while (b > pos && unicode::is_whitespace(cp_before(b))) {
        size_t k = b - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        b = k;
      }
    if (a.rstrip) {
      size_t len;
      while (e < s.size() && unicode::is_whitespace(unicode::decode(s, e, &len))) e += len;
    }
    if (b > pos) out.push_back({pos, b, std::string::npos});
    out.push_back({b, e, patterns[p].second});
    pos = e;
  }
  if (pos < s.size()) out.push_back({pos, s.size(), std::string::npos});
  return out;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  // The largest released tokenizer.json files are tens of MiB.
  constexpr uint64_t kMaxTokenizerBytes = 512ull << 20;
  std::string text;
  try {
    text = read_file_bounded(path, kMaxTokenizerBytes, "tokenizer");
  } catch (const IoError& e) {
    throw ConfigError(e.what());
  }
  return from_json(text, path);
}

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(str(source, ": not valid JSON: ", e.what()));
  }
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  try {
    Node root(j, "", impl->source);
    if (!j.is_object()) root.fail("tokenizer.json must be a JSON object");
    const uint64_t id_limit = id_space(root);
    parse_model(root.at("model"), id_limit, &impl->model);
    if (root.has("normalizer")) parse_normalizer(root.at("normalizer"), &impl->normalizer);
    if (root.has("pre_tokenizer"))
      parse_pre_tokenizer(root.at("pre_tokenizer"), &impl->pre_tokenizer);
    if (root.has("decoder")) {
      impl->have_decoder = true;
      parse_decoder(root.at("decoder"), &impl->decoder);
    }
    uint32_t vocab = static_cast<uint32_t>(impl->model.id_to_token.size());
    if (root.has("added_tokens")) {
      Node list = root.at("added_tokens");
      for (size_t i = 0; i < list.array_size(); ++i) {
        Node a = list.at(i);
        tok::AddedToken t;
        t.id = static_cast<int32_t>(a.at("id").integer(0, static_cast<int64_t>(id_limit) - 1));
        t.content = a.at("content").string();
        if (t.content.empty()) a.at("content").fail("an added token cannot be empty");
        t.special = a.bool_or("special", false);
        t.single_word = a.bool_or("single_word", false);
        t.lstrip = a.bool_or("lstrip", false);
        t.rstrip = a.bool_or("rstrip", false);
        t.normalized = a.bool_or("normalized", !t.special);
        impl->added_by_id[t.id] = impl->added.size();
        impl->added.push_back(t);
        vocab = std::max(vocab, static_cast<uint32_t>(t.id) + 1);
      }
    }
    for (size_t i = 0; i < impl->added.size(); ++i) {
      const auto& t = impl->added[i];
      if (t.normalized)
        impl->normalized_patterns.emplace_back(tok::normalize(impl->normalizer, t.content), i);
      else
        impl->raw_patterns.emplace_back(t.content, i);
    }
    impl->vocab_size = vocab;
  } catch (const json::exception& e) {
    throw ConfigError(str(source, ": malformed tokenizer: ", e.what()));
  }
  std::string pre;
  for (const auto& p : impl->pre_tokenizer) {
    const char* names[] = {"ByteLevel", "Split", "Metaspace", "Digits"};
    if (!pre.empty()) pre += '+';
    pre += names[p.kind];
  }
  impl->description =
      str("BPE, ", impl->vocab_size, " tokens (", impl->model.merges.size(), " merges",
          impl->model.byte_fallback ? ", byte fallback" : "", "), pre-tokenizer ",
          pre.empty() ? "none" : pre, ", ", impl->normalizer.size(), " normalizer step(s), ",
          impl->added.size(), " added token(s)");
  return Tokenizer(std::move(impl));
}

namespace {

// The tokens of text[from, end) appended to *out, as the encoding of the whole of `text` has
// them past `from` (0, or one of its splits). *splits, when given, receives the splits past
// `from`: the ends of the added tokens found in the raw text where the scan for the next one
// resumes (an rstrip token's swallowed whitespace is scanned for matches that it then drops).
void encode_from(const Tokenizer::Impl& t, std::string_view text, size_t from,
                 std::vector<int32_t>* out, std::vector<std::pair<size_t, size_t>>* splits) {
  for (const Segment& raw : split_added(t, text, t.raw_patterns, from)) {
    if (raw.added != std::string::npos) {
      out->push_back(t.added[raw.added].id);
      if (splits && !t.added[raw.added].rstrip) splits->emplace_back(raw.e, out->size());
      continue;
    }
    std::string normalized =
        tok::normalize(t.normalizer, std::string(text.substr(raw.b, raw.e - raw.b)));
    for (const Segment& seg : split_added(t, normalized, t.normalized_patterns)) {
      if (seg.added != std::string::npos) {
        out->push_back(t.added[seg.added].id);
        continue;
      }
      std::vector<tok::Piece> pieces = {
          {normalized.substr(seg.b, seg.e - seg.b), raw.b == 0 && seg.b == 0}};
      tok::pre_tokenize(t.pre_tokenizer, &pieces);
      for (const auto& p : pieces) t.model.tokenize(p.text, out);
    }
  }
}

}  // namespace

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  encode_from(*impl_, text, 0, out, nullptr);
}

Tokenizer::Encoding Tokenizer::encode_with_splits(std::string_view text) const {
  Encoding e;
  encode_from(*impl_, text, 0, &e.ids, &e.splits);
  return e;
}

size_t Tokenizer::shared_prefix(std::string_view text, const Encoding& whole, size_t x) const {
  x = std::min(x, text.size());
  // The last split before x: the text up to it encodes as the whole does, whatever follows.
  auto it =
      std::lower_bound(whole.splits.begin(), whole.splits.end(), std::make_pair(x, size_t(0)));
  const size_t from = it == whole.splits.begin() ? 0 : std::prev(it)->first;
  const size_t n = it == whole.splits.begin() ? 0 : std::prev(it)->second;
  std::vector<int32_t> tail;
  encode_from(*impl_, text.substr(0, x), from, &tail, nullptr);
  size_t k = 0;
  while (k < tail.size() && n + k < whole.ids.size() && tail[k] == whole.ids[n + k]) ++k;
  return n + k;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_append(text, &out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    auto a = impl_->added_by_id.find(id);
    if (a != impl_->added_by_id.end())
      tokens.push_back(impl_->added[a->second].content);
    else if (id >= 0 && static_cast<size_t>(id) < impl_->model.id_to_token.size())
      tokens.push_back(impl_->model.id_to_token[id]);
    // Unknown ids are skipped, as the library skips them.
  }
  return tok::decode_tokens(impl_->decoder, std::move(tokens), impl_->have_decoder);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  auto a = impl_->added_by_id.find(id);
  if (a != impl_->added_by_id.end()) return impl_->added[a->second].content;
  if (id >= 0 && static_cast<size_t>(id) < impl_->model.id_to_token.size())
    return impl_->model.id_to_token[id];
  return "";
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->model.vocab.find(std::string(token));
  if (it != impl_->model.vocab.end()) return it->second;
  return std::nullopt;
}

uint32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
std::string Tokenizer::describe() const { return impl_->description; }
const std::string& Tokenizer::source() const { return impl_->source; }

}  // namespace fuyou
