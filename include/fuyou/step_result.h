// What one optimizer step reports, whichever engine ran it (InMemoryStep in memory, the
// offloading executor).
#pragma once

#include <array>
#include <cstdint>

#include "fuyou/resource.h"

namespace fuyou {

struct StepResult {
  float loss = 0;        // mean over the step's counted targets, before the update
  double grad_norm = 0;  // global L2 norm before clipping (offloaded: exact mode only, else 0)
  double lr = 0;
  bool skipped = false;   // fp16 overflow: no update this step
  double loss_scale = 1;  // the loss scale this step's backward used (fp16), else 1
  // Offloaded steps: the window since the previous step returned (in steady state one
  // iteration), each resource's busy time within it and the bytes the store moved.
  bool offloaded = false;
  double iteration_s = 0;
  std::array<double, kNumResources> busy_s{};
  // The time the store had a request in flight (the union of the disks' busy times: reads,
  // writes, the optimizer's state streaming).
  double disk_busy_s = 0;
  uint64_t ssd_read_bytes = 0, ssd_write_bytes = 0;
};

}  // namespace fuyou
