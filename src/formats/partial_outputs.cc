#include "fuyou/partial_outputs.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>

#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"

namespace fs = std::filesystem;

namespace fuyou {
namespace {

// The process `pid` exists and is a fuyou-convert (a reused PID of another program is not).
bool convert_running(long pid) {
  if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) return false;
  std::ifstream in(str("/proc/", pid, "/comm"));
  std::string comm;
  std::getline(in, comm);
  return comm.rfind("fuyou-convert", 0) == 0;
}

fs::path normalized(const std::string& out_dir) {
  fs::path p = fs::path(out_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p;
}

}  // namespace

std::vector<PartialOutput> find_partial_outputs(const std::string& out_dir) {
  const fs::path out = normalized(out_dir);
  if (out.empty()) return {};
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  const std::string prefix = out.filename().string() + ".partial-";
  std::vector<PartialOutput> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0 || !e.is_directory(ec)) continue;
    const std::string digits = n.substr(prefix.size());
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    PartialOutput p;
    p.path = (parent / n).string();
    p.pid = std::stol(digits);
    p.in_use = convert_running(p.pid);
    for (auto it = fs::recursive_directory_iterator(e.path(), ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
      if (it->is_regular_file(ec)) {
        ++p.files;
        p.bytes += it->file_size(ec);
      }
    found.push_back(p);
  }
  std::sort(found.begin(), found.end(),
            [](const PartialOutput& a, const PartialOutput& b) { return a.path < b.path; });
  return found;
}

int clean_partial_outputs(const std::string& out_dir) {
  int removed = 0;
  for (const PartialOutput& p : find_partial_outputs(out_dir)) {
    if (p.in_use) {
      spdlog::warn(
          "{}: {} files, {}, being written by fuyou-convert (PID {}), which is still running; "
          "left alone",
          p.path, p.files, format_size(p.bytes), p.pid);
      continue;
    }
    std::error_code ec;
    fs::remove_all(p.path, ec);
    if (ec) {
      spdlog::warn("{}: left by an interrupted conversion ({} files, {}); cannot remove it: {}",
                   p.path, p.files, format_size(p.bytes), ec.message());
      continue;
    }
    spdlog::warn("{}: removed, left by an interrupted conversion (PID {}, {} files, {})", p.path,
                 p.pid, p.files, format_size(p.bytes));
    ++removed;
  }
  return removed;
}

}  // namespace fuyou
