// tokenizer.json against the Hugging Face tokenizers library: fixtures from
// tests/reference/make_hf_fixtures.py hold seven tokenizers (GPT-2 style byte-level, with and
// without a prefix space; Llama 3 and Qwen2 regexes; Llama 2 SentencePiece-style BPE with
// byte fallback, legacy normalizer and Metaspace forms, and without byte fallback) and the
// library's ids and decoded text for a corpus of ASCII, accents, CJK, emoji, whitespace runs and
// numbers. Encoding must match exactly. Then datasets into shards and loss masks, and bad input.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/rng.h"
#include "fuyou/tokenizer.h"
#include "src/formats/tokenizer_impl.h"
#include "src/formats/unicode.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

std::string fixture(const std::string& rel) {
  return test::source_path("tests/reference/fixtures/hf/" + rel);
}

std::string read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_all(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary).write(s.data(), static_cast<std::streamsize>(s.size()));
}

std::string temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("fuyou-test-tok-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

const nlohmann::json& refs() {
  static const nlohmann::json j = nlohmann::json::parse(read_all(fixture("tokenizer_refs.json")));
  return j;
}

std::vector<std::string> texts() {
  std::vector<std::string> t = refs()["corpus"].get<std::vector<std::string>>();
  t.push_back(refs()["document"].get<std::string>());
  for (const auto& r : refs()["random"]) t.push_back(r.get<std::string>());
  return t;
}

// Compares one tokenizer's encodings and decodings with the library's.
void check_against_refs(const Tokenizer& tok, const nlohmann::json& ref) {
  auto all = texts();
  REQUIRE(ref["ids"].size() == all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    auto want = ref["ids"][i].get<std::vector<int32_t>>();
    auto got = tok.encode(all[i]);
    if (got != want) {
      size_t k = 0;
      while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
      INFO("text " << i << ": '" << all[i] << "'\nfirst difference at token " << k << ": got '"
                   << (k < got.size() ? tok.id_to_token(got[k]) : "<end>") << "', library '"
                   << (k < want.size() ? tok.id_to_token(want[k]) : "<end>") << "'");
      CHECK(got == want);
    }
    INFO("decoding text " << i);
    CHECK(tok.decode(want) == ref["decoded"][i].get<std::string>());
  }
}

}  // namespace

TEST_CASE("tokenizers encode exactly as the Hugging Face library", "[tokenizer]") {
  INFO("fixtures from tokenizers " << refs()["tokenizers_version"]);
  int n = 0;
  for (auto& [name, ref] : refs()["tokenizers"].items()) {
    INFO("tokenizer " << name);
    Tokenizer tok = Tokenizer::from_file(fixture(ref["file"].get<std::string>()));
    check_against_refs(tok, ref);
    ++n;
  }
  CHECK(n == 7);
}

TEST_CASE("merges in the [a, b] array form encode the same", "[tokenizer]") {
  for (const char* name : {"bytelevel", "llama2"}) {
    auto j = nlohmann::json::parse(read_all(fixture(std::string("tok_") + name + ".json")));
    for (auto& m : j["model"]["merges"]) {
      std::string s = m.get<std::string>();
      size_t sp = s.find(' ');
      m = nlohmann::json::array({s.substr(0, sp), s.substr(sp + 1)});
    }
    Tokenizer tok = Tokenizer::from_json(j.dump(), name);
    check_against_refs(tok, refs()["tokenizers"][name]);
  }
}

TEST_CASE("byte-level tokenization is lossless, whatever the bytes", "[tokenizer]") {
  Tokenizer tok = Tokenizer::from_file(fixture("tok_llama3.json"));
  Tokenizer gpt = Tokenizer::from_file(fixture("tok_bytelevel.json"));
  CHECK(tok::byte_to_char(' ') == "\xc4\xa0");   // U+0120 'Ġ'
  CHECK(tok::byte_to_char('\n') == "\xc4\x8a");  // U+010A 'Ċ'
  CHECK(tok::byte_to_char('A') == "A");
  std::set<std::string> distinct;
  for (int b = 0; b < 256; ++b) {
    distinct.insert(tok::byte_to_char(static_cast<uint8_t>(b)));
    size_t len;
    CHECK(tok::char_to_byte(unicode::decode(tok::byte_to_char(static_cast<uint8_t>(b)), 0, &len)) ==
          b);
  }
  CHECK(distinct.size() == 256);
  // Random strings drawn from the corpus's characters: valid UTF-8 comes back unchanged.
  auto all = texts();
  std::string pool;
  for (const auto& t : all) pool += t;
  std::vector<std::string> chars;
  for (size_t i = 0; i < pool.size();) {
    size_t len;
    unicode::decode(pool, i, &len);
    chars.push_back(pool.substr(i, len));
    i += len;
  }
  Rng rng(5);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    size_t n = rng.below(60);
    for (size_t k = 0; k < n; ++k) s += chars[rng.below(chars.size())];
    CHECK(tok.decode(tok.encode(s)) == s);
    CHECK(gpt.decode(gpt.encode(s)) == s);
  }
  // Invalid UTF-8 still tokenizes byte for byte; decoding replaces it as the library does.
  auto ids = gpt.encode(
      "a\xff"
      "b");
  CHECK(ids.size() == 3);
  CHECK(gpt.id_to_token(ids[1]) == tok::byte_to_char(0xff));
  CHECK(gpt.decode(ids) ==
        "a\xef\xbf\xbd"
        "b");
  for (int i = 0; i < 300; ++i) {
    std::string s;
    for (size_t k = rng.below(40); k > 0; --k) s += static_cast<char>(rng.below(256));
    CHECK_NOTHROW(tok.decode(tok.encode(s)));
  }
}

TEST_CASE("Unicode tables and normalization", "[tokenizer]") {
  CHECK(std::string(unicode::kUnicodeVersion) == "14.0.0");
  CHECK(unicode::is_letter(U'é'));
  CHECK(unicode::is_letter(0x65E5));  // 日
  CHECK_FALSE(unicode::is_letter(0x1F600));
  CHECK(unicode::is_number(0x0663));  // Arabic-Indic three
  CHECK(unicode::is_number(0x216B));  // Roman numeral twelve
  CHECK(unicode::is_number(0xBD));    // one half
  CHECK(unicode::is_whitespace(0x3000));
  CHECK_FALSE(unicode::is_whitespace(0x200B));  // zero width space is not White_Space
  CHECK(unicode::nfc("e\xcc\x81") == "\xc3\xa9");
  CHECK(unicode::nfc("\xe2\x84\xab") == "\xc3\x85");  // angstrom sign -> Å
  CHECK(unicode::nfc("\xe1\x84\x92\xe1\x85\xa1\xe1\x86\xab") == "\xed\x95\x9c");  // jamo -> 한
  CHECK(unicode::nfd("\xed\x95\x9c") == "\xe1\x84\x92\xe1\x85\xa1\xe1\x86\xab");
  // Canonical ordering: dot below (220) before circumflex (230) whatever the input order.
  CHECK(unicode::nfd("a\xcc\x82\xcc\xa3") == "a\xcc\xa3\xcc\x82");
  CHECK(unicode::nfc("a\xcc\x82\xcc\xa3") == "\xe1\xba\xad");  // ậ
  CHECK(unicode::nfc("\xff"
                     "e\xcc\x81") == "\xff\xc3\xa9");  // invalid bytes pass through
}

TEST_CASE("tokenizer.json problems are refused with the file and the field", "[tokenizer]") {
  const auto base = nlohmann::json::parse(read_all(fixture("tok_bytelevel.json")));
  auto refuse = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
    auto j = base;
    edit(j);
    INFO("expecting " << what);
    CHECK_THROWS_WITH(Tokenizer::from_json(j.dump(), "tok.json"),
                      Contains("tok.json") && Contains(what));
  };
  refuse(
      [](auto& j) {
        j["normalizer"] = {{"type", "Lowercase"}};
      },
      "unsupported normalizer Lowercase");
  refuse([](auto& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "unsupported normalizer NFKC");
  refuse(
      [](auto& j) {
        j["pre_tokenizer"] = {
            {"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}};
      },
      "unsupported pre-tokenizer regex '\\w+'");
  refuse(
      [](auto& j) {
        j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
      },
      "unsupported pre-tokenizer BertPreTokenizer");
  refuse([](auto& j) { j["model"]["type"] = "WordPiece"; }, "unsupported model type WordPiece");
  refuse([](auto& j) { j["model"]["dropout"] = 0.1; }, "model.dropout");
  refuse([](auto& j) { j["model"]["merges"][3] = "zzz qqq"; },
         "model.merges[3]: merge of 'zzz' and 'qqq'");
  refuse([](auto& j) { j["model"]["merges"][4] = "a b c"; }, "model.merges[4]");
  refuse([](auto& j) { j["model"]["vocab"]["x"] = -4; }, "model.vocab");
  refuse([](auto& j) { j["model"].erase("vocab"); }, "model.vocab: missing");
  refuse([](auto& j) { j["added_tokens"][0]["id"] = "zero"; },
         "added_tokens[0].id: expected an integer");
  refuse([](auto& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "unsupported decoder WordPiece");
  // Ids index dense tables: one id far beyond the token count used to allocate 2^30
  // strings (std::bad_alloc, or a 32 GiB allocation).
  const size_t n_ids = base["model"]["vocab"].size() + base["added_tokens"].size();
  refuse([](auto& j) { j["model"]["vocab"]["new-token"] = 1 << 30; },
         str("token 'new-token' has id 1073741824; ids are integers in 0..", n_ids, " (below the ",
             n_ids + 1, " vocabulary entries and added tokens together)"));
  refuse([](auto& j) { j["added_tokens"][0]["id"] = 1 << 30; },
         str("added_tokens[0].id: value 1073741824 is not in 0..", n_ids - 1));
  // A null item of a Sequence was skipped, encoding differently from the library.
  refuse(
      [](auto& j) {
        j["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers", {j["pre_tokenizer"], nullptr}}};
      },
      "pre_tokenizer.pretokenizers[1]: is null");
  refuse(
      [](auto& j) {
        j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {nullptr}}};
      },
      "normalizer.normalizers[0]: is null");
  refuse(
      [](auto& j) {
        j["decoder"] = {{"type", "Sequence"}, {"decoders", {3}}};
      },
      "decoder.decoders[0]: expected an object with a type, got 3");
  refuse(
      [](auto& j) {
        nlohmann::json d = {{"type", "ByteLevel"}};
        for (int i = 0; i < 20; ++i) d = {{"type", "Sequence"}, {"decoders", {d}}};
        j["decoder"] = d;
      },
      "Sequences nest more than 8 levels deep");
  CHECK_THROWS_WITH(Tokenizer::from_json("{\"model\": ", "tok.json"),
                    Contains("tok.json: not valid JSON"));
  CHECK_THROWS_WITH(Tokenizer::from_file("/nonexistent/tokenizer.json"), Contains("cannot open"));
  // Bounded random mutation: a clean fuyou::Error or a working tokenizer, never a crash.
  std::string good = base.dump();
  Rng rng(17);
  int refused = 0;
  for (int i = 0; i < 300; ++i) {
    std::string m = good;
    for (int e = 0; e < 3; ++e) m[rng.below(m.size())] = "{}[]\":, a0\\"[rng.below(11)];
    try {
      Tokenizer t = Tokenizer::from_json(m, "fuzz.json");
      t.encode("Hello world, it's 2026!");
    } catch (const Error&) {
      ++refused;
    }
  }
  CHECK(refused > 0);
}

TEST_CASE("datasets become token shards, and prompt/completion pairs loss masks", "[tokenizer]") {
  std::string dir = temp_dir("data");
  Tokenizer tok = Tokenizer::from_file(fixture("tok_bytelevel.json"));
  const std::string a = "Hello world! It's a test.\nCafé 日本 😀 123\n",
                    b = "the of and to in is that it";
  write_all(dir + "/a.txt", a);
  write_all(dir + "/b.txt", b);
  DatasetOptions opts;
  opts.val_fraction = 0.25;
  opts.eos_token = "<|endoftext|>";
  auto r = build_tokenized_dataset(tok, {dir + "/a.txt", dir + "/b.txt"}, dir + "/text", opts);
  CHECK(r.documents == 2);
  auto train = read_token_shard(r.train_path).tokens, val = read_token_shard(r.val_path).tokens;
  CHECK(read_token_shard(r.train_path).vocab_size == tok.vocab_size());
  CHECK(train.size() + val.size() == tok.encode(a).size() + tok.encode(b).size() + 2);
  CHECK(r.train_mask_path.empty());
  // Both documents, split and joined back in order, decode to the input.
  auto ea = tok.encode(a), eb = tok.encode(b);
  ea.push_back(0);
  eb.push_back(0);
  size_t cut_a = ea.size() - ea.size() / 4, cut_b = eb.size() - eb.size() / 4;
  std::vector<int32_t> want_train(ea.begin(), ea.begin() + cut_a),
      want_val(ea.begin() + cut_a, ea.end());
  want_train.insert(want_train.end(), eb.begin(), eb.begin() + cut_b);
  want_val.insert(want_val.end(), eb.begin() + cut_b, eb.end());
  CHECK(train == want_train);
  CHECK(val == want_val);

  // JSON Lines, prompt/completion: the mask is 0 over the prompt, 1 over completion + EOS.
  write_all(dir + "/pairs.jsonl",
            "{\"prompt\": \"Q: 2+2?\", \"completion\": \" A: 4\"}\n\n"
            "{\"prompt\": \"Q: capital of France?\", \"completion\": \" A: Paris\"}\n"
            "{\"prompt\": \"Say hi\", \"completion\": \" hi\"}\n"
            "{\"prompt\": \"Count\", \"completion\": \" 1 2 3\"}\n");
  opts.prompt_field = "prompt";
  opts.completion_field = "completion";
  auto p = build_tokenized_dataset(tok, {dir + "/pairs.jsonl"}, dir + "/pairs", opts);
  CHECK(p.documents == 4);
  auto pt = read_token_shard(p.train_path).tokens;
  auto pm = read_loss_mask(p.train_mask_path).mask;
  auto vt = read_token_shard(p.val_path).tokens;
  auto vm = read_loss_mask(p.val_mask_path).mask;
  REQUIRE(pm.size() == pt.size());
  REQUIRE(vm.size() == vt.size());
  std::vector<int32_t> want;
  std::vector<uint8_t> want_mask;
  for (auto [q, c] :
       {std::pair{"Q: 2+2?", " A: 4"}, {"Q: capital of France?", " A: Paris"}, {"Say hi", " hi"}}) {
    auto eq = tok.encode(q), ec = tok.encode(c);
    want.insert(want.end(), eq.begin(), eq.end());
    want_mask.insert(want_mask.end(), eq.size(), 0);
    want.insert(want.end(), ec.begin(), ec.end());
    want.push_back(0);
    want_mask.insert(want_mask.end(), ec.size() + 1, 1);
  }
  CHECK(pt == want);
  CHECK(pm == want_mask);
  CHECK(tok.decode(vt) == "Count 1 2 3<|endoftext|>");  // the last quarter of the records

  // Errors name the file, the line and the field; nothing is overwritten.
  auto refuse = [&](const std::string& content, const std::string& what) {
    static int n = 0;
    std::string f = dir + "/bad" + std::to_string(n) + ".jsonl";
    write_all(f, content);
    CHECK_THROWS_WITH(build_tokenized_dataset(tok, {f}, dir + "/out" + std::to_string(n++), opts),
                      Contains(f) && Contains(what));
  };
  refuse("{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n",
         ":2: field 'completion' is missing");
  refuse("{\"prompt\": 3, \"completion\": \"b\"}\n", ":1: field 'prompt' must be a string");
  refuse("\n\n{\"prompt\": \"a\", \n", ":3: not valid JSON");
  refuse("[1, 2]\n", ":1: each line must be a JSON object");
  CHECK_THROWS_WITH(build_tokenized_dataset(tok, {dir + "/pairs.jsonl"}, dir + "/pairs", opts),
                    Contains("refusing to overwrite"));
  DatasetOptions bad_eos;
  bad_eos.eos_token = "</s>";
  CHECK_THROWS_WITH(build_tokenized_dataset(tok, {dir + "/a.txt"}, dir + "/x", bad_eos),
                    Contains("--eos-token '</s>' is not a token"));
  DatasetOptions half;
  half.prompt_field = "prompt";
  CHECK_THROWS_WITH(build_tokenized_dataset(tok, {dir + "/a.txt"}, dir + "/y", half),
                    Contains("go together"));
  // A mask file is not a token shard, and corrupt masks are refused.
  CHECK_THROWS_WITH(read_token_shard(p.train_mask_path), Contains("bad magic"));
  std::string mask_bytes = read_all(p.train_mask_path);
  CHECK(parse_loss_mask(mask_bytes, "m").mask == pm);
  mask_bytes.back() = 2;
  CHECK_THROWS_WITH(
      parse_loss_mask(mask_bytes, "m"),
      Contains(str("m: value 2 at offset ", mask_bytes.size() - 1, " is not 0 or 1")));
  CHECK_THROWS_WITH(parse_loss_mask(mask_bytes.substr(0, 40), "m"), Contains("header says"));
  fs::resize_file(p.train_mask_path, fs::file_size(p.train_mask_path) - 1);
  CHECK_THROWS_WITH(read_loss_mask(p.train_mask_path), Contains("header says"));
  fs::remove_all(dir);
}
