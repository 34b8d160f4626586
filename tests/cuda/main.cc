// The CUDA backend's test binary. With no usable CUDA device it prints why and exits 77,
// which ctest (SKIP_RETURN_CODE 77) reports as Skipped: these tests never pass silently on a
// machine that cannot run them.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "fuyou/cuda.h"

int main(int argc, char** argv) {
  std::string why;
  if (fuyou::cuda_usable_devices(&why) == 0) {
    std::printf("no CUDA device: %s\n", why.c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
