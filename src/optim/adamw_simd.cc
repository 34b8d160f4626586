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

namespace fuyou::optim_detail {

#define FY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define FY_AVX2 __attribute__((target("avx2,fma,f16c")))

// ---- AVX-512 ---------------------------------------------------------------------------

FY_AVX512 static inline __m512 load16(const void* g, ElemType t, size_t i) {
  switch (t) {
    case ElemType::kF32: return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    case ElemType::kBF16: {
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case ElemType::kF16: {
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      return _mm512_cvtph_ps(h);
    }
  }
  return _mm512_setzero_ps();
}

FY_AVX512 static inline void store16(void* out, ElemType t, size_t i, __m512 x) {
  switch (t) {
    case ElemType::kF32: _mm512_storeu_ps(static_cast<float*>(out) + i, x); break;
    case ElemType::kBF16: {
      __m512i bits = _mm512_castps_si512(x);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
      __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm512_cvtepi32_epi16(r));
      break;
    }
    case ElemType::kF16:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

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

FY_AVX2 static inline __m256 load8(const void* g, ElemType t, size_t i) {
  switch (t) {
    case ElemType::kF32: return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    case ElemType::kBF16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case ElemType::kF16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      return _mm256_cvtph_ps(h);
    }
  }
  return _mm256_setzero_ps();
}

FY_AVX2 static inline void store8(void* out, ElemType t, size_t i, __m256 x) {
  switch (t) {
    case ElemType::kF32: _mm256_storeu_ps(static_cast<float*>(out) + i, x); break;
    case ElemType::kBF16: {
      __m256i bits = _mm256_castps_si256(x);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
      __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
      __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
      // Values are < 2^16, so unsigned-saturating packing is exact; the permute gathers the
      // two 64-bit halves that packus leaves in separate 128-bit lanes.
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), _mm256_castsi256_si128(packed));
      break;
    }
    case ElemType::kF16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

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
