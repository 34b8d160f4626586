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
};

}  // namespace fuyou::optim_detail::avx2
#pragma GCC pop_options
