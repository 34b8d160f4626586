// The test binary's main: like every tool's, it blocks the stop signals before any thread
// starts and receives them on StopSignals' thread (include/fuyou/stop.h), so the tests run
// the engine's threads as the tools do, and the stop tests send real signals.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "fuyou/stop.h"
#include "test_support.h"

namespace {
fuyou::StopSignals* g_stop = nullptr;
}

fuyou::StopSignals& fuyou::test::stop_signals() { return *g_stop; }

int main(int argc, char** argv) {
  fuyou::StopSignals stop;
  g_stop = &stop;
  return Catch::Session().run(argc, argv);
}
