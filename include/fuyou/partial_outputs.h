// What interrupted conversions leave beside their output: fuyou-convert builds OUT in
// OUT.partial-PID and renames it to OUT at the end (atomic), so a conversion killed before the
// rename (SIGKILL, a power loss) leaves that staging directory behind. The next conversion to
// the same OUT removes those no running fuyou-convert is writing, and names the others.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fuyou {

struct PartialOutput {
  std::string path;     // OUT.partial-PID
  long pid = 0;         // the process that created it
  bool in_use = false;  // that process is a fuyou-convert still running
  uint64_t files = 0, bytes = 0;
};

// The OUT.partial-PID directories beside `out_dir`, oldest name order.
std::vector<PartialOutput> find_partial_outputs(const std::string& out_dir);

// Removes the partial outputs of `out_dir` that no running fuyou-convert holds, logging each
// with what it held, and warns of those still in use. Returns how many were removed.
int clean_partial_outputs(const std::string& out_dir);

}  // namespace fuyou
