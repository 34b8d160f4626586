// A device's rates and the cost model built on them: what an operation of a plan costs on a
// machine whose figures a hardware profile gives (configs/hardware/*.yaml; docs/simulator.md
// describes every key). The plan simulator and the emulated device share it, so an emulated
// op lasts what the simulator charges. Reading and writing profiles: fuyou/hardware.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fuyou {

struct HardwareProfile {
  std::string name;
  std::string backend = "cpu";  // cpu | cuda: which engine backend the figures describe
  std::string source;           // path or "<test>", for error messages

  // Compute: dense throughput and its efficiency by GEMM size. The size of a layer's work
  // is the geometric mean of its MLP up-projection GEMM, cbrt(tokens * d_model * d_ff);
  // the efficiency is interpolated linearly in log2(size) and clamped at the ends.
  double peak_flops = 0;                                   // FLOP/s
  std::vector<std::pair<double, double>> gemm_efficiency;  // (size, fraction of peak), sorted
  // Bytes per activation / weight / gradient element a 16-bit storage mode would give this
  // device (4: fp32, 2: bf16). Not applied: plans count the bytes the run stores (fp32 on
  // every backend today), and the simulator and the emulated device charge those.
  int element_bytes = 4;

  // Host <-> device links (PCIe; memcpy on the CPU backend), bytes/s.
  double h2d_Bps = 0, d2h_Bps = 0;

  // SSDs: per-drive sequential bandwidth and the number of drives the store stripes over.
  double ssd_read_Bps = 0, ssd_write_Bps = 0;  // per SSD
  // The disks' throughput while reads and writes run at once, in units of one direction alone:
  // 1, they take turns (one disk shared by both directions); 2, full duplex. Measured by
  // `fuyou-bench profile` (mixed_capacity_from).
  double ssd_mixed = 1;
  int ssds = 1;
  uint64_t stripe_unit = 4ull << 20;

  // CPU optimizer: in-memory AdamW parameters per second (fp32 state), and host memory
  // bandwidth (the global gradient norm reads 4 bytes per parameter).
  double optimizer_params_per_s = 0;
  // AdamW parameters per second by state format, keyed "moments/master" as
  // optim_format_name writes it ("int8/split"), measured with bf16 gradients and working
  // weights (the large-model recipe); a format not listed runs at optimizer_params_per_s.
  std::vector<std::pair<std::string, double>> optimizer_format_params_per_s;
  // The rate of format `key` (optimizer_format_params_per_s, else optimizer_params_per_s).
  double optimizer_rate(const std::string& key) const;
  double host_mem_Bps = 0;

  // Compute and optimizer on the same cores (the CPU backend). When both run at once each
  // progresses at its share of its alone rate (measured by `fuyou-bench profile`).
  bool shared_cpu = false;
  double compute_share = 0.5, optimizer_share = 0.5;
  // The host optimizer's rate while a host<->device copy runs, over its rate alone: page-locked
  // copies read and write host memory at the link's rate, which the optimizer streams its
  // state through too (measured by `fuyou-bench profile --backend cuda`; 1: no slowdown).
  double copy_share = 1;

  // Capacities, bytes: the default budgets `fuyou-bench simulate` plans with.
  uint64_t device_memory = 0, host_memory = 0;

  double efficiency_at(double size) const;
  // Seconds `flops` of a layer's work of GEMM size `size` (gemm_work_size) take: the
  // simulator's compute cost, and the emulated device's.
  double compute_seconds(double flops, double size) const;
  // Seconds a host<->device copy of `bytes` takes over the link.
  double h2d_seconds(double bytes) const { return bytes / h2d_Bps; }
  double d2h_seconds(double bytes) const { return bytes / d2h_Bps; }
  // Aggregate sequential bandwidth over the striped SSDs for one request of `bytes`
  // (a request smaller than a stripe unit times the drive count reaches fewer drives).
  double ssd_read_rate(uint64_t bytes) const;
  double ssd_write_rate(uint64_t bytes) const;
};

// ssd_mixed from a measurement: `read_s` and `write_s` seconds of disk time alone (bytes over
// each direction's rate) took `mixed_s` run at once. Under the simulator's model both share
// min(1, mixed / 2) of the disks until the shorter ends, then the other runs alone; solved
// for mixed and clamped to [1, 2].
double mixed_capacity_from(double read_s, double write_s, double mixed_s);

// The machine an emulated run (runtime.backend: emulated) is: `gpu`'s compute and PCIe with
// their throughputs multiplied by `scale` (runtime.emulated_scale), and `host`'s SSDs, CPU
// optimizer and memory bandwidth (this machine's, e.g. from `fuyou-bench profile`), which the
// run uses for real. The simulator's prediction for an emulated run is on this profile.
HardwareProfile emulated_machine(const HardwareProfile& gpu, double scale,
                                 const HardwareProfile& host);

// The scale that gives an emulated run `gpu`'s ratio of compute and PCIe time to SSD read
// time on `host`'s disks: host's aggregate SSD read bandwidth over gpu's.
double emulation_scale_for(const HardwareProfile& gpu, const HardwareProfile& host);

}  // namespace fuyou
