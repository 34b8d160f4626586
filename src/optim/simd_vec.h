// Internal: the vector operations the AdamW kernels use, once per instruction set, each set in
// its own namespace (optim_detail::avx512, optim_detail::avx2) as a struct `Vec` with the same
// members. A kernel written once against `Vec` (adamw_simd_loop.inc) is included inside each
// namespace within a `#pragma GCC target` region for its set (adamw_simd.cc), so each copy
// compiles for its own instruction set, inlines these members, and nothing of either set
// reaches the rest of the program (which runs on CPUs without them). Function templates or
// generic lambdas cannot do this: they take their target from where they are defined.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "src/optim/simd_io.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
namespace fuyou::optim_detail::avx512 {

struct Vec {
  using F = __m512;
  static constexpr size_t kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  // kWidth elements of type t at element i, as floats (simd_io.h's conversions).
  static F load_elems(const void* p, ElemType t, size_t i) { return load16(p, t, i); }
  static void store_elems(void* p, ElemType t, size_t i, F x) { store16(p, t, i, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
  static F zero() { return _mm512_setzero_ps(); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 1 / sqrt(a) to about 14 bits: an estimate, which the callers correct exactly.
  static F rsqrt_estimate(F a) { return _mm512_rsqrt14_ps(a); }
  // mag (>= 0) with sign's sign bit: (mag | (sign & 0x80000000)) in one ternary-logic op.
  static F with_sign_of(F mag, F sign) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(mag), _mm512_castps_si512(sign), _mm512_set1_epi32(INT32_MIN), 0xf8));
  }

  // Lane masks from ordered comparisons (false with a NaN) and NaN tests.
  using M = __mmask16;
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M is_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static bool any(M m) { return m != 0; }
  static F select(M m, F if_set, F otherwise) { return _mm512_mask_mov_ps(otherwise, m, if_set); }

  // 32-bit integer lanes.
  using I = __m512i;
  static I set1_i(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I zero_i() { return _mm512_setzero_si512(); }
  static I lanes() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul_i(I a, I b) { return _mm512_mullo_epi32(a, b); }  // the low 32 bits
  static I xor_i(I a, I b) { return _mm512_xor_si512(a, b); }
  static I or_i(I a, I b) { return _mm512_or_si512(a, b); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I max_i(I a, I b) { return _mm512_max_epi32(a, b); }  // signed
  static int32_t reduce_max_i(I a) { return _mm512_reduce_max_epi32(a); }
  template <int N>
  static I shr(I a) {
    return _mm512_srli_epi32(a, N);
  }
  template <int N>
  static I shl(I a) {
    return _mm512_slli_epi32(a, N);
  }
  static I select_i(M m, I if_set, I otherwise) {
    return _mm512_mask_mov_epi32(otherwise, m, if_set);
  }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }     // the value
  static I truncate(F a) { return _mm512_cvttps_epi32(a); }    // the value toward zero
  static F bits_float(I a) { return _mm512_castsi512_ps(a); }  // the same bits
  static I bits_int(F a) { return _mm512_castps_si512(a); }

  // kWidth narrow integers widened to 32-bit lanes, and 32-bit lanes stored narrow (each lane
  // already within the narrow type's range).
  static I load_u16(const void* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  static I load_i16(const void* p) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  static I load_u8(const void* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static I load_i8(const void* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static void store_16(void* p, I a) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a));
  }
  // 2 kWidth lanes a, b (within int16's range if Signed, else uint16's) stored as 2 kWidth
  // 16-bit integers in that order: one saturating pack (exact there) and one permute.
  template <bool Signed>
  static void store_16x2(void* p, I a, I b) {
    const I x = Signed ? _mm512_packs_epi32(a, b) : _mm512_packus_epi32(a, b);
    // 128-bit lane k holds a's and b's quarter k.
    const I order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi64(order, x));
  }
  // 4 kWidth lanes a, b, c, d (each lane within int8's range if Signed, else uint8's) stored
  // as 4 kWidth bytes in that order: two saturating packs (exact within those ranges) and one
  // permute, where narrowing each vector alone takes a shuffle per vector.
  template <bool Signed>
  static void store_8x4(void* p, I a, I b, I c, I d) {
    const I ab = _mm512_packs_epi32(a, b), cd = _mm512_packs_epi32(c, d);
    const I x = Signed ? _mm512_packs_epi16(ab, cd) : _mm512_packus_epi16(ab, cd);
    // 128-bit lane k holds a, b, c, d's dwords k: gather each vector's four.
    const I order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi32(order, x));
  }
};

}  // namespace fuyou::optim_detail::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fuyou::optim_detail::avx2 {

struct Vec {
  using F = __m256;
  static constexpr size_t kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_elems(const void* p, ElemType t, size_t i) { return load8(p, t, i); }
  static void store_elems(void* p, ElemType t, size_t i, F x) { store8(p, t, i, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F zero() { return _mm256_setzero_ps(); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F floor(F a) { return _mm256_floor_ps(a); }
  // 1 / sqrt(a) to about 12 bits: an estimate, which the callers correct exactly.
  static F rsqrt_estimate(F a) { return _mm256_rsqrt_ps(a); }
  static F with_sign_of(F mag, F sign) {
    return _mm256_or_ps(mag, _mm256_and_ps(sign, _mm256_set1_ps(-0.0f)));
  }

  // Lane masks: all ones in a lane where the comparison holds.
  using M = __m256;
  static M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M is_nan(F a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static F select(M m, F if_set, F otherwise) { return _mm256_blendv_ps(otherwise, if_set, m); }

  using I = __m256i;
  static I set1_i(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I zero_i() { return _mm256_setzero_si256(); }
  static I lanes() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul_i(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I xor_i(I a, I b) { return _mm256_xor_si256(a, b); }
  static I or_i(I a, I b) { return _mm256_or_si256(a, b); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I max_i(I a, I b) { return _mm256_max_epi32(a, b); }
  static int32_t reduce_max_i(I a) {
    const __m128i h = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i q = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    return _mm_cvtsi128_si32(_mm_max_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
  }
  template <int N>
  static I shr(I a) {
    return _mm256_srli_epi32(a, N);
  }
  template <int N>
  static I shl(I a) {
    return _mm256_slli_epi32(a, N);
  }
  static I select_i(M m, I if_set, I otherwise) {
    return _mm256_blendv_epi8(otherwise, if_set, _mm256_castps_si256(m));
  }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I truncate(F a) { return _mm256_cvttps_epi32(a); }
  static F bits_float(I a) { return _mm256_castsi256_ps(a); }
  static I bits_int(F a) { return _mm256_castps_si256(a); }

  static I load_u16(const void* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static I load_i16(const void* p) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static I load_u8(const void* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  static I load_i8(const void* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  // The low 16 bits of each lane, as the AVX-512 path's truncating vpmovdw: one in-lane byte
  // shuffle gathers each 128-bit half's values into its low bytes, one cross-lane permute puts
  // the two halves' together (two shuffles where narrowing each half alone takes five; AVX2
  // machines often have one shuffle port).
  static void store_16(void* p, I a) {
    const I pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1,
                                    4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const I both = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0x08);  // quads 0, 2
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(both));
  }
  template <bool Signed>
  static void store_16x2(void* p, I a, I b) {
    const I x = Signed ? _mm256_packs_epi32(a, b) : _mm256_packus_epi32(a, b);
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm256_permute4x64_epi64(x, 0xd8));
  }
  template <bool Signed>
  static void store_8x4(void* p, I a, I b, I c, I d) {
    const I ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const I x = Signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
    // 128-bit half k holds a, b, c, d's dwords k.
    _mm256_storeu_si256(static_cast<__m256i*>(p),
                        _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};

}  // namespace fuyou::optim_detail::avx2
#pragma GCC pop_options
