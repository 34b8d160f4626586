// Logging: one spdlog logger for the whole process, set up by the tools' mains.
#pragma once

#include <spdlog/spdlog.h>

namespace fuyou {

// Configures the default logger: "[time] [level] message" on stderr.
void init_logging(bool verbose);

// Peak resident set size of this process so far (VmHWM), in bytes.
uint64_t peak_rss_bytes();

}  // namespace fuyou
