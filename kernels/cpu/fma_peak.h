// Measures this CPU's fp32 FMA peak, the roofline that GEMM efficiency is reported against.
#pragma once

namespace fuyou::cpu {

struct FmaPeak {
  double gflops_per_thread = 0;  // one thread, widest vector unit available
  double gflops_all = 0;         // every thread at once
  const char* isa = "";          // "avx512", "avx2" or "scalar"
  int threads = 0;
};

// Runs independent FMA chains for about `seconds` per measurement.
FmaPeak measure_fma_peak(int threads, double seconds = 0.3);

}  // namespace fuyou::cpu
