// Causal self-attention on the CPU: per (batch, head), two GEMMs around a row softmax.
// The scores are computed for the full T x T square and the upper triangle is masked;
// the probabilities att(B,H,T,T) are kept for the backward.
#include <cmath>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {

void CpuBackend::attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                   int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = att + (static_cast<size_t>(b) * H + h) * T * T;
      gemm_f32(false, true, T, T, hd, scale, q, ld, k, ld, 0.0f, p, T);
#pragma omp parallel for schedule(static)
      for (int t = 0; t < T; ++t) {
        float* row = p + static_cast<size_t>(t) * T;
        float mx = row[0];
        for (int j = 1; j <= t; ++j) mx = std::max(mx, row[j]);
        float s = 0;
        for (int j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - mx);
          s += row[j];
        }
        float inv = 1.0f / s;
        for (int j = 0; j <= t; ++j) row[j] *= inv;
        for (int j = t + 1; j < T; ++j) row[j] = 0.0f;
      }
      float* o = out + static_cast<size_t>(b) * T * C + h * hd;
      gemm_f32(false, false, T, hd, T, 1.0f, p, T, v, ld, 0.0f, o, C);
    }
  }
}

void CpuBackend::attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                                    const float* att, int B, int T, int C, int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
      const float* q = qkv + row0;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + row0;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* p = att + (static_cast<size_t>(b) * H + h) * T * T;
      float* dp = datt + (static_cast<size_t>(b) * H + h) * T * T;
      const float* dO = dout + static_cast<size_t>(b) * T * C + h * hd;
      // dP = dO V^T ; dV = P^T dO
      gemm_f32(false, true, T, T, hd, 1.0f, dO, C, v, ld, 0.0f, dp, T);
      gemm_f32(true, false, T, hd, T, 1.0f, p, T, dO, C, 0.0f, dv, ld);
      // Softmax backward, folding in the score scale: dS = scale * P * (dP - sum(P * dP)).
#pragma omp parallel for schedule(static)
      for (int t = 0; t < T; ++t) {
        const float* prow = p + static_cast<size_t>(t) * T;
        float* drow = dp + static_cast<size_t>(t) * T;
        float dot = 0;
        for (int j = 0; j <= t; ++j) dot += prow[j] * drow[j];
        for (int j = 0; j <= t; ++j) drow[j] = scale * prow[j] * (drow[j] - dot);
        for (int j = t + 1; j < T; ++j) drow[j] = 0.0f;
      }
      // dQ = dS K ; dK = dS^T Q
      gemm_f32(false, false, T, hd, T, 1.0f, dp, T, k, ld, 0.0f, dq, ld);
      gemm_f32(true, false, T, hd, T, 1.0f, dp, T, q, ld, 0.0f, dk, ld);
    }
  }
}

}  // namespace fuyou::cpu
