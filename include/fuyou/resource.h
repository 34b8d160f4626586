// The resources an iteration's operations run on, each a queue of its own: GPU (or CPU
// backend) compute, the two copy directions, SSD reads and writes, the CPU optimizer.
#pragma once

namespace fuyou {

enum class Resource { kCompute, kH2D, kD2H, kSsdRead, kSsdWrite, kOptimizer };
constexpr int kNumResources = 6;
const char* resource_name(Resource r);

}  // namespace fuyou
