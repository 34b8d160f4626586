// fuyou-bench's `profile` (measure this machine's CPU- or CUDA-backend profile) and `simulate`
// (predict an iteration from a config and a hardware profile) subcommands.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/config.h"
#include "fuyou/hardware.h"

namespace fuyou {

class Backend;

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

// fuyou-bench gemm: the CPU backend's GEMM library on a config's layer shapes (fp32), each
// against this CPU's FMA peak measured in the same run: library, threads, fma_isa,
// fma_peak_gflops(_1thread), shapes [{shape, M, N, K, gflops, fraction_of_peak}].
nlohmann::json run_cpu_gemm_bench(const Config& cfg, int threads);

// fuyou-bench gemm --backend cuda: a config's layer GEMMs (qkv, proj, fc, fcproj, lm_head at
// micro_batch x seq_len tokens) through the CUDA backend's matmul_forward / matmul_backward on
// bf16 tensors with bf16 GEMMs, beside the same products as plain cuBLASLt GEMMs
// (cublaslt_gemm_time): TFLOP/s of each and their ratio per shape and direction, and over the
// four layer GEMMs (the engine's weight gradient adds into its buffer, beta 1; cuBLASLt's
// writes, beta 0). Every operand both sides read is filled with random bf16
// (fill_random_bf16) and shared: cuBLASLt multiplies the engine's own buffers. Both sides are
// timed the same way: batches of `reps` calls queued between two events on the device's
// timeline, the median of five batches after a warm-up batch. Needs a GPU.
nlohmann::json run_cuda_gemm_bench(const Config& cfg, int reps);

// Writes `elems` bf16 values drawn uniformly from [-1, 1) (Rng(seed, i) for the i-th block of
// 64 Ki values) into the backend buffer `dst`, through host chunks and copy_to_device: a
// GEMM bench's operands, so that no operand is the arena's zeroed memory (zeros run faster).
void fill_random_bf16(Backend& be, void* dst, size_t elems, uint64_t seed);

struct SimulateOptions {
  std::string config, hardware;
  std::vector<std::string> sets;
  int batch = 0;  // 0: the config's schedule.micro_batch
  int ssds = 0;   // 0: the profile's count
  bool search_batch = false;
  std::string sweep;  // "", "batch" or "ssds"
  std::string acts;   // "" (the config's offload.activations) or auto/keep/swap/recompute
  bool json = false;
};

int run_simulate(const SimulateOptions& opts);

}  // namespace fuyou
