#include "src/optim/mem_bandwidth.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

#include "fuyou/timing.h"

namespace fuyou {

MemBandwidth measure_mem_bandwidth(size_t bytes_per_array, int reps) {
  using clock = std::chrono::steady_clock;
  const size_t n = bytes_per_array / sizeof(float);
  auto alloc = [&] {
    return std::unique_ptr<float, decltype(&std::free)>(
        static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))), &std::free);
  };
  auto a = alloc(), b = alloc(), c = alloc();
  float *pa = a.get(), *pb = b.get(), *pc = c.get();
  // First touch by the threads that will use the pages.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) {
    pa[i] = 0.0f;
    pb[i] = 1.0f;
    pc[i] = 2.0f;
  }
  MemBandwidth r;
  r.bytes_per_array = n * sizeof(float);
  r.threads = omp_get_max_threads();
  double best_triad = 1e30, best_copy = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = clock::now();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) pa[i] = pb[i] + 0.5f * pc[i];
    best_triad = std::min(best_triad, seconds_since(t0));
    t0 = clock::now();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) pc[i] = pa[i];
    best_copy = std::min(best_copy, seconds_since(t0));
  }
  r.triad_GBps = 3.0 * n * sizeof(float) / best_triad / 1e9;
  r.copy_GBps = 2.0 * n * sizeof(float) / best_copy / 1e9;
  return r;
}

}  // namespace fuyou
