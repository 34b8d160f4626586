// Measures the machine's memory bandwidth with a STREAM-style triad, the roofline for the
// optimizer (which is memory-bound: a few flops per 26-30 bytes moved).
#pragma once

#include <cstddef>

namespace fuyou {

struct MemBandwidth {
  double triad_GBps = 0;  // a[i] = b[i] + s * c[i]: 2 reads + 1 write per element
  double copy_GBps = 0;   // a[i] = b[i]
  size_t bytes_per_array = 0;
  int threads = 0;
};

// Arrays of `bytes_per_array` each (make them far larger than the caches); best of `reps`.
MemBandwidth measure_mem_bandwidth(size_t bytes_per_array, int reps = 5);

}  // namespace fuyou
