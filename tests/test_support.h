// Helpers shared by the tests: relative comparison of arrays and the fixture directory.
#pragma once

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fuyou {
class StopSignals;
}

namespace fuyou::test {

// The process's StopSignals, created first in main() (tests/main.cc). A test that uses it
// resets it when done: StopSignals::clear().
StopSignals& stop_signals();

// The source tree's files (fixtures). The environment variable FUYOU_SOURCE_DIR, where set,
// overrides the tree the binary was built from: prebuilt test binaries run elsewhere (the GPU
// kit, tools/gpu-validate.sh) find the fixtures of the tree they travel with.
inline std::string source_path(const std::string& rel) {
  const char* env = std::getenv("FUYOU_SOURCE_DIR");
  return std::string(env && *env ? env : FUYOU_SOURCE_DIR) + "/" + rel;
}

// An empty directory build/test-data/NAME-PID (emptied if it exists): under the build tree,
// whose filesystem takes O_DIRECT, unlike some temp directories.
inline std::string fresh_test_dir(const std::string& name) {
  const std::filesystem::path p = std::filesystem::path(FUYOU_BINARY_DIR) / "test-data" /
                                  (name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// A CPU backend's fp32 device tensor (its "device memory" is host memory).
inline float* f32(void* p) { return static_cast<float*>(p); }
inline const float* f32(const void* p) { return static_cast<const float*>(p); }

// max |a - b| / max |b|: the error relative to the tensor's scale, so tiny elements near
// zero do not dominate the way an element-wise relative error would.
inline double rel_error(const float* a, const float* b, size_t n) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// A fresh directory under the temp directory, removed when the test case ends.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() /
              ("fuyou-test-" + name + "-" + std::to_string(::getpid())))
                 .string()) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

inline std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_all(const std::filesystem::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary).write(s.data(), static_cast<std::streamsize>(s.size()));
}

// The log lines a call writes (the default logger pointed at a string for its duration).
template <typename F>
std::string captured_log(F&& f) {
  auto previous = spdlog::default_logger();
  std::ostringstream text;
  auto logger = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(text));
  spdlog::set_default_logger(logger);
  try {
    f();
  } catch (...) {
    spdlog::set_default_logger(previous);
    throw;
  }
  spdlog::set_default_logger(previous);
  return text.str();
}

}  // namespace fuyou::test
