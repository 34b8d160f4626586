// AVX2 and AVX-512 paths of the AdamW kernel. Each mirrors math::adamw_element operation for
// operation (multiplies, explicit FMAs, IEEE sqrt and divide, all correctly rounded), which
// is what makes the fp32 results bit-identical to the scalar path. Conversions to bf16 use
// integer round-to-nearest-even like math::float_to_bf16 (the avx512_bf16 instruction
// flushes subnormals, so it would not match); fp16 uses vcvtps2ph with round-to-nearest,
// which math::float_to_fp16 reproduces.
// GCC 12's AVX-512 conversion intrinsics start from _mm512_undefined_*, which its
// -Wmaybe-uninitialized reports at every inlined call site; the lanes are all written.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "src/optim/adamw_kernels.h"
#include "src/optim/simd_io.h"

namespace fuyou::optim_detail {

// ---- AVX-512 ---------------------------------------------------------------------------

FY_AVX512 void adamw_avx512(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end) {
  const __m512 gs = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(k.decay);
  const __m512 omb1 = _mm512_set1_ps(k.one_minus_b1), b2 = _mm512_set1_ps(k.b2);
  const __m512 omb2 = _mm512_set1_ps(k.one_minus_b2), bc2 = _mm512_set1_ps(k.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(k.eps), neg_step = _mm512_set1_ps(k.neg_step);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_mul_ps(load16(a.grad, a.grad_type, i), gs);
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a.master + i), decay);
    __m512 m = _mm512_loadu_ps(a.m + i);
    __m512 v = _mm512_loadu_ps(a.v + i);
    m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m), m);
    v = _mm512_fmadd_ps(omb2, _mm512_mul_ps(g, g), _mm512_mul_ps(v, b2));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, denom), p);
    _mm512_storeu_ps(a.master + i, p);
    _mm512_storeu_ps(a.m + i, m);
    _mm512_storeu_ps(a.v + i, v);
    if (a.lowp) store16(a.lowp, a.lowp_type, i, p);
  }
  adamw_scalar(a, k, i, end);
}

FY_AVX512 void grad_stats_avx512(const void* g, ElemType t, size_t begin, size_t end, GradStats* out) {
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

// ---- AVX2 ------------------------------------------------------------------------------

FY_AVX2 void adamw_avx2(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end) {
  const __m256 gs = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(k.decay);
  const __m256 omb1 = _mm256_set1_ps(k.one_minus_b1), b2 = _mm256_set1_ps(k.b2);
  const __m256 omb2 = _mm256_set1_ps(k.one_minus_b2), bc2 = _mm256_set1_ps(k.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(k.eps), neg_step = _mm256_set1_ps(k.neg_step);
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_mul_ps(load8(a.grad, a.grad_type, i), gs);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.master + i), decay);
    __m256 m = _mm256_loadu_ps(a.m + i);
    __m256 v = _mm256_loadu_ps(a.v + i);
    m = _mm256_fmadd_ps(omb1, _mm256_sub_ps(g, m), m);
    v = _mm256_fmadd_ps(omb2, _mm256_mul_ps(g, g), _mm256_mul_ps(v, b2));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_fmadd_ps(neg_step, _mm256_div_ps(m, denom), p);
    _mm256_storeu_ps(a.master + i, p);
    _mm256_storeu_ps(a.m + i, m);
    _mm256_storeu_ps(a.v + i, v);
    if (a.lowp) store8(a.lowp, a.lowp_type, i, p);
  }
  adamw_scalar(a, k, i, end);
}

}  // namespace fuyou::optim_detail
