// Hugging Face config.json. An accepted config must lay out (hf_tensor_map) and its engine
// config.yaml must be accepted by parse_config with the same model section.
#include <cstdint>
#include <string>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "fuyou/hf_checkpoint.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuyou::ModelConfig m;
  try {
    m = fuyou::parse_hf_config(text, "config.json");
  } catch (const fuyou::Error&) {
    return 0;
  }
  FUZZ_REQUIRE(!fuyou::hf_tensor_map(m).empty());
  try {
    fuyou::ModelConfig back =
        fuyou::parse_config(fuyou::engine_config_yaml(m), "config.yaml").model;
    FUZZ_REQUIRE(back.n_layer == m.n_layer && back.d_model == m.d_model && back.d_ff == m.d_ff &&
                 back.vocab_size == m.vocab_size && back.seq_len == m.seq_len &&
                 back.kv_heads() == m.kv_heads() && back.family == m.family);
  } catch (const fuyou::Error& e) {
    std::fprintf(stderr, "accepted config.json gives a config.yaml parse_config refuses: %s\n",
                 e.what());
    std::abort();
  }
  return 0;
}
