#include "fuyou/sizes.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "fuyou/error.h"

namespace fuyou {

uint64_t parse_size(const std::string& text, const std::string& what) {
  const char* begin = text.c_str();
  char* end = nullptr;
  double value = std::strtod(begin, &end);
  if (end == begin || !std::isfinite(value) || value < 0)
    throw ConfigError(
        str(what, ": '", text, "' is not a size (examples: 4096, 512MiB, 8GiB, 1.5GB)"));
  std::string unit(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  std::string lower;
  for (char c : unit) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 0;
  if (lower.empty() || lower == "b")
    mult = 1;
  else if (lower == "kib" || lower == "k")
    mult = 1024.0;
  else if (lower == "mib" || lower == "m")
    mult = 1024.0 * 1024;
  else if (lower == "gib" || lower == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (lower == "tib" || lower == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (lower == "kb")
    mult = 1e3;
  else if (lower == "mb")
    mult = 1e6;
  else if (lower == "gb")
    mult = 1e9;
  else if (lower == "tb")
    mult = 1e12;
  else
    throw ConfigError(str(what, ": unknown unit '", unit, "' in '", text,
                          "' (allowed: B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"));
  // 2^64 is exact in a double; the conversion to uint64_t is undefined at or above it.
  const double bytes = std::round(value * mult);
  if (!(bytes < 18446744073709551616.0))
    throw ConfigError(str(what, ": '", text, "' is too large (at most 2^64 - 1 bytes)"));
  return static_cast<uint64_t>(bytes);
}

std::string format_size(uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace fuyou
