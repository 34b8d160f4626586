// Token shards and loss masks: the first byte picks which (even: shard, odd: mask), the
// rest is the file.
#include <cstdint>
#include <string_view>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::string_view file(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 0) {
      fuyou::TokenShard s = fuyou::parse_token_shard(file, "fuzz.tok");
      for (int32_t t : s.tokens) FUZZ_REQUIRE(t >= 0 && static_cast<uint32_t>(t) < s.vocab_size);
    } else {
      fuyou::LossMask m = fuyou::parse_loss_mask(file, "fuzz.mask");
      FUZZ_REQUIRE(m.mask.size() + 32 == file.size());
      for (uint8_t v : m.mask) FUZZ_REQUIRE(v <= 1);
    }
  } catch (const fuyou::Error&) {
  }
  return 0;
}
