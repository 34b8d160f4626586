// Element-wise and row-wise kernels of the CUDA backend: embedding, LayerNorm, GELU, residual
// add and the fused softmax + cross-entropy. The arithmetic per
// element is kernels/common/element_math.h, the same functions the CPU backend loops over;
// what is CUDA-only is indexing and the reductions, each commented with its invariant.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// The same epsilon as the CPU backend's layernorm_forward (kernels/cpu/ops.cc), added to the
// variance in double.
constexpr double kLayerNormEps = 1e-5;

__global__ void embedding_forward_k(float* out, const int32_t* tokens, const float* wte,
                                    const float* wpe, int T, int C, size_t total) {
  FY_GRID_LOOP(i, total) {
    size_t n = i / C;
    int c = static_cast<int>(i % C);
    float v = wte[size_t(tokens[n]) * C + c];
    out[i] = wpe ? v + wpe[size_t(n % T) * C + c] : v;
  }
}

// dwte(v, c) += dout(n, c) for every position n holding token v, in increasing n: the CPU
// backend's order, so both round alike. Thread (c, r) owns column c of the rows v with
// v % gridDim.y == r: every element has one writer, no atomics, the same bits every run.
// Each thread reads every token (a broadcast load within the warp) and adds only its own.
__global__ void embedding_backward_wte_k(float* dwte, const float* dout, const int32_t* tokens,
                                         size_t N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const unsigned r = blockIdx.y, slices = gridDim.y;
  for (size_t n = 0; n < N; ++n) {
    const unsigned v = static_cast<unsigned>(tokens[n]);
    if (v % slices == r) dwte[size_t(v) * C + c] += dout[n * C + c];
  }
}

// dwpe(t, c) += dout(b, t, c) for b = 0, 1, ..., in that order, as on the CPU.
__global__ void embedding_backward_wpe_k(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t total = size_t(T) * C;
  FY_GRID_LOOP(i, total) {
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc += dout[size_t(b) * total + i];
    dwpe[i] = acc;
  }
}

// Embedding rows per column thread group of embedding_backward_wte_k: enough blocks to keep
// the GPU busy at small d_model; each thread scans all B*T tokens.
constexpr unsigned kEmbedSlices = 32;

// One block per row n. Statistics in math::StatAcc (double) as on the CPU, two passes over
// the row (mean, then squared deviations) so the result matches the CPU's formula.
__global__ void layernorm_forward_k(float* out, float* mean, float* rstd, const float* in,
                                    const float* w, const float* b, int C) {
  const size_t n = blockIdx.x;
  const float* x = in + n * C;
  math::StatAcc s = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
  s = block_reduce(s, SumOp{}, math::StatAcc(0));
  const float m = static_cast<float>(s / C);
  math::StatAcc v = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    math::StatAcc d = x[c] - m;
    v += d * d;
  }
  v = block_reduce(v, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(v / C + kLayerNormEps));
  float* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = math::layernorm_apply(x[c], m, r, w[c], b[c]);
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// One block per row: din += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
// The weight and bias gradients are column sums, done by layernorm_dweights_k.
__global__ void layernorm_backward_dx_k(float* din, const float* dout, const float* in,
                                        const float* w, const float* mean, const float* rstd,
                                        int C) {
  const size_t n = blockIdx.x;
  const float* x = in + n * C;
  const float* dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  math::StatAcc g_sum = 0, gx_sum = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = (x[c] - m) * r;
    float g = dy[c] * w[c];
    g_sum += g;
    gx_sum += g * xhat;
  }
  g_sum = block_reduce(g_sum, SumOp{}, math::StatAcc(0));
  gx_sum = block_reduce(gx_sum, SumOp{}, math::StatAcc(0));
  const float gm = static_cast<float>(g_sum / C), gxm = static_cast<float>(gx_sum / C);
  float* dx = din + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = (x[c] - m) * r;
    float g = dy[c] * w[c];
    dx[c] += (g - gm - xhat * gxm) * r;
  }
}

// Slice by of dw(c) = sum_n dy(n,c) xhat(n,c) and db(c) = sum_n dy(n,c) over the rows
// n = by, by + gridDim.y, ...; column_slices_add adds the slices in order (no atomics).
__global__ void layernorm_dweights_k(float* part_w, float* part_b, const float* dout,
                                     const float* in, const float* mean, const float* rstd, int N,
                                     int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    size_t i = size_t(n) * C + c;
    sw += dout[i] * ((in[i] - mean[n]) * rstd[n]);
    sb += dout[i];
  }
  part_w[size_t(blockIdx.y) * C + c] = sw;
  part_b[size_t(blockIdx.y) * C + c] = sb;
}

__global__ void gelu_forward_k(float* out, const float* in, size_t n) {
  FY_GRID_LOOP(i, n) out[i] = math::gelu(in[i]);
}

__global__ void gelu_backward_k(float* din, const float* in, const float* dout, size_t n) {
  FY_GRID_LOOP(i, n) din[i] = dout[i] * math::gelu_grad(in[i]);
}

__global__ void add_k(float* out, const float* a, const float* b, size_t n) {
  FY_GRID_LOOP(i, n) out[i] = a[i] + b[i];
}

// One block per row: the row maximum, then sum exp(l - max) in double as on the CPU.
__global__ void crossentropy_forward_k(float* losses, float* lse, const float* logits,
                                       const int32_t* targets, int V) {
  const size_t n = blockIdx.x;
  // An ignored target (kIgnoreTarget, a masked-out position) has loss 0 and lse 0
  // (backend.h). The whole block reads the same target, so it returns together, before any
  // block_reduce barrier.
  if (targets[n] == kIgnoreTarget) {
    if (threadIdx.x == 0) losses[n] = lse[n] = 0.0f;
    return;
  }
  const float* l = logits + n * V;
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, l[v]);
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  double s = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += math::exp_fast(l[v] - mx);
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) {
    float z = mx + static_cast<float>(log(s));
    lse[n] = z;
    losses[n] = z - l[targets[n]];
  }
}

// Element-wise over (N, V): softmax from the saved logsumexp, times scale, minus scale at
// the target; 0 on a row whose target is kIgnoreTarget. Each element is written by one
// thread in the CPU's order of operations.
__global__ void crossentropy_backward_k(float* logits, const float* lse, const int32_t* targets,
                                        float scale, int V, size_t total) {
  FY_GRID_LOOP(i, total) {
    size_t n = i / V;
    int v = static_cast<int>(i % V);
    if (targets[n] == kIgnoreTarget) {
      logits[i] = 0.0f;
      continue;
    }
    float g = math::exp_fast(logits[i] - lse[n]) * scale;
    if (v == targets[n]) g -= scale;
    logits[i] = g;
  }
}

}  // namespace

void CudaBackend::embedding_forward(void* out_v, const int32_t* tokens, const void* wte_v,
                                    const void* wpe_v, int B, int T, int C) {
  float* out = static_cast<float*>(out_v);
  const float* wte = static_cast<const float*>(wte_v);
  const float* wpe = static_cast<const float*>(wpe_v);
  size_t total = size_t(B) * T * C;
  if (!total) return;
  FY_LAUNCH(embedding_forward_k, elt_blocks(total), kEltThreads, out, tokens, wte, wpe, T, C,
            total);
}

void CudaBackend::embedding_backward(void* dwte_v, void* dwpe_v, const void* dout_v,
                                     const int32_t* tokens, int B, int T, int C) {
  float* dwte = static_cast<float*>(dwte_v);
  float* dwpe = static_cast<float*>(dwpe_v);
  const float* dout = static_cast<const float*>(dout_v);
  const size_t N = size_t(B) * T;
  if (!N || !C) return;
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  FY_LAUNCH(embedding_backward_wte_k, dim3(cols, kEmbedSlices), kEltThreads, dwte, dout, tokens, N,
            C);
  if (dwpe)
    FY_LAUNCH(embedding_backward_wpe_k, elt_blocks(size_t(T) * C), kEltThreads, dwpe, dout, B, T,
              C);
}

void CudaBackend::layernorm_forward(void* out_v, float* mean, float* rstd, const void* in_v,
                                    const void* w_v, const void* b_v, int N, int C) {
  float* out = static_cast<float*>(out_v);
  const float* in = static_cast<const float*>(in_v);
  const float* w = static_cast<const float*>(w_v);
  const float* b = static_cast<const float*>(b_v);
  if (!N) return;
  FY_LAUNCH(layernorm_forward_k, N, kRowThreads, out, mean, rstd, in, w, b, C);
}

void CudaBackend::layernorm_backward(void* din_v, void* dw_v, void* db_v, const void* dout_v,
                                     const void* in_v, const void* w_v, const float* mean,
                                     const float* rstd, int N, int C) {
  float* din = static_cast<float*>(din_v);
  float* dw = static_cast<float*>(dw_v);
  float* db = static_cast<float*>(db_v);
  const float* dout = static_cast<const float*>(dout_v);
  const float* in = static_cast<const float*>(in_v);
  const float* w = static_cast<const float*>(w_v);
  if (!N) return;
  FY_LAUNCH(layernorm_backward_dx_k, N, kRowThreads, din, dout, in, w, mean, rstd, C);
  const int slices = reduce_slices(N);
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part_w = static_cast<float*>(scratch(2 * sizeof(float) * slices * size_t(C)));
  float* part_b = part_w + size_t(slices) * C;
  FY_LAUNCH(layernorm_dweights_k, dim3(cols, slices), kEltThreads, part_w, part_b, dout, in, mean,
            rstd, N, C);
  FY_LAUNCH(column_slices_add, cols, kEltThreads, dw, part_w, slices, C);
  FY_LAUNCH(column_slices_add, cols, kEltThreads, db, part_b, slices, C);
}

void CudaBackend::gelu_forward(void* out_v, const void* in_v, size_t n) {
  float* out = static_cast<float*>(out_v);
  const float* in = static_cast<const float*>(in_v);
  if (!n) return;
  FY_LAUNCH(gelu_forward_k, elt_blocks(n), kEltThreads, out, in, n);
}

void CudaBackend::gelu_backward(void* din_v, const void* in_v, const void* dout_v, size_t n) {
  float* din = static_cast<float*>(din_v);
  const float* in = static_cast<const float*>(in_v);
  const float* dout = static_cast<const float*>(dout_v);
  if (!n) return;
  FY_LAUNCH(gelu_backward_k, elt_blocks(n), kEltThreads, din, in, dout, n);
}

void CudaBackend::add(void* out_v, const void* a_v, const void* b_v, size_t n) {
  float* out = static_cast<float*>(out_v);
  const float* a = static_cast<const float*>(a_v);
  const float* b = static_cast<const float*>(b_v);
  if (!n) return;
  FY_LAUNCH(add_k, elt_blocks(n), kEltThreads, out, a, b, n);
}

void CudaBackend::crossentropy_forward(float* losses, float* lse, const void* logits_v,
                                       const int32_t* targets, int N, int V) {
  const float* logits = static_cast<const float*>(logits_v);
  if (!N) return;
  FY_LAUNCH(crossentropy_forward_k, N, kRowThreads, losses, lse, logits, targets, V);
}

void CudaBackend::crossentropy_backward(void* logits_v, const float* lse, const int32_t* targets,
                                        float scale, int N, int V) {
  float* logits = static_cast<float*>(logits_v);
  size_t total = size_t(N) * V;
  if (!total) return;
  FY_LAUNCH(crossentropy_backward_k, elt_blocks(total), kEltThreads, logits, lse, targets, scale, V,
            total);
}

}  // namespace fuyou::cuda
