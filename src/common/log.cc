#include "fuyou/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>
#include <cstring>

namespace fuyou {

void init_logging(bool verbose) {
  auto logger = spdlog::stderr_color_mt("fuyou");
  logger->set_pattern("[%H:%M:%S] [%^%l%$] %v");
  logger->set_level(verbose ? spdlog::level::debug : spdlog::level::info);
  spdlog::set_default_logger(logger);
}

uint64_t peak_rss_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "VmHWM:", 6) == 0) {
      kib = std::strtoull(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kib * 1024;
}

}  // namespace fuyou
