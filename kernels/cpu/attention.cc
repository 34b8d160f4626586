// Causal self-attention on the CPU: per (batch, head), two GEMMs around a row softmax.
// Threads take whole (batch, head) pairs; the GEMMs inside run single-threaded (oneDNN
// does so inside an OpenMP parallel region), which beats splitting small T x T GEMMs.
// The scores are computed for the full T x T square and the upper triangle is masked;
// the probabilities att(B,H,T,T) are kept for the backward.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

#define FY_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// Row t of causal softmax: entries 0..t normalised, t+1..T-1 zeroed.
FY_CLONES void softmax_causal_row(float* row, int t, int T) {
  float mx = row[0];
  for (int j = 1; j <= t; ++j) mx = std::max(mx, row[j]);
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j <= t; ++j) {
    row[j] = math::exp_fast(row[j] - mx);
    s += row[j];
  }
  float inv = 1.0f / s;
#pragma omp simd
  for (int j = 0; j <= t; ++j) row[j] *= inv;
  for (int j = t + 1; j < T; ++j) row[j] = 0.0f;
}

// Row t of the softmax backward with the score scale folded in:
// dS = scale * P * (dP - sum_j P_j dP_j), zero past t.
FY_CLONES void softmax_causal_row_backward(const float* prow, float* drow, int t, int T,
                                           float scale) {
  float dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int j = 0; j <= t; ++j) dot += prow[j] * drow[j];
#pragma omp simd
  for (int j = 0; j <= t; ++j) drow[j] = scale * prow[j] * (drow[j] - dot);
  for (int j = t + 1; j < T; ++j) drow[j] = 0.0f;
}

}  // namespace

void CpuBackend::attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                   int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for schedule(dynamic, 1)
  for (int bh = 0; bh < B * H; ++bh) {
    const int b = bh / H, h = bh % H;
    const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* p = att + static_cast<size_t>(bh) * T * T;
    gemm_f32(false, true, T, T, hd, scale, q, ld, k, ld, 0.0f, p, T);
    for (int t = 0; t < T; ++t) softmax_causal_row(p + static_cast<size_t>(t) * T, t, T);
    float* o = out + static_cast<size_t>(b) * T * C + h * hd;
    gemm_f32(false, false, T, hd, T, 1.0f, p, T, v, ld, 0.0f, o, C);
  }
}

void CpuBackend::attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                                    const float* att, int B, int T, int C, int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for schedule(dynamic, 1)
  for (int bh = 0; bh < B * H; ++bh) {
    const int b = bh / H, h = bh % H;
    size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
    const float* q = qkv + row0;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* dq = dqkv + row0;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* p = att + static_cast<size_t>(bh) * T * T;
    float* dp = datt + static_cast<size_t>(bh) * T * T;
    const float* dO = dout + static_cast<size_t>(b) * T * C + h * hd;
    // dP = dO V^T ; dV = P^T dO
    gemm_f32(false, true, T, T, hd, 1.0f, dO, C, v, ld, 0.0f, dp, T);
    gemm_f32(true, false, T, hd, T, 1.0f, p, T, dO, C, 0.0f, dv, ld);
    for (int t = 0; t < T; ++t)
      softmax_causal_row_backward(p + static_cast<size_t>(t) * T, dp + static_cast<size_t>(t) * T,
                                  t, T, scale);
    // dQ = dS K ; dK = dS^T Q
    gemm_f32(false, false, T, hd, T, 1.0f, dp, T, k, ld, 0.0f, dq, ld);
    gemm_f32(true, false, T, hd, T, 1.0f, dp, T, q, ld, 0.0f, dk, ld);
  }
}

}  // namespace fuyou::cpu
