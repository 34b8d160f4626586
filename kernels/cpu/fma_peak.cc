#include "kernels/cpu/fma_peak.h"

// GCC 12 reports the _mm512_undefined_* start values inside its own AVX-512 intrinsics as
// uninitialized at each inlined call; every lane is written.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include <omp.h>

#include <chrono>

namespace fuyou::cpu {
namespace {

// Independent accumulators hide the FMA latency (4 cycles) on two FMA pipes: at least 8.
// AVX-512 has 32 vector registers, room for 16 chains; AVX2 has 16, so 10 chains plus the
// two operands stay in registers (16 chains there spilled to the stack and measured half
// the peak on a Zen 3, below what its sgemm reached).
constexpr int kChains = 16;
constexpr int kChainsAvx2 = 10;

__attribute__((target("avx512f"))) double run_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return 2.0 * 16 * kChains * static_cast<double>(iters);
}

__attribute__((target("avx2,fma"))) double run_avx2(long iters) {
  __m256 acc[kChainsAvx2];
  for (int i = 0; i < kChainsAvx2; ++i) acc[i] = _mm256_set1_ps(1.0f + i * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChainsAvx2; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float out[8];
  __m256 s = acc[0];
  for (int i = 1; i < kChainsAvx2; ++i) s = _mm256_add_ps(s, acc[i]);
  _mm256_storeu_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return 2.0 * 8 * kChainsAvx2 * static_cast<double>(iters);
}

double run_best(long iters, const char** isa) {
  if (__builtin_cpu_supports("avx512f")) {
    *isa = "avx512";
    return run_avx512(iters);
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    *isa = "avx2";
    return run_avx2(iters);
  }
  *isa = "scalar";
  double x = 1.0;
  for (long i = 0; i < iters * kChains; ++i) x = x * 0.999999 + 1e-7;
  volatile double sink = x;
  (void)sink;
  return 2.0 * kChains * static_cast<double>(iters);
}

// GFLOP/s of `threads` threads each running the loop; iteration count calibrated so one
// run lasts about `seconds`.
double measure(int threads, double seconds, const char** isa) {
  using clock = std::chrono::steady_clock;
  long iters = 1 << 16;
  for (;;) {
    auto t0 = clock::now();
    run_best(iters, isa);
    double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (dt > seconds / 8 || iters > (1L << 34)) {
      iters = static_cast<long>(iters * seconds / dt);
      break;
    }
    iters *= 4;
  }
  double flops = 0;
  auto t0 = clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
  { flops += run_best(iters, isa); }
  double dt = std::chrono::duration<double>(clock::now() - t0).count();
  return flops / dt / 1e9;
}

}  // namespace

FmaPeak measure_fma_peak(int threads, double seconds) {
  FmaPeak p;
  p.threads = threads;
  p.gflops_per_thread = measure(1, seconds, &p.isa);
  p.gflops_all = measure(threads, seconds, &p.isa);
  return p;
}

}  // namespace fuyou::cpu
