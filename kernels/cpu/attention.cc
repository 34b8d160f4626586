// Causal self-attention on the CPU: per (batch, head), two GEMMs around a row softmax. With
// packed records (Backend::attention_forward's pos) each query attends its own record only,
// and a block's GEMMs start at the first key its rows can see.
// Threads take whole (batch, head) pairs; the GEMMs inside run single-threaded (oneDNN
// does so inside an OpenMP parallel region), which beats splitting small T x T GEMMs.
// Queries are taken in row blocks: a block's scores are computed up to the diagonal (the
// masked upper triangle is skipped, see row_block) into the thread's scratch, so memory is
// O(block x T) per thread and nothing of size T x T outlives a block. The forward keeps each
// row's log-sum-exp; the backward recomputes the block's probabilities from it.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/common/element_math.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

// One query row of the scores, covering columns [0, width): entries lo..hi (the keys of the
// query's record up to itself) normalised, the rest zeroed; returns the row's log-sum-exp.
FY_CLONES float softmax_causal_row(float* row, int lo, int hi, int width) {
  // The maximum through 16 independent lanes: a plain running max is one serial chain of
  // scalar max instructions (GCC 12 vectorises neither it nor an omp simd max reduction),
  // which measured about a third of the softmax's time.
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = row[lo];
  int j = lo;
  for (; j + 16 <= hi + 1; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] = row[j + l] > lane[l] ? row[j + l] : lane[l];
  for (; j <= hi; ++j) lane[0] = row[j] > lane[0] ? row[j] : lane[0];
  float mx = lane[0];
  for (int l = 1; l < 16; ++l) mx = lane[l] > mx ? lane[l] : mx;
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int j = lo; j <= hi; ++j) {
    row[j] = math::exp_fast(row[j] - mx);
    s += row[j];
  }
  float inv = 1.0f / s;
#pragma omp simd
  for (int j = lo; j <= hi; ++j) row[j] *= inv;
  for (int j = 0; j < lo; ++j) row[j] = 0.0f;
  for (int j = hi + 1; j < width; ++j) row[j] = 0.0f;
  return mx + std::log(s);
}

// The row's probabilities again from its scores and log-sum-exp: exp(s - lse) over lo..hi,
// zero elsewhere in [0, width).
FY_CLONES void softmax_causal_row_recompute(float* row, float lse, int lo, int hi, int width) {
#pragma omp simd
  for (int j = lo; j <= hi; ++j) row[j] = math::exp_fast(row[j] - lse);
  for (int j = 0; j < lo; ++j) row[j] = 0.0f;
  for (int j = hi + 1; j < width; ++j) row[j] = 0.0f;
}

// The row's softmax backward with the score scale folded in:
// dS = scale * P * (dP - sum_j P_j dP_j) over lo..hi, zero elsewhere in [0, width).
FY_CLONES void softmax_causal_row_backward(const float* prow, float* drow, int lo, int hi,
                                           int width, float scale) {
  float dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int j = lo; j <= hi; ++j) dot += prow[j] * drow[j];
#pragma omp simd
  for (int j = lo; j <= hi; ++j) drow[j] = scale * prow[j] * (drow[j] - dot);
  for (int j = 0; j < lo; ++j) drow[j] = 0.0f;
  for (int j = hi + 1; j < width; ++j) drow[j] = 0.0f;
}

// The first key query t of a row attends: the start of its record (Backend::attention_forward's
// pos; null: the row is one record). Non-decreasing in t, so a block's first row gives the
// block's first key.
inline int record_start(const int32_t* pos, int t) { return pos ? t - pos[t] : 0; }

}  // namespace

// Rows are taken in blocks of `bs`: block [i0, i0 + r) only attends to keys [0, i0 + r), so
// the GEMMs skip the masked upper triangle except inside the diagonal block. With n blocks
// they do (n + 1) / 2n of the square's work; blocks shrink with T only down to 64 rows,
// below which oneDNN's small-GEMM efficiency costs more than the skipped work saves.
static int row_block(int T) { return std::max(64, T / 8); }

// The calling thread's block scratch: n floats, grown once, then reused.
static float* block_scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

void CpuKernels::attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C,
                                   int H, const int32_t* pos) {
  const int hd = C / H;
  const int ld = 3 * C;
  const int bs = row_block(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel
  {
    static thread_local std::vector<float> pbuf;
    float* pi = block_scratch(pbuf, static_cast<size_t>(bs) * T);
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < B * H; ++bh) {
      const int b = bh / H, h = bh % H;
      const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      const int32_t* p = pos ? pos + static_cast<size_t>(b) * T : nullptr;
      float* o = out + static_cast<size_t>(b) * T * C + h * hd;
      float* l = lse + static_cast<size_t>(bh) * T;
      for (int i0 = 0; i0 < T; i0 += bs) {
        // Keys k0 .. i0 + r - 1: from the first row's record start (0 for one record per row)
        // to the block's diagonal; earlier records' keys are skipped, not only masked.
        const int r = std::min(bs, T - i0), k0 = record_start(p, i0), cols = i0 + r - k0;
        const float* kk = k + static_cast<size_t>(k0) * ld;
        gemm_f32(false, true, r, cols, hd, scale, q + static_cast<size_t>(i0) * ld, ld, kk, ld,
                 0.0f, pi, T);
        for (int t = i0; t < i0 + r; ++t)
          l[t] = softmax_causal_row(pi + static_cast<size_t>(t - i0) * T, record_start(p, t) - k0,
                                    t - k0, cols);
        gemm_f32(false, false, r, hd, cols, 1.0f, pi, T, v + static_cast<size_t>(k0) * ld, ld, 0.0f,
                 o + static_cast<size_t>(i0) * C, C);
      }
    }
  }
}

// Per row block of queries: P from the scores and lse, dP = dO V^T, dS = softmax backward
// (zero past the diagonal), dQ = dS K; the block's share of dV = P^T dO and dK = dS^T Q is
// added to the keys it attends (0 .. the block's end), so dK and dV are sums over blocks.
void CpuKernels::attention_backward(float* dqkv, const float* dout, const float* qkv,
                                    const float* lse, int B, int T, int C, int H,
                                    const int32_t* pos) {
  const int hd = C / H;
  const int ld = 3 * C;
  const int bs = row_block(T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel
  {
    static thread_local std::vector<float> pbuf, dpbuf;
    float* pi = block_scratch(pbuf, static_cast<size_t>(bs) * T);
    float* dpi = block_scratch(dpbuf, static_cast<size_t>(bs) * T);
#pragma omp for schedule(dynamic, 1)
    for (int bh = 0; bh < B * H; ++bh) {
      const int b = bh / H, h = bh % H;
      const size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
      const float* q = qkv + row0;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + row0;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* dO = dout + static_cast<size_t>(b) * T * C + h * hd;
      const float* l = lse + static_cast<size_t>(bh) * T;
      const int32_t* p = pos ? pos + static_cast<size_t>(b) * T : nullptr;
      for (int t = 0; t < T; ++t) {
        std::fill(dk + static_cast<size_t>(t) * ld, dk + static_cast<size_t>(t) * ld + hd, 0.0f);
        std::fill(dv + static_cast<size_t>(t) * ld, dv + static_cast<size_t>(t) * ld + hd, 0.0f);
      }
      for (int i0 = 0; i0 < T; i0 += bs) {
        const int r = std::min(bs, T - i0), k0 = record_start(p, i0), cols = i0 + r - k0;
        const size_t kofs = static_cast<size_t>(k0) * ld;
        const float* qi = q + static_cast<size_t>(i0) * ld;
        const float* dOi = dO + static_cast<size_t>(i0) * C;
        gemm_f32(false, true, r, cols, hd, scale, qi, ld, k + kofs, ld, 0.0f, pi, T);
        for (int t = i0; t < i0 + r; ++t)
          softmax_causal_row_recompute(pi + static_cast<size_t>(t - i0) * T, l[t],
                                       record_start(p, t) - k0, t - k0, cols);
        gemm_f32(true, false, cols, hd, r, 1.0f, pi, T, dOi, C, 1.0f, dv + kofs, ld);
        gemm_f32(false, true, r, cols, hd, 1.0f, dOi, C, v + kofs, ld, 0.0f, dpi, T);
        for (int t = i0; t < i0 + r; ++t)
          softmax_causal_row_backward(pi + static_cast<size_t>(t - i0) * T,
                                      dpi + static_cast<size_t>(t - i0) * T,
                                      record_start(p, t) - k0, t - k0, cols, scale);
        gemm_f32(false, false, r, hd, cols, 1.0f, dpi, T, k + kofs, ld, 0.0f,
                 dq + static_cast<size_t>(i0) * ld, ld);
        gemm_f32(true, false, cols, hd, r, 1.0f, dpi, T, qi, ld, 1.0f, dk + kofs, ld);
      }
    }
  }
}

}  // namespace fuyou::cpu
