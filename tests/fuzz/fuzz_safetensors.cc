// The safetensors header: the input is a whole file (8-byte length, JSON header, data).
#include <cstdint>
#include <string_view>

#include "fuyou/error.h"
#include "fuyou/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;  // the reader refuses these before parsing (too short)
  try {
    const uint64_t len = fuyou::st_header_length(data, size, "fuzz.safetensors");
    std::string_view header(reinterpret_cast<const char*>(data) + 8, len);
    fuyou::StHeader h = fuyou::parse_st_header(header, size, "fuzz.safetensors");
    // Accepted: the tensors tile the data section, each sized by its dtype and shape.
    const uint64_t data_size = size - h.data_start;
    uint64_t total = 0;
    for (const auto& t : h.tensors) {
      FUZZ_REQUIRE(t.begin <= t.end && t.end <= data_size);
      uint64_t bytes = fuyou::st_dtype_size(t.dtype);
      for (int64_t d : t.shape) bytes *= static_cast<uint64_t>(d);
      FUZZ_REQUIRE(bytes == t.end - t.begin);
      total += t.end - t.begin;
    }
    FUZZ_REQUIRE(total == data_size);
  } catch (const fuyou::Error&) {
  }
  return 0;
}
