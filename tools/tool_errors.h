// How a tool ends on an exception: one line on stderr and exit status 1, whatever was thrown.
// fuyou::Error carries a message written for the user; anything else (std::bad_alloc, a
// std::filesystem error, an exception from a library) is a failure the engine did not turn
// into one, and says so rather than ending in std::terminate. A stop signal honoured where the
// work could stop (fuyou::StopRequested) is no failure: its line, and status 128 + signal.
#pragma once

#include <spdlog/spdlog.h>

#include <exception>
#include <new>

#include "fuyou/error.h"
#include "fuyou/stop.h"

namespace fuyou::tools {

// Call from inside a catch (...) block; returns the exit status. `oom_hint` follows "out of
// memory" (what the user can change to need less).
inline int report_failure(const char* oom_hint =
                              "lower the model or batch size, or set offload budgets so the "
                              "engine plans within them") {
  try {
    throw;
  } catch (const StopRequested& e) {
    spdlog::warn("{}", e.what());
    return 128 + e.signal();
  } catch (const Error& e) {
    spdlog::error("{}", e.what());
  } catch (const std::bad_alloc&) {
    spdlog::error("out of memory (an allocation failed; {})", oom_hint);
  } catch (const std::exception& e) {
    spdlog::error("unexpected error (please report it as a bug): {}", e.what());
  } catch (...) {
    spdlog::error("unexpected error of unknown type (please report it as a bug)");
  }
  return 1;
}

}  // namespace fuyou::tools
