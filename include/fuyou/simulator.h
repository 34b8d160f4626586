// The plan simulator: runs a Plan (plan.h) on a HardwareProfile (hardware.h) instead of a
// Backend. The same rules as the executor (scheduler.cc): each resource performs its
// operations in plan order, one at a time; an operation starts when the previous one on its
// resource and all its dependencies have finished. Durations come from the operation's
// FLOPs and bytes and the profile's rates; on a profile with shared_cpu, compute and the
// optimizer slow each other down while both run. Plans are data only, so a 175B model is
// simulated without allocating its memory.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/hardware.h"
#include "fuyou/plan.h"

namespace fuyou {

struct SimResult {
  double iteration_s = 0;  // one iteration alone, from an idle machine to its last op
  // Steady state: the time per step when iterations overlap as the executor runs them
  // (scheduler.h), from one step's return to the next's. This is the figure to compare with
  // a measured step time.
  double period_s = 0;
  double useful_flops = 0;  // model FLOPs (forward + backward + head), as fuyou-bench train counts
  double recompute_flops = 0;  // recomputation, not counted as useful
  double tflops = 0;           // useful_flops / period_s / 1e12
  std::array<double, kNumResources> busy_s{};
  // The time the disks are busy with any op that moves bytes through the store (SSD reads,
  // SSD writes, out-of-core updates): the union of their intervals, as the executor's `disk`.
  double disk_busy_s = 0;
  std::vector<double> start, end;  // per op id, seconds from the iteration's start
  // Peak memory per tier for this profile (see docs/simulator.md for the element-size scaling).
  uint64_t device_bytes = 0, host_bytes = 0, ssd_bytes = 0;
  Resource busiest = Resource::kCompute;  // of busy_s
  bool disk_busiest = false;              // the disks are busier than `busiest`

  nlohmann::json to_json() const;  // iteration_s, tflops, busy_s (fuyou-bench train's keys), memory
};

// The bytes the simulator charges `op` (OpTraffic, plan.h): what the executor moves for it.
OpTraffic op_traffic(const Plan& plan, const PlanOp& op);

// The duration of `op` alone on `hw` (no contention), seconds.
double op_duration(const Plan& plan, const PlanOp& op, const HardwareProfile& hw);

// Simulates one iteration alone and a few back to back (period_s). Throws Error if the plan is
// malformed (a dependency on a later op or a missing op), naming the op.
SimResult simulate(const Plan& plan, const HardwareProfile& hw);

// Memory figures of `plan` as they would be on `hw` (on a GPU the device arena is not host
// memory).
void plan_memory_on(const Plan& plan, const HardwareProfile& hw, uint64_t* device, uint64_t* host,
                    uint64_t* ssd);

}  // namespace fuyou
