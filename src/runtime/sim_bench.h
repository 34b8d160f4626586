// fuyou-bench's `profile` (measure this machine's CPU- or CUDA-backend profile) and `simulate`
// (predict an iteration from a config and a hardware profile) subcommands.
#pragma once

#include <string>
#include <vector>

#include "fuyou/hardware.h"

namespace fuyou {

struct ProfileOptions {
  std::vector<std::string> dirs;  // store directories for the SSD figures (required)
  int threads = 0;                // 0: every core
  uint64_t io_size = 1ull << 30;  // bytes written then read by the SSD measurement
};

// Measures every figure of a CPU-backend profile (see docs/simulator.md); `log` receives
// one line per measurement. Takes about a minute.
HardwareProfile measure_cpu_profile(const ProfileOptions& opts, std::string* log);
// The same for the CUDA backend on device 0: a layer's GEMMs by size at the engine's GPU
// precision, host<->device copies from page-locked memory, and the host side as above.
HardwareProfile measure_cuda_profile(const ProfileOptions& opts, std::string* log);

struct SimulateOptions {
  std::string config, hardware;
  std::vector<std::string> sets;
  int batch = 0;           // 0: the config's schedule.micro_batch
  int ssds = 0;            // 0: the profile's count
  bool search_batch = false;
  std::string sweep;       // "", "batch" or "ssds"
  std::string acts;        // "" (the config's offload.activations) or auto/keep/swap/recompute
  bool json = false;
};

int run_simulate(const SimulateOptions& opts);

}  // namespace fuyou
