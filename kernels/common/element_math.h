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
// error about 2 ulp over the clamped range [-87.3, 88.7]; below that it returns ~1e-38
// rather than 0, above it ~3e38 rather than inf.
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

}  // namespace fuyou::math
