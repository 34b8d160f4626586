// model.safetensors.index.json: shard names must stay in the model directory.
#include <cstdint>
#include <string_view>

#include "fuyou/error.h"
#include "src/formats/safetensors_stream.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    std::string_view text(reinterpret_cast<const char*>(data), size);
    auto map = fuyou::parse_st_index(text, "model/model.safetensors.index.json");
    FUZZ_REQUIRE(!map.empty());
    for (const auto& [tensor, file] : map) {
      FUZZ_REQUIRE(!tensor.empty());
      FUZZ_REQUIRE(!file.empty() && file != "." && file != "..");
      FUZZ_REQUIRE(file.find('/') == std::string::npos);
      FUZZ_REQUIRE(file.find('\0') == std::string::npos);
    }
  } catch (const fuyou::Error&) {
  }
  return 0;
}
