// Per-element math shared by every backend.
//
// Each function here is the single definition of a piece of arithmetic: the CPU backend
// loops over it, CUDA kernels call it per thread, and the CPU unit tests check it. Keep
// them small, branch-light and free of library calls that have no device version.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FY_HD __host__ __device__ __forceinline__
#else
#define FY_HD inline
#endif

namespace fuyou::math {

// sqrt(2 / pi), the constant of the tanh approximation of GELU used by GPT-2.
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// exp(x) in fp32 without a library call, so loops over it vectorise on the CPU and the same
// arithmetic runs on the GPU. x = n ln2 + r with |r| <= ln2/2; e^r by its Taylor series to
// degree 7 (truncation below 6e-9 relative); 2^n by building the exponent bits. Relative
// error about 2 ulp over the clamped range [-87.3, 88.7]; below that it returns ~1.2e-38
// rather than 0, and from about 88.38 up it returns inf (n rounds to 128, whose exponent
// bits are those of inf).
FY_HD float exp_fast(float x) {
  // Comparisons rather than fminf/fmaxf: those are library calls on some compilers.
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  float n = rintf(x * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, x);  // ln2 split in two: exact product n * hi
  r = fmaf(n, -1.42860682030941723e-6f, r);
  float p = 1.0f / 5040;
  p = fmaf(p, r, 1.0f / 720);
  p = fmaf(p, r, 1.0f / 120);
  p = fmaf(p, r, 1.0f / 24);
  p = fmaf(p, r, 1.0f / 6);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh through exp_fast: 1 - 2 / (e^(2u) + 1). Absolute error ~1e-7, which is what GELU needs
// (its result is 0.5 x (1 + tanh), so absolute error in tanh is relative error in GELU).
FY_HD float tanh_fast(float u) { return 1.0f - 2.0f / (exp_fast(2.0f * u) + 1.0f); }

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
FY_HD float gelu(float x) {
  float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanh_fast(u));
}

// d gelu(x) / dx for the same approximation.
FY_HD float gelu_grad(float x) {
  float x2 = x * x;
  float u = kGeluScale * (x + kGeluCubic * x2 * x);
  float t = tanh_fast(u);
  float sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x2);
}

// LayerNorm statistics are accumulated in this type: fp32 rows of a few thousand values
// lose digits in a float sum, and the PyTorch reference agrees to 1e-5 only this way.
using StatAcc = double;

// Normalises one value given the row statistics.
FY_HD float layernorm_apply(float x, float mean, float rstd, float w, float b) {
  return (x - mean) * rstd * w + b;
}

// RMSNorm of one value given the row's 1 / sqrt(mean(x^2) + eps).
FY_HD float rmsnorm_apply(float x, float rstd, float w) { return x * rstd * w; }

// The rotary angle of pair i of a head at position pos: pos * inv_freq[i] in fp32, as
// Hugging Face's rotary embedding computes it (the table: fuyou/rope.h).
FY_HD float rope_angle(int pos, float inv_freq) { return static_cast<float>(pos) * inv_freq; }

// The default variant's inverse frequency of pair i (0 <= i < D/2), computed in fp32 in the
// order Hugging Face's Llama uses (1 / theta^(2i/D)), so the engine rotates by the same
// rounded angle as the checkpoints' reference.
inline float rope_default_inv_freq(int i, int D, float theta) {
  return 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
}

// Rotates the pair (a, b) = (x[i], x[i + D/2]) by the angle with cosine c and sine s:
// (a c - b s, b c + a s), the rotate-half form. Backward is the same call with -s.
FY_HD void rope_rotate(float& a, float& b, float c, float s) {
  float a2 = a * c - b * s;
  float b2 = b * c + a * s;
  a = a2;
  b = b2;
}

// The logistic function through exp_fast; for x far below 0 exp_fast clamps, giving ~1e-38
// rather than an inf in the denominator.
FY_HD float sigmoid(float x) { return 1.0f / (1.0f + exp_fast(-x)); }

// SiLU (swish): x sigmoid(x), Llama's MLP gate activation.
FY_HD float silu(float x) { return x * sigmoid(x); }

// d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x).
FY_HD float silu_grad(float x) {
  float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// ReLU (opt's MLP activation) and its derivative (0 at x = 0, as PyTorch).
FY_HD float relu(float x) { return x > 0.0f ? x : 0.0f; }
FY_HD float relu_grad(float x) { return x > 0.0f ? 1.0f : 0.0f; }

// Rounds fp32 to the nearest bf16 (ties to even); NaN stays NaN (quiet).
FY_HD uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

FY_HD float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds fp32 to the nearest IEEE half (ties to even), with subnormals, overflow to inf and
// NaN kept quiet: the same result as the hardware conversion (F16C vcvtps2ph with
// round-to-nearest), which the tests check bit for bit.
FY_HD uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (a >= 0x38800000u) {                                              // normal half
    uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
  // Subnormal half: shift the 24-bit significand right and round to nearest even.
  uint32_t e = a >> 23;
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;  // 14..24
  uint32_t half = 1u << (shift - 1);
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t q = mant >> shift;
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

FY_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t u;
  if (e == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (e != 0) {
    u = sign | ((e + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    int shift = 0;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      ++shift;
    }
    u = sign | ((113u - shift) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The AdamW update of one element. The constants are computed once per step (AdamWConsts);
// the order of operations, with explicit fused multiply-adds, is the contract every SIMD
// path reproduces, so all paths give bit-identical fp32 state.
struct AdamWConsts {
  float grad_scale;    // multiplies the gradient first (clipping, loss-scale undo)
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // 1 - beta1
  float b2;            // beta2
  float one_minus_b2;  // 1 - beta2
  float bc2_sqrt;      // sqrt(1 - beta2^t)
  float eps;
  float neg_step;  // -lr / (1 - beta1^t)
};

FY_HD void adamw_element(float& p, float& m, float& v, float g, const AdamWConsts& k) {
  g = g * k.grad_scale;
  p = p * k.decay;
  m = fmaf(k.one_minus_b1, g - m, m);
  v = fmaf(k.one_minus_b2, g * g, v * k.b2);
  float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
  p = fmaf(k.neg_step, m / denom, p);
}

// The same update, also giving sqrt(v) (the denominator's root), which int8 state stores:
// one square root serves both.
FY_HD void adamw_element_w(float& p, float& m, float& v, float& w, float g, const AdamWConsts& k) {
  g = g * k.grad_scale;
  p = p * k.decay;
  m = fmaf(k.one_minus_b1, g - m, m);
  v = fmaf(k.one_minus_b2, g * g, v * k.b2);
  w = sqrtf(v);
  float denom = w / k.bc2_sqrt + k.eps;
  p = fmaf(k.neg_step, m / denom, p);
}

// ---- Optimizer state in fewer bytes (optimizer.state, optimizer.master; docs/precision.md) ----
//
// These functions are the contract that the SIMD paths (src/optim/adamw_packed_simd.cc) and
// the Python reference (tests/reference/optim_state_ref.py) reproduce bit for bit.

FY_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FY_HD float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Split master: an fp32 master x is kept as hi, the bf16 working weight, and lo, a 16-bit
// remainder, with bits(x) = (hi << 16) + lo exactly (two's complement, modulo 2^32). hi is x
// rounded to the nearest bf16 with ties away from zero (adding half a bf16 ulp to the
// magnitude bits), which puts the remainder in [-2^15, 2^15): nearest-even would need one
// value more. NaN: hi is the quiet NaN float_to_bf16 gives and lo 0 (the payload's low bits
// are not kept).
FY_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
FY_HD uint16_t split_hi(float x) {
  const uint32_t u = f32_bits(x);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x8000u) >> 16);
}
FY_HD int16_t split_lo(float x) {
  const uint32_t u = f32_bits(x);
  if (is_nan_bits(u)) return 0;
  return static_cast<int16_t>(
      static_cast<uint16_t>(u - (static_cast<uint32_t>(split_hi(x)) << 16)));
}
FY_HD float split_join(uint16_t hi, int16_t lo) {
  return f32_from_bits((static_cast<uint32_t>(hi) << 16) +
                       static_cast<uint32_t>(static_cast<int32_t>(lo)));
}

// Rounding bits: a counter-based hash (Wellons' lowbias32) of the element's index within its
// parameter group and a key per update and moment, so the bits depend on nothing but the
// state's place and the step: in memory, offloaded, on any thread count and after a resume
// alike.
FY_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// The key of group g's update at Adam step t; the moments' streams differ by a constant.
FY_HD uint32_t round_key(uint32_t group, int64_t t) {
  return mix32(mix32(static_cast<uint32_t>(t)) + group * 0x9e3779b9u);
}
constexpr uint32_t kKeyM = 0x68e31da4u, kKeyV = 0xb5297a4du;
FY_HD uint32_t round_bits(uint32_t key, uint32_t i) { return mix32(i ^ key); }
// A uniform variate in [0, 1) from the top 24 bits; 0.5 rounds to nearest.
FY_HD float round_uniform(uint32_t bits) {
  return static_cast<float>(bits >> 8) * 5.9604644775390625e-8f;
}

// bf16 state with stochastic rounding: the 16 bits below the bf16 are rounded up with
// probability equal to their value (bits' low 16 bits added to the magnitude); unbiased, so a
// moment whose change is below half a bf16 ulp still moves on average. NaN stays NaN (quiet).
FY_HD uint16_t bf16_round_stochastic(float x, uint32_t bits) {
  const uint32_t u = f32_bits(x);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + (bits & 0xffffu)) >> 16);
}

// int8 state: blocks of kStateBlock elements, each with one fp32 scale s (the block's largest
// magnitude) and one code per element on a square-law grid: m = s q|q| / 127^2 (q in
// [-127, 127]), and sqrt(v) = s q^2 / 255^2 (q in [0, 255]: v is stored as its square root,
// whose range is half v's in octaves, and the update uses the root anyway). The grid is finer
// near zero than a linear one (the smallest step is s / 127^2 rather than s / 127), where most
// moments are. A code is rounded stochastically between the two grid points around the value,
// with probabilities that make the decoded value unbiased (u = 0.5: to the nearer one).
constexpr int kStateBlock = 256;
constexpr float kQm = 127.0f, kQv = 255.0f;
FY_HD float code_decode(int32_t q_abs_sq, float scale, float inv_q2) {
  return scale * (static_cast<float>(q_abs_sq) * inv_q2);
}
// The largest integer k >= 0 with k^2 <= y (y >= 0, at most Q^2): the grid point at or below
// y. Any estimate within one of it gives it after the two corrections (the SIMD paths start
// from a reciprocal square root); this one from the correctly rounded square root.
FY_HD float grid_floor(float y) {
  float q0 = floorf(sqrtf(y));
  if (q0 * q0 > y) q0 = q0 - 1.0f;
  if ((q0 + 1.0f) * (q0 + 1.0f) <= y) q0 = q0 + 1.0f;
  return q0;
}
// y = a's place on the grid of Q in a block of scale s (finite, > 0, a <= s): a (Q^2 / s), with
// inv = Q^2 / s computed once per block; where that overflows (s below about 1e-34), (a / s) Q^2.
// Clamped to Q^2 (the block's largest value may land a rounding above it).
FY_HD float grid_position(float a, float s, float inv, float Q) {
  const float y = inv <= 3.4028234663852886e38f ? a * inv : (a / s) * (Q * Q);
  return y > Q * Q ? Q * Q : y;
}
// The code magnitude for grid position y with variate u (math::round_uniform).
FY_HD int32_t code_encode(float y, float Q, float u) {
  const float q0 = grid_floor(y);
  const float frac = y - q0 * q0, width = 2.0f * q0 + 1.0f;
  float q = u * width < frac ? q0 + 1.0f : q0;
  q = q > Q ? Q : q;
  return static_cast<int32_t>(q);
}

}  // namespace fuyou::math
