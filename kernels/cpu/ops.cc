// Element-wise and row-wise kernels of the CPU backend. Each loops over the shared element
// math (kernels/common/element_math.h) with OpenMP threads; GEMMs go to gemm.h.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/common/element_math.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {
namespace {

// Per-thread partial sums for reductions over rows (parameter gradients of LayerNorm and
// biases). Grows once to the largest size seen, then is reused: no allocation per call
// once warm.
float* thread_partials(size_t n) {
  static thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  std::fill(buf.begin(), buf.begin() + n, 0.0f);
  return buf.data();
}

// Adds per-thread partial vectors into dst. `partials[t]` has length n.
void reduce_partials(float* dst, const std::vector<float*>& partials, int n) {
#pragma omp parallel for schedule(static)
  for (int i = 0; i < n; ++i) {
    float s = 0;
    for (float* p : partials) s += p[i];
    dst[i] += s;
  }
}

// The row loops of LayerNorm and of the bias gradient, compiled per instruction set
// (FY_CLONES), with LayerNorm's double statistics as vector reductions. The plain loops ran scalar
// (the library is built for baseline x86-64); measured at the default shape on one thread,
// LayerNorm forward 1.49 -> 0.31 ms and backward 1.98 -> 0.44 ms per call.

FY_CLONES void layernorm_row(float* o, float* mean, float* rstd, const float* x, const float* w,
                             const float* b, int C) {
  math::StatAcc s = 0;
#pragma omp simd reduction(+ : s)
  for (int c = 0; c < C; ++c) s += x[c];
  float m = static_cast<float>(s / C);
  math::StatAcc v = 0;
#pragma omp simd reduction(+ : v)
  for (int c = 0; c < C; ++c) {
    math::StatAcc d = x[c] - m;
    v += d * d;
  }
  float r = static_cast<float>(1.0 / std::sqrt(v / C + 1e-5));
#pragma omp simd
  for (int c = 0; c < C; ++c) o[c] = math::layernorm_apply(x[c], m, r, w[c], b[c]);
  *mean = m;
  *rstd = r;
}

}  // namespace

// res = a + b as the storage type holds it: the value a kernel that stores the sum and reads
// it back sees (the fused residual + norm kernels normalise that value, as the two kernels
// one after the other do). res may alias a or b.
FY_CLONES void residual_row(float* res, const float* a, const float* b, int C, ElemType stored) {
  switch (stored) {
    case ElemType::kF32:
#pragma omp simd
      for (int c = 0; c < C; ++c) res[c] = a[c] + b[c];
      return;
    case ElemType::kBF16:
      for (int c = 0; c < C; ++c) res[c] = math::bf16_to_float(math::float_to_bf16(a[c] + b[c]));
      return;
    case ElemType::kF16:
      for (int c = 0; c < C; ++c) res[c] = math::fp16_to_float(math::float_to_fp16(a[c] + b[c]));
      return;
  }
}

namespace {

// dL/dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w, added to dx; the
// row's dw and db terms are added to the thread's partial sums.
FY_CLONES void layernorm_row_backward(float* dx, float* dw_acc, float* db_acc, const float* dy,
                                      const float* x, const float* w, float m, float r, int C) {
  math::StatAcc g_mean = 0, gx_mean = 0;
#pragma omp simd reduction(+ : g_mean, gx_mean)
  for (int c = 0; c < C; ++c) {
    float xhat = (x[c] - m) * r;
    float g = dy[c] * w[c];
    g_mean += g;
    gx_mean += g * xhat;
  }
  float gm = static_cast<float>(g_mean / C), gxm = static_cast<float>(gx_mean / C);
#pragma omp simd
  for (int c = 0; c < C; ++c) {
    float xhat = (x[c] - m) * r;
    float g = dy[c] * w[c];
    dx[c] += (g - gm - xhat * gxm) * r;
    dw_acc[c] += dy[c] * xhat;
    db_acc[c] += dy[c];
  }
}

// dbias[o] += sum over the N rows of d[n][o] for o in [o0, o1), o1 - o0 <= 256, rows in order.
FY_CLONES void column_sums(float* dbias, const float* d, int o0, int o1, int N, int OC) {
  float acc[256] = {};
  for (int n = 0; n < N; ++n) {
    const float* dn = d + static_cast<size_t>(n) * OC;
#pragma omp simd
    for (int o = o0; o < o1; ++o) acc[o - o0] += dn[o];
  }
  for (int o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
}

}  // namespace

void CpuKernels::embedding_forward(float* out, const int32_t* tokens, const float* wte,
                                   const float* wpe, int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < B * T; ++n) {
    const float* te = wte + static_cast<size_t>(tokens[n]) * C;
    float* o = out + static_cast<size_t>(n) * C;
    if (!wpe) {  // no position table (llama): positions enter through RoPE instead
      for (int c = 0; c < C; ++c) o[c] = te[c];
      continue;
    }
    const float* pe = wpe + static_cast<size_t>(n % T) * C;
    for (int c = 0; c < C; ++c) o[c] = te[c] + pe[c];
  }
}

void CpuKernels::embedding_backward(float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int B, int T, int C) {
  // Several rows may share a token, so rows are split by column ranges across threads
  // rather than by row: every thread owns a slice of every embedding row.
#pragma omp parallel
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int c0 = static_cast<int>(static_cast<int64_t>(C) * id / nt);
    int c1 = static_cast<int>(static_cast<int64_t>(C) * (id + 1) / nt);
    for (int n = 0; n < B * T; ++n) {
      const float* d = dout + static_cast<size_t>(n) * C;
      float* te = dwte + static_cast<size_t>(tokens[n]) * C;
      for (int c = c0; c < c1; ++c) te[c] += d[c];
      if (!dwpe) continue;  // no position table (llama)
      float* pe = dwpe + static_cast<size_t>(n % T) * C;
      for (int c = c0; c < c1; ++c) pe[c] += d[c];
    }
  }
}

void CpuKernels::layernorm_forward(float* out, float* mean, float* rstd, const float* in,
                                   const float* w, const float* b, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n)
    layernorm_row(out + static_cast<size_t>(n) * C, mean + n, rstd + n,
                  in + static_cast<size_t>(n) * C, w, b, C);
}

void CpuKernels::residual_layernorm_forward(float* res, float* out, float* mean, float* rstd,
                                            const float* a, const float* b, const float* w,
                                            const float* bias, int N, int C, ElemType stored) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const size_t row = static_cast<size_t>(n) * C;
    residual_row(res + row, a + row, b + row, C, stored);
    layernorm_row(out + row, mean + n, rstd + n, res + row, w, bias, C);
  }
}

void CpuKernels::layernorm_backward(float* din, float* dw, float* db, const float* dout,
                                    const float* in, const float* w, const float* mean,
                                    const float* rstd, int N, int C) {
  std::vector<float*> partials(threads_, nullptr);
#pragma omp parallel num_threads(threads_)
  {
    float* acc = thread_partials(2 * static_cast<size_t>(C));
    partials[omp_get_thread_num()] = acc;
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n)
      layernorm_row_backward(din + static_cast<size_t>(n) * C, acc, acc + C,
                             dout + static_cast<size_t>(n) * C, in + static_cast<size_t>(n) * C, w,
                             mean[n], rstd[n], C);
  }
  partials.erase(std::remove(partials.begin(), partials.end(), nullptr), partials.end());
  std::vector<float*> dws, dbs;
  for (float* p : partials) {
    dws.push_back(p);
    dbs.push_back(p + C);
  }
  reduce_partials(dw, dws, C);
  reduce_partials(db, dbs, C);
}

void CpuKernels::matmul_forward(float* out, const float* in, const float* w, const float* bias,
                                int N, int IC, int OC) {
  const bool bf16 = precision_ == MatmulPrecision::kBf16;
  if (bf16 && bf16_gemm_native()) return matmul_forward_bf16(out, in, w, bias, N, IC, OC);
  // fp32 stays on dnnl_sgemm: oneDNN's fp32 matmul primitive measured 2-15% slower on every
  // projection of the default shape.
  float beta = 0.0f;
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n)
      std::memcpy(out + static_cast<size_t>(n) * OC, bias, sizeof(float) * OC);
    beta = 1.0f;
  }
  auto gemm = precision_ == MatmulPrecision::kFp16 ? gemm_fp16 : bf16 ? gemm_bf16 : gemm_f32;
  gemm(false, true, N, OC, IC, 1.0f, in, IC, w, IC, beta, out, OC);
}

void CpuKernels::matmul_backward(float* din, float* dw, float* dbias, const float* dout,
                                 const float* in, const float* w, int N, int IC, int OC) {
  const bool bf16 = precision_ == MatmulPrecision::kBf16;
  if (bf16 && bf16_gemm_native())
    return matmul_backward_bf16(din, dw, dbias, dout, in, w, N, IC, OC);
  // Without oneDNN's bf16 matmul (no AVX-512), gemm_bf16 multiplies rounded operands in fp32.
  auto gemm = precision_ == MatmulPrecision::kFp16 ? gemm_fp16 : bf16 ? gemm_bf16 : gemm_f32;
  // dw first: din may alias in (backend.h).
  if (dw) gemm(true, false, OC, IC, N, 1.0f, dout, OC, in, IC, 1.0f, dw, IC);
  if (din) gemm(false, false, N, IC, OC, 1.0f, dout, OC, w, IC, 0.0f, din, IC);
  if (dbias) {
    // Column sums: threads own column blocks, rows stream through in order.
    constexpr int kBlock = 256;
#pragma omp parallel for schedule(static)
    for (int o0 = 0; o0 < OC; o0 += kBlock)
      column_sums(dbias, dout, o0, std::min(OC, o0 + kBlock), N, OC);
  }
}

// The exp/tanh-heavy loops, compiled per instruction set (FY_CLONES).
namespace {

FY_CLONES void gelu_forward_impl(float* out, const float* in, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = math::gelu(in[i]);
}

FY_CLONES void gelu_backward_impl(float* din, const float* in, const float* dout, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; ++i) din[i] = dout[i] * math::gelu_grad(in[i]);
}

// One row of crossentropy_forward: its logsumexp z and loss; 0 and 0 for an ignored target.
inline void crossentropy_row_forward(float* loss, float* lse, const float* l, int32_t target,
                                     int V) {
  if (target == kIgnoreTarget) {  // does not count: no loss (backend.h)
    *loss = 0.0f;
    *lse = 0.0f;
    return;
  }
  float mx = l[0];
  for (int v = 1; v < V; ++v) mx = std::max(mx, l[v]);
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int v = 0; v < V; ++v) s += math::exp_fast(l[v] - mx);
  const float z = mx + static_cast<float>(std::log(s));
  *lse = z;
  *loss = z - l[target];
}

// One row of crossentropy_backward from the row's logsumexp z.
inline void crossentropy_row_backward(float* l, float z, int32_t target, float scale, int V,
                                      int ld) {
  std::fill(l + V, l + ld, 0.0f);  // the padded vocabulary's columns: no gradient
  if (target == kIgnoreTarget) {   // does not count: no gradient (backend.h)
    std::fill(l, l + V, 0.0f);
    return;
  }
#pragma omp simd
  for (int v = 0; v < V; ++v) l[v] = math::exp_fast(l[v] - z) * scale;
  l[target] -= scale;
}

FY_CLONES void crossentropy_forward_impl(float* losses, float* lse, const float* logits,
                                         const int32_t* targets, int N, int V, int ld) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n)
    crossentropy_row_forward(losses + n, lse + n, logits + static_cast<size_t>(n) * ld, targets[n],
                             V);
}

FY_CLONES void crossentropy_backward_impl(float* logits, const float* lse, const int32_t* targets,
                                          float scale, int N, int V, int ld) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n)
    crossentropy_row_backward(logits + static_cast<size_t>(n) * ld, lse[n], targets[n], scale, V,
                              ld);
}

// Both per row while the row is in cache.
FY_CLONES void crossentropy_forward_backward_impl(float* losses, float* lse, float* logits,
                                                  const int32_t* targets, float scale, int N, int V,
                                                  int ld) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* l = logits + static_cast<size_t>(n) * ld;
    crossentropy_row_forward(losses + n, lse + n, l, targets[n], V);
    crossentropy_row_backward(l, lse[n], targets[n], scale, V, ld);
  }
}

}  // namespace

void CpuKernels::gelu_forward(float* out, const float* in, size_t n) {
  gelu_forward_impl(out, in, n);
}

void CpuKernels::gelu_backward(float* din, const float* in, const float* dout, size_t n) {
  gelu_backward_impl(din, in, dout, n);
}

void CpuKernels::add(float* out, const float* a, const float* b, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void CpuKernels::crossentropy_forward(float* losses, float* lse, const float* logits,
                                      const int32_t* targets, int N, int V, int ld) {
  crossentropy_forward_impl(losses, lse, logits, targets, N, V, ld);
}

void CpuKernels::crossentropy_backward(float* logits, const float* lse, const int32_t* targets,
                                       float scale, int N, int V, int ld) {
  crossentropy_backward_impl(logits, lse, targets, scale, N, V, ld);
}

void CpuKernels::crossentropy_forward_backward(float* losses, float* lse, float* logits,
                                               const int32_t* targets, float scale, int N, int V,
                                               int ld) {
  crossentropy_forward_backward_impl(losses, lse, logits, targets, scale, N, V, ld);
}

}  // namespace fuyou::cpu
