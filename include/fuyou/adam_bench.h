// fuyou-bench adam: the optimizer's throughput in memory and out of core, each against its
// roofline measured in the same run (memory bandwidth; the store's sequential read and
// write bandwidth on the same directories).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/optim.h"

namespace fuyou {

struct AdamBenchOptions {
  uint64_t params = 100'000'000;
  std::vector<std::string> dirs;  // empty: in-memory only
  ElemType grad_type = ElemType::kBF16;
  ElemType lowp_type = ElemType::kBF16;
  bool with_lowp = true;
  int steps = 3;  // timed updates (median)
  // Adam's step count at the first (untimed) in-memory update: late in a run the bias
  // correction of the second moment is exactly 1 (beta2 0.95: from about step 324), which
  // the packed kernel uses.
  int64_t first_step = 1;
  uint64_t group_params = 16 << 20;  // parameters per group (one "layer") out of core
  OptimFormat format;  // optimizer.state / optimizer.master (a split master: bf16 weights)
  // The in-memory update's instruction set (kAuto: the widest the CPU has); one the CPU lacks
  // is refused (ConfigError). The out-of-core run always takes the widest.
  SimdPath simd = SimdPath::kAuto;
};

nlohmann::json run_adam_bench(const AdamBenchOptions& opts);
void print_adam_bench(const nlohmann::json& r);

}  // namespace fuyou
