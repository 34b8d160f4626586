// AVX-512 and AVX2 blocks of the packed-state AdamW: one whole block of kStateBlock elements
// inside one tensor. Each step mirrors packed_block_scalar operation for operation (IEEE
// multiplies, divides, square roots and the same explicit FMAs; integer arithmetic for codes,
// remainders and rounding bits), which is what makes the results bit-identical: the block's
// master, moments and working weights are decoded, updated and stored, its new moments kept in
// an L1-resident block buffer (int8: its scales are their largest magnitudes), then encoded.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "src/optim/adamw_kernels.h"
#include "src/optim/adamw_packed_kernels.h"
#include "src/optim/simd_io.h"

namespace fuyou::optim_detail {
namespace {

constexpr size_t B = kStateBlock;

// ---- AVX-512 ---------------------------------------------------------------------------

FY_AVX512 inline __m512i mix32_512(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// math::round_bits of elements idx .. idx + 15.
FY_AVX512 inline __m512i round_bits_512(uint32_t key, uint32_t idx) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i i = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(idx)), lanes);
  return mix32_512(_mm512_xor_si512(i, _mm512_set1_epi32(static_cast<int>(key))));
}

FY_AVX512 inline __m512 round_uniform_512(__m512i bits) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(5.9604644775390625e-8f));
}

// 16 bf16 values (bits in the low halves of 32-bit lanes) from x: NaN quiet, else x's bits plus
// `add` (rounding bits) shifted down.
FY_AVX512 inline __m256i bf16_round_512(__m512 x, __m512i add) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, add), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, quiet));
}

template <MomentFormat F>
FY_AVX512 inline __m512 load_moment_512(const void* data, size_t i, bool second, __m512 scale) {
  if constexpr (F == MomentFormat::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  } else if constexpr (F == MomentFormat::kBF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    // q |q| as a float product: exact (at most 255^2), the integer's value.
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(data) + i));
    const __m512 q = _mm512_cvtepi32_ps(second ? _mm512_cvtepu8_epi32(c) : _mm512_cvtepi8_epi32(c));
    const __m512 qq = _mm512_mul_ps(q, second ? q : _mm512_abs_ps(q));
    const __m512 inv = _mm512_set1_ps(second ? kInvQv2 : kInvQm2);
    return _mm512_mul_ps(scale, _mm512_mul_ps(qq, inv));
  }
}

// One block's int8 codes and scale from its new values x[0, B) (math::code_encode per lane).
FY_AVX512 void encode_int8_512(const float* x, bool second, void* data, float* scales, size_t b0, uint64_t first,
                               uint32_t key, __m512 amax, bool bad) {
  const float smax = _mm512_reduce_max_ps(amax);
  const float s = bad ? std::numeric_limits<float>::quiet_NaN() : smax;
  scales[b0 / B] = s;
  uint8_t* out = static_cast<uint8_t*>(data) + b0;
  if (bad || !(smax > 0.0f)) {
    std::memset(out, 0, B);
    return;
  }
  const float Qf = second ? math::kQv : math::kQm, inv_s = (Qf * Qf) / s;
  const bool by_inverse = inv_s <= std::numeric_limits<float>::max();
  const __m512 vs = _mm512_set1_ps(s), Q2 = _mm512_set1_ps(Qf * Qf), Q = _mm512_set1_ps(Qf), vinv = _mm512_set1_ps(inv_s);
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), zero = _mm512_setzero_ps();
  for (size_t j = 0; j < B; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __m512 a = _mm512_abs_ps(v);
    // math::grid_position, then math::grid_floor from a reciprocal square root estimate
    // (within one of the answer for y >= 1; 0 below), corrected both ways.
    __m512 y = by_inverse ? _mm512_mul_ps(a, vinv) : _mm512_mul_ps(_mm512_div_ps(a, vs), Q2);
    y = _mm512_min_ps(y, Q2);
    __m512 q0 = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_rsqrt14_ps(y)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    q0 = _mm512_mask_mov_ps(q0, _mm512_cmp_ps_mask(y, one, _CMP_LT_OQ), zero);
    q0 = _mm512_mask_sub_ps(q0, _mm512_cmp_ps_mask(_mm512_mul_ps(q0, q0), y, _CMP_GT_OQ), q0, one);
    const __m512 q1 = _mm512_add_ps(q0, one);
    q0 = _mm512_mask_mov_ps(q0, _mm512_cmp_ps_mask(_mm512_mul_ps(q1, q1), y, _CMP_LE_OQ), q1);
    const __m512 frac = _mm512_sub_ps(y, _mm512_mul_ps(q0, q0));
    const __m512 width = _mm512_add_ps(_mm512_mul_ps(two, q0), one);
    const __m512 u = round_uniform_512(round_bits_512(key, static_cast<uint32_t>(first + b0 + j)));
    __m512 q = _mm512_mask_add_ps(q0, _mm512_cmp_ps_mask(_mm512_mul_ps(u, width), frac, _CMP_LT_OQ), q0, one);
    q = _mm512_mask_mov_ps(q, _mm512_cmp_ps_mask(q, Q, _CMP_GT_OQ), Q);
    __m512i qi = _mm512_cvttps_epi32(q);
    if (!second) qi = _mm512_mask_sub_epi32(qi, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), _mm512_setzero_si512(), qi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(qi));
  }
}

template <MasterFormat M, MomentFormat F>
FY_AVX512 void block_512(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay_f) {
  const math::AdamWConsts& k = c.k;
  const __m512 gs = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(decay_f);
  const __m512 omb1 = _mm512_set1_ps(k.one_minus_b1), b2 = _mm512_set1_ps(k.b2);
  const __m512 omb2 = _mm512_set1_ps(k.one_minus_b2), bc2 = _mm512_set1_ps(k.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(k.eps), neg_step = _mm512_set1_ps(k.neg_step);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 sm = _mm512_setzero_ps(), sw = _mm512_setzero_ps();
  if constexpr (F == MomentFormat::kInt8) {
    sm = _mm512_set1_ps(a.m_scale[b0 / B]);
    sw = _mm512_set1_ps(a.v_scale[b0 / B]);
  }
  alignas(64) float mv[B], wv[B];
  __m512 mmax = _mm512_setzero_ps(), wmax = _mm512_setzero_ps();
  __mmask16 mbad = 0, wbad = 0;
  for (size_t j = 0; j < B; j += 16) {
    const size_t i = b0 + j;
    __m512 m = load_moment_512<F>(a.m, i, false, sm);
    __m512 w = load_moment_512<F>(a.v, i, true, sw);
    __m512 v = F == MomentFormat::kInt8 ? _mm512_mul_ps(w, w) : w;
    __m512 p;
    if constexpr (M == MasterFormat::kSplit) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a.lowp) + i));
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int16_t*>(a.master) + i));
      p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16), _mm512_cvtepi16_epi32(l)));
    } else {
      p = _mm512_loadu_ps(static_cast<const float*>(a.master) + i);
    }
    // math::adamw_element_w.
    const __m512 g = _mm512_mul_ps(load16(a.grad, a.grad_type, i), gs);
    p = _mm512_mul_ps(p, decay);
    m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m), m);
    v = _mm512_fmadd_ps(omb2, _mm512_mul_ps(g, g), _mm512_mul_ps(v, b2));
    w = _mm512_sqrt_ps(v);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(w, bc2), eps);
    p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, denom), p);
    if constexpr (M == MasterFormat::kSplit) {
      const __m512i u = _mm512_castps_si512(p);
      const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
      __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16);
      hi = _mm512_mask_blend_epi32(nan, hi, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
      const __m512i lo = _mm512_maskz_sub_epi32(static_cast<__mmask16>(~nan), u, _mm512_slli_epi32(hi, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.lowp) + i), _mm512_cvtepi32_epi16(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<int16_t*>(a.master) + i), _mm512_cvtepi32_epi16(lo));
    } else {
      _mm512_storeu_ps(static_cast<float*>(a.master) + i, p);
      if (a.lowp) store16(a.lowp, a.lowp_type, i, p);
    }
    if constexpr (F == MomentFormat::kF32) {
      _mm512_storeu_ps(static_cast<float*>(a.m) + i, m);
      _mm512_storeu_ps(static_cast<float*>(a.v) + i, v);
    } else if constexpr (F == MomentFormat::kBF16) {
      const __m512i lo16 = _mm512_set1_epi32(0xffff);
      const __m512i rm = _mm512_and_si512(round_bits_512(c.key_m, static_cast<uint32_t>(a.first + i)), lo16);
      const __m512i rv = _mm512_and_si512(round_bits_512(c.key_v, static_cast<uint32_t>(a.first + i)), lo16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.m) + i), bf16_round_512(m, rm));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.v) + i), bf16_round_512(v, rv));
    } else {
      const __m512 am = _mm512_abs_ps(m);
      mbad |= _mm512_cmp_ps_mask(am, inf, _CMP_NLT_UQ);
      wbad |= _mm512_cmp_ps_mask(w, inf, _CMP_NLT_UQ);
      mmax = _mm512_max_ps(mmax, am);
      wmax = _mm512_max_ps(wmax, w);
      _mm512_store_ps(mv + j, m);
      _mm512_store_ps(wv + j, w);
    }
  }
  if constexpr (F == MomentFormat::kInt8) {
    encode_int8_512(mv, false, a.m, a.m_scale, b0, a.first, c.key_m, mmax, mbad != 0);
    encode_int8_512(wv, true, a.v, a.v_scale, b0, a.first, c.key_v, wmax, wbad != 0);
  }
}

// ---- AVX2 ------------------------------------------------------------------------------

FY_AVX2 inline __m256i mix32_256(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

FY_AVX2 inline __m256i round_bits_256(uint32_t key, uint32_t idx) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i i = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(idx)), lanes);
  return mix32_256(_mm256_xor_si256(i, _mm256_set1_epi32(static_cast<int>(key))));
}

FY_AVX2 inline __m256 round_uniform_256(__m256i bits) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 8)), _mm256_set1_ps(5.9604644775390625e-8f));
}

// Eight 32-bit lanes (each within 16 bits: unsigned when `is_unsigned`, else signed) packed to
// eight 16-bit values.
FY_AVX2 inline __m128i pack16_256(__m256i x, bool is_unsigned) {
  const __m256i p = is_unsigned ? _mm256_packus_epi32(x, x) : _mm256_packs_epi32(x, x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

FY_AVX2 inline __m128i bf16_round_256(__m256 x, __m256i add) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, add), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return pack16_256(_mm256_blendv_epi8(r, quiet, nan), true);
}

template <MomentFormat F>
FY_AVX2 inline __m256 load_moment_256(const void* data, size_t i, bool second, __m256 scale) {
  if constexpr (F == MomentFormat::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(data) + i);
  } else if constexpr (F == MomentFormat::kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(data) + i));
    const __m256 q = _mm256_cvtepi32_ps(second ? _mm256_cvtepu8_epi32(c) : _mm256_cvtepi8_epi32(c));
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 qq = _mm256_mul_ps(q, second ? q : _mm256_and_ps(q, absmask));
    const __m256 inv = _mm256_set1_ps(second ? kInvQv2 : kInvQm2);
    return _mm256_mul_ps(scale, _mm256_mul_ps(qq, inv));
  }
}

FY_AVX2 inline float reduce_max_256(__m256 x) {
  alignas(32) float t[8];
  _mm256_store_ps(t, x);
  float r = t[0];
  for (int i = 1; i < 8; ++i) r = t[i] > r ? t[i] : r;
  return r;
}

FY_AVX2 void encode_int8_256(const float* x, bool second, void* data, float* scales, size_t b0, uint64_t first,
                             uint32_t key, __m256 amax, bool bad) {
  const float smax = reduce_max_256(amax);
  const float s = bad ? std::numeric_limits<float>::quiet_NaN() : smax;
  scales[b0 / B] = s;
  uint8_t* out = static_cast<uint8_t*>(data) + b0;
  if (bad || !(smax > 0.0f)) {
    std::memset(out, 0, B);
    return;
  }
  const float Qf = second ? math::kQv : math::kQm, inv_s = (Qf * Qf) / s;
  const bool by_inverse = inv_s <= std::numeric_limits<float>::max();
  const __m256 vs = _mm256_set1_ps(s), Q2 = _mm256_set1_ps(Qf * Qf), Q = _mm256_set1_ps(Qf), vinv = _mm256_set1_ps(inv_s);
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), zero = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (size_t j = 0; j < B; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 a = _mm256_and_ps(v, absmask);
    __m256 y = by_inverse ? _mm256_mul_ps(a, vinv) : _mm256_mul_ps(_mm256_div_ps(a, vs), Q2);
    y = _mm256_min_ps(y, Q2);
    __m256 q0 = _mm256_floor_ps(_mm256_mul_ps(y, _mm256_rsqrt_ps(y)));
    q0 = _mm256_blendv_ps(q0, zero, _mm256_cmp_ps(y, one, _CMP_LT_OQ));
    q0 = _mm256_sub_ps(q0, _mm256_and_ps(_mm256_cmp_ps(_mm256_mul_ps(q0, q0), y, _CMP_GT_OQ), one));
    const __m256 q1 = _mm256_add_ps(q0, one);
    q0 = _mm256_blendv_ps(q0, q1, _mm256_cmp_ps(_mm256_mul_ps(q1, q1), y, _CMP_LE_OQ));
    const __m256 frac = _mm256_sub_ps(y, _mm256_mul_ps(q0, q0));
    const __m256 width = _mm256_add_ps(_mm256_mul_ps(two, q0), one);
    const __m256 u = round_uniform_256(round_bits_256(key, static_cast<uint32_t>(first + b0 + j)));
    __m256 q = _mm256_add_ps(q0, _mm256_and_ps(_mm256_cmp_ps(_mm256_mul_ps(u, width), frac, _CMP_LT_OQ), one));
    q = _mm256_blendv_ps(q, Q, _mm256_cmp_ps(q, Q, _CMP_GT_OQ));
    __m256i qi = _mm256_cvttps_epi32(q);
    __m128i packed;
    if (second) {
      packed = _mm_packus_epi16(pack16_256(qi, true), _mm_setzero_si128());
    } else {
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_LT_OQ));
      qi = _mm256_blendv_epi8(qi, _mm256_sub_epi32(_mm256_setzero_si256(), qi), neg);
      packed = _mm_packs_epi16(pack16_256(qi, false), _mm_setzero_si128());
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), packed);
  }
}

template <MasterFormat M, MomentFormat F>
FY_AVX2 void block_256(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay_f) {
  const math::AdamWConsts& k = c.k;
  const __m256 gs = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(decay_f);
  const __m256 omb1 = _mm256_set1_ps(k.one_minus_b1), b2 = _mm256_set1_ps(k.b2);
  const __m256 omb2 = _mm256_set1_ps(k.one_minus_b2), bc2 = _mm256_set1_ps(k.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(k.eps), neg_step = _mm256_set1_ps(k.neg_step);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 sm = _mm256_setzero_ps(), sw = _mm256_setzero_ps();
  if constexpr (F == MomentFormat::kInt8) {
    sm = _mm256_set1_ps(a.m_scale[b0 / B]);
    sw = _mm256_set1_ps(a.v_scale[b0 / B]);
  }
  alignas(32) float mv[B], wv[B];
  __m256 mmax = _mm256_setzero_ps(), wmax = _mm256_setzero_ps();
  int mbad = 0, wbad = 0;
  for (size_t j = 0; j < B; j += 8) {
    const size_t i = b0 + j;
    __m256 m = load_moment_256<F>(a.m, i, false, sm);
    __m256 w = load_moment_256<F>(a.v, i, true, sw);
    __m256 v = F == MomentFormat::kInt8 ? _mm256_mul_ps(w, w) : w;
    __m256 p;
    if constexpr (M == MasterFormat::kSplit) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a.lowp) + i));
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(a.master) + i));
      p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16), _mm256_cvtepi16_epi32(l)));
    } else {
      p = _mm256_loadu_ps(static_cast<const float*>(a.master) + i);
    }
    const __m256 g = _mm256_mul_ps(load8(a.grad, a.grad_type, i), gs);
    p = _mm256_mul_ps(p, decay);
    m = _mm256_fmadd_ps(omb1, _mm256_sub_ps(g, m), m);
    v = _mm256_fmadd_ps(omb2, _mm256_mul_ps(g, g), _mm256_mul_ps(v, b2));
    w = _mm256_sqrt_ps(v);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(w, bc2), eps);
    p = _mm256_fmadd_ps(neg_step, _mm256_div_ps(m, denom), p);
    if constexpr (M == MasterFormat::kSplit) {
      const __m256i u = _mm256_castps_si256(p);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
      __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16);
      hi = _mm256_blendv_epi8(hi, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
      const __m256i lo = _mm256_andnot_si256(nan, _mm256_sub_epi32(u, _mm256_slli_epi32(hi, 16)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.lowp) + i), pack16_256(hi, true));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int16_t*>(a.master) + i), pack16_256(lo, false));
    } else {
      _mm256_storeu_ps(static_cast<float*>(a.master) + i, p);
      if (a.lowp) store8(a.lowp, a.lowp_type, i, p);
    }
    if constexpr (F == MomentFormat::kF32) {
      _mm256_storeu_ps(static_cast<float*>(a.m) + i, m);
      _mm256_storeu_ps(static_cast<float*>(a.v) + i, v);
    } else if constexpr (F == MomentFormat::kBF16) {
      const __m256i lo16 = _mm256_set1_epi32(0xffff);
      const __m256i rm = _mm256_and_si256(round_bits_256(c.key_m, static_cast<uint32_t>(a.first + i)), lo16);
      const __m256i rv = _mm256_and_si256(round_bits_256(c.key_v, static_cast<uint32_t>(a.first + i)), lo16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.m) + i), bf16_round_256(m, rm));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.v) + i), bf16_round_256(v, rv));
    } else {
      const __m256 am = _mm256_and_ps(m, absmask);
      mbad |= _mm256_movemask_ps(_mm256_cmp_ps(am, inf, _CMP_NLT_UQ));
      wbad |= _mm256_movemask_ps(_mm256_cmp_ps(w, inf, _CMP_NLT_UQ));
      mmax = _mm256_max_ps(mmax, am);
      wmax = _mm256_max_ps(wmax, w);
      _mm256_store_ps(mv + j, m);
      _mm256_store_ps(wv + j, w);
    }
  }
  if constexpr (F == MomentFormat::kInt8) {
    encode_int8_256(mv, false, a.m, a.m_scale, b0, a.first, c.key_m, mmax, mbad != 0);
    encode_int8_256(wv, true, a.v, a.v_scale, b0, a.first, c.key_v, wmax, wbad != 0);
  }
}

}  // namespace

void packed_block_avx512(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay) {
  const bool split = a.format.master == MasterFormat::kSplit;
  switch (a.format.moments) {
    case MomentFormat::kF32:
      return split ? block_512<MasterFormat::kSplit, MomentFormat::kF32>(a, c, b0, decay)
                   : block_512<MasterFormat::kF32, MomentFormat::kF32>(a, c, b0, decay);
    case MomentFormat::kBF16:
      return split ? block_512<MasterFormat::kSplit, MomentFormat::kBF16>(a, c, b0, decay)
                   : block_512<MasterFormat::kF32, MomentFormat::kBF16>(a, c, b0, decay);
    case MomentFormat::kInt8:
      return split ? block_512<MasterFormat::kSplit, MomentFormat::kInt8>(a, c, b0, decay)
                   : block_512<MasterFormat::kF32, MomentFormat::kInt8>(a, c, b0, decay);
  }
}

void packed_block_avx2(const PackedAdamWArgs& a, const PackedConsts& c, size_t b0, float decay) {
  const bool split = a.format.master == MasterFormat::kSplit;
  switch (a.format.moments) {
    case MomentFormat::kF32:
      return split ? block_256<MasterFormat::kSplit, MomentFormat::kF32>(a, c, b0, decay)
                   : block_256<MasterFormat::kF32, MomentFormat::kF32>(a, c, b0, decay);
    case MomentFormat::kBF16:
      return split ? block_256<MasterFormat::kSplit, MomentFormat::kBF16>(a, c, b0, decay)
                   : block_256<MasterFormat::kF32, MomentFormat::kBF16>(a, c, b0, decay);
    case MomentFormat::kInt8:
      return split ? block_256<MasterFormat::kSplit, MomentFormat::kInt8>(a, c, b0, decay)
                   : block_256<MasterFormat::kF32, MomentFormat::kInt8>(a, c, b0, decay);
  }
}

}  // namespace fuyou::optim_detail
