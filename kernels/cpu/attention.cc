// Causal self-attention on the CPU: per (batch, head), two GEMMs around a row softmax.
// Threads take whole (batch, head) pairs; the GEMMs inside run single-threaded (oneDNN
// does so inside an OpenMP parallel region), which beats splitting small T x T GEMMs.
// The scores are computed block by block up to the diagonal (the masked upper triangle is
// skipped, see row_block); the probabilities att(B,H,T,T) are kept for the backward with
// zeros above the diagonal.
#include <algorithm>
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

// Row t of causal softmax: entries 0..t normalised, t+1..T-1 zeroed.
FY_CLONES void softmax_causal_row(float* row, int t, int T) {
  // The maximum through 16 independent lanes: a plain running max is one serial chain of
  // scalar max instructions (GCC 12 vectorises neither it nor an omp simd max reduction),
  // which measured about a third of the softmax's time.
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = row[0];
  int j = 0;
  for (; j + 16 <= t + 1; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] = row[j + l] > lane[l] ? row[j + l] : lane[l];
  for (; j <= t; ++j) lane[0] = row[j] > lane[0] ? row[j] : lane[0];
  float mx = lane[0];
  for (int l = 1; l < 16; ++l) mx = lane[l] > mx ? lane[l] : mx;
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

// Rows are taken in blocks of `bs`: block [i0, i0 + r) only attends to keys [0, i0 + r), so
// the GEMMs skip the masked upper triangle except inside the diagonal block. With n blocks
// they do (n + 1) / 2n of the square's work; blocks shrink with T only down to 64 rows,
// below which oneDNN's small-GEMM efficiency costs more than the skipped work saves.
static int row_block(int T) { return std::max(64, T / 8); }

void CpuKernels::attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                                   int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const int bs = row_block(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for schedule(dynamic, 1)
  for (int bh = 0; bh < B * H; ++bh) {
    const int b = bh / H, h = bh % H;
    const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* p = att + static_cast<size_t>(bh) * T * T;
    float* o = out + static_cast<size_t>(b) * T * C + h * hd;
    for (int i0 = 0; i0 < T; i0 += bs) {
      const int r = std::min(bs, T - i0), cols = i0 + r;
      float* pi = p + static_cast<size_t>(i0) * T;
      gemm_f32(false, true, r, cols, hd, scale, q + static_cast<size_t>(i0) * ld, ld, k, ld, 0.0f, pi, T);
      for (int t = i0; t < i0 + r; ++t) softmax_causal_row(p + static_cast<size_t>(t) * T, t, T);
      gemm_f32(false, false, r, hd, cols, 1.0f, pi, T, v, ld, 0.0f, o + static_cast<size_t>(i0) * C, C);
    }
  }
}

void CpuKernels::attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                                    const float* att, int B, int T, int C, int H) {
  const int hd = C / H;
  const int ld = 3 * C;
  const int bs = row_block(T);
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
    // Row blocks: dP = dO V^T, then dS = softmax backward (zero past the diagonal), dQ = dS K.
    for (int i0 = 0; i0 < T; i0 += bs) {
      const int r = std::min(bs, T - i0), cols = i0 + r;
      float* dpi = dp + static_cast<size_t>(i0) * T;
      gemm_f32(false, true, r, cols, hd, 1.0f, dO + static_cast<size_t>(i0) * C, C, v, ld, 0.0f, dpi, T);
      for (int t = i0; t < i0 + r; ++t)
        softmax_causal_row_backward(p + static_cast<size_t>(t) * T, dp + static_cast<size_t>(t) * T,
                                    t, T, scale);
      gemm_f32(false, false, r, hd, cols, 1.0f, dpi, T, k, ld, 0.0f, dq + static_cast<size_t>(i0) * ld, ld);
    }
    // Column blocks: keys j0.. are attended only by queries j0..T-1, whose rows of P and dS
    // are all computed above (zero above the diagonal). dV = P^T dO, dK = dS^T Q.
    for (int j0 = 0; j0 < T; j0 += bs) {
      const int c = std::min(bs, T - j0), rows = T - j0;
      const size_t at = static_cast<size_t>(j0) * T + j0;
      gemm_f32(true, false, c, hd, rows, 1.0f, p + at, T, dO + static_cast<size_t>(j0) * C, C, 0.0f,
               dv + static_cast<size_t>(j0) * ld, ld);
      gemm_f32(true, false, c, hd, rows, 1.0f, dp + at, T, q + static_cast<size_t>(j0) * ld, ld, 0.0f,
               dk + static_cast<size_t>(j0) * ld, ld);
    }
  }
}

}  // namespace fuyou::cpu
