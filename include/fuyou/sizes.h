// Byte sizes as users write them ("512MiB", "8GiB", "1.5GB", "4096") and as we print them.
#pragma once

#include <cstdint>
#include <string>

namespace fuyou {

// Parses a size. Binary units (KiB, MiB, GiB, TiB) and decimal ones (kB, MB, GB, TB) are
// accepted, case-insensitively for the letters after the first; a bare number is bytes.
// Throws ConfigError naming `what` (for example "offload.host_memory") on bad input.
uint64_t parse_size(const std::string& text, const std::string& what);

// "1.50 GiB", "512.00 MiB", "4096 B".
std::string format_size(uint64_t bytes);

// x rounded up to a multiple of a (a > 0): I/O sizes to kIoAlign, regions to their alignment.
constexpr uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace fuyou
