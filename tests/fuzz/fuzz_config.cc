// The YAML training config. An accepted config must print as YAML that parses back to the
// same config (what a run directory's config.yaml relies on).
#include <cstdint>
#include <string>

#include "fuyou/config.h"
#include "fuyou/error.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuyou::Config c;
  try {
    c = fuyou::parse_config(text, "fuzz.yaml");
  } catch (const fuyou::Error&) {
    return 0;
  }
  const std::string yaml = fuyou::config_to_yaml(c);
  try {
    FUZZ_REQUIRE(fuyou::config_to_yaml(fuyou::parse_config(yaml, "printed.yaml")) == yaml);
  } catch (const fuyou::Error& e) {
    std::fprintf(stderr, "the printed config does not parse: %s\n%s", e.what(), yaml.c_str());
    std::abort();
  }
  return 0;
}
