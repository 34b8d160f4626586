// AVX2 and AVX-512 paths of the AdamW kernel: one loop (adamw_simd_loop.inc) compiled for each
// instruction set, and the AVX-512 gradient statistics. Conversions to bf16 use integer
// round-to-nearest-even like math::float_to_bf16 (the avx512_bf16 instruction flushes
// subnormals, so it would not match); fp16 uses vcvtps2ph with round-to-nearest, which
// math::float_to_fp16 reproduces (simd_io.h).
// GCC 12's AVX-512 conversion intrinsics start from _mm512_undefined_*, which its
// -Wmaybe-uninitialized reports at every inlined call site; the lanes are all written.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "src/optim/adamw_kernels.h"
#include "src/optim/simd_io.h"
#include "src/optim/simd_vec.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace fuyou::optim_detail::avx512 {
#include "src/optim/adamw_simd_loop.inc"
}  // namespace fuyou::optim_detail::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fuyou::optim_detail::avx2 {
#include "src/optim/adamw_simd_loop.inc"
}  // namespace fuyou::optim_detail::avx2
#pragma GCC pop_options

namespace fuyou::optim_detail {

void adamw_avx512(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end) {
  avx512::adamw_vectors(a, k, begin, end);
}

void adamw_avx2(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end) {
  avx2::adamw_vectors(a, k, begin, end);
}

FY_AVX512 void grad_stats_avx512(const void* g, ElemType t, size_t begin, size_t end,
                                 GradStats* out) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  uint64_t bad = 0;
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 x = load16(g, t, i);
    __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(x), inf, _CMP_LT_OQ);
    bad += 16 - __builtin_popcount(finite);
    x = _mm512_maskz_mov_ps(finite, x);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  out->sum_squares += _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  out->nonfinite += bad;
  grad_stats_scalar(g, t, i, end, out);
}

}  // namespace fuyou::optim_detail
