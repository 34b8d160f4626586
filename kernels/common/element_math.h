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

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
FY_HD float gelu(float x) {
  float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

// d gelu(x) / dx for the same approximation.
FY_HD float gelu_grad(float x) {
  float x2 = x * x;
  float u = kGeluScale * (x + kGeluCubic * x2 * x);
  float t = tanhf(u);
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
