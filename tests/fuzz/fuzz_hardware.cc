// Hardware profiles (configs/hardware/*.yaml). An accepted profile gives finite, positive
// rates and prints as YAML that parses back.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>

#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuyou::HardwareProfile p;
  try {
    p = fuyou::parse_hardware_profile(text, "fuzz.yaml");
  } catch (const fuyou::Error&) {
    return 0;
  }
  for (double size_ : {1.0, 1e3, 1e6, 1e12}) {
    const double e = p.efficiency_at(size_);
    FUZZ_REQUIRE(e > 0 && e <= 1);
  }
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4096}, uint64_t{1} << 30}) {
    FUZZ_REQUIRE(std::isfinite(p.ssd_read_rate(bytes)) && p.ssd_read_rate(bytes) > 0);
    FUZZ_REQUIRE(std::isfinite(p.ssd_write_rate(bytes)) && p.ssd_write_rate(bytes) > 0);
  }
  try {
    fuyou::HardwareProfile q =
        fuyou::parse_hardware_profile(fuyou::hardware_profile_to_yaml(p, ""), "printed.yaml");
    // Unscaled figures read back exactly; scaled ones (TFLOPS, GB/s) within the two
    // roundings of the division and the multiplication, half an ulp each.
    FUZZ_REQUIRE(q.gemm_efficiency == p.gemm_efficiency && q.ssds == p.ssds &&
                 q.stripe_unit == p.stripe_unit && q.device_memory == p.device_memory &&
                 q.host_memory == p.host_memory && q.element_bytes == p.element_bytes);
    FUZZ_REQUIRE(std::fabs(q.peak_flops - p.peak_flops) <= DBL_EPSILON * p.peak_flops);
  } catch (const fuyou::Error& e) {
    std::fprintf(stderr, "the printed profile does not parse: %s\n", e.what());
    std::abort();
  }
  return 0;
}
