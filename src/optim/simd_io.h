// Internal: loads and stores of gradient and weight vectors in each element type, per
// instruction set, shared by the AdamW kernels (adamw_simd.cc, adamw_packed_simd.cc). bf16
// stores round to nearest even with integer arithmetic like math::float_to_bf16 (the
// avx512_bf16 instruction flushes subnormals, so it would not match); fp16 uses vcvtps2ph with
// round-to-nearest, which math::float_to_fp16 reproduces.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "fuyou/elem_type.h"

#define FY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define FY_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace fuyou::optim_detail {

// ---- AVX-512 ---------------------------------------------------------------------------

FY_AVX512 static inline __m512 load16(const void* g, ElemType t, size_t i) {
  switch (t) {
    case ElemType::kF32:
      return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    case ElemType::kBF16: {
      __m256i h =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case ElemType::kF16: {
      __m256i h =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
      return _mm512_cvtph_ps(h);
    }
  }
  return _mm512_setzero_ps();
}

FY_AVX512 static inline void store16(void* out, ElemType t, size_t i, __m512 x) {
  switch (t) {
    case ElemType::kF32:
      _mm512_storeu_ps(static_cast<float*>(out) + i, x);
      break;
    case ElemType::kBF16: {
      __m512i bits = _mm512_castps_si512(x);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
      __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtepi32_epi16(r));
      break;
    }
    case ElemType::kF16:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

// ---- AVX2 ------------------------------------------------------------------------------

FY_AVX2 static inline __m256 load8(const void* g, ElemType t, size_t i) {
  switch (t) {
    case ElemType::kF32:
      return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    case ElemType::kBF16: {
      __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case ElemType::kF16: {
      __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      return _mm256_cvtph_ps(h);
    }
  }
  return _mm256_setzero_ps();
}

FY_AVX2 static inline void store8(void* out, ElemType t, size_t i, __m256 x) {
  switch (t) {
    case ElemType::kF32:
      _mm256_storeu_ps(static_cast<float*>(out) + i, x);
      break;
    case ElemType::kBF16: {
      __m256i bits = _mm256_castps_si256(x);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
      __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
      __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
      // Values are < 2^16, so unsigned-saturating packing is exact; the permute gathers the
      // two 64-bit halves that packus leaves in separate 128-bit lanes.
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                       _mm256_castsi256_si128(packed));
      break;
    }
    case ElemType::kF16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

}  // namespace fuyou::optim_detail
