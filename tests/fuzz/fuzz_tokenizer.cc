// tokenizer.json: parse, then encode fixed text and the input's own first bytes, and decode
// the ids. Every id must lie below the tokenizer's vocabulary size.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuyou/error.h"
#include "fuyou/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    fuyou::Tokenizer tok = fuyou::Tokenizer::from_json(text, "fuzz.json");
    const std::string samples[] = {"Hello world, it's 2026!  \n\t caf\xc3\xa9 \xe4\xb8\xad 123",
                                   text.substr(0, 64), std::string("\xff\xfe\x00z", 4)};
    for (const std::string& s : samples) {
      std::vector<int32_t> ids = tok.encode(s);
      for (int32_t id : ids) FUZZ_REQUIRE(id >= 0 && static_cast<uint32_t>(id) < tok.vocab_size());
      (void)tok.decode(ids);
    }
  } catch (const fuyou::Error&) {
  }
  return 0;
}
