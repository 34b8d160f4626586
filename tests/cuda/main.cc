// The CUDA backend's test binary. With no usable CUDA device it prints why and exits 77,
// which ctest (SKIP_RETURN_CODE 77) reports as Skipped: these tests never pass silently on a
// machine that cannot run them.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "fuyou/cuda.h"

int main(int argc, char** argv) {
  // Listing the tests (--list-tests, --list-tags) needs no device.
  const bool listing = argc > 1 && std::string(argv[1]).rfind("--list", 0) == 0;
  std::string why;
  if (!listing && fuyou::cuda_usable_devices(&why) == 0) {
    std::printf("no CUDA device: %s\n", why.c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
