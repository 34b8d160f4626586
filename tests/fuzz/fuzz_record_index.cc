// Record indexes (X.rec beside a shard): the first 4 bytes are the shard's token count (little
// endian, below 2^24), the rest is the file.
#include <cstdint>
#include <cstring>
#include <string_view>

#include "fuyou/data.h"
#include "fuyou/error.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t tokens;
  std::memcpy(&tokens, data, 4);
  tokens &= (1u << 24) - 1;
  std::string_view file(reinterpret_cast<const char*>(data) + 4, size - 4);
  try {
    const auto starts = fuyou::parse_record_index(file, "fuzz.rec", tokens);
    FUZZ_REQUIRE(starts.empty() || starts[0] == 0);
    for (size_t i = 0; i < starts.size(); ++i) {
      FUZZ_REQUIRE(starts[i] < tokens);
      FUZZ_REQUIRE(i == 0 || starts[i] > starts[i - 1]);
    }
  } catch (const fuyou::Error&) {
  }
  return 0;
}
