// Element-wise and row-wise kernels of the CUDA backend: embedding, LayerNorm, GELU, residual
// add and the fused softmax + cross-entropy, templates on the storage type (cuda_util.cuh:
// loads widen to fp32, stores round once). The arithmetic per element is
// kernels/common/element_math.h, the same functions the CPU backend loops over; what is
// CUDA-only is indexing and the reductions, each commented with its invariant.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// The same epsilon as the CPU backend's layernorm_forward (kernels/cpu/ops.cc), added to the
// variance in double.
constexpr double kLayerNormEps = 1e-5;

template <typename T>
__global__ void embedding_forward_k(T* out, const int32_t* tokens, const T* wte, const T* wpe,
                                    int T_, int C, size_t total) {
  FY_GRID_LOOP(i, total) {
    size_t n = i / C;
    int c = static_cast<int>(i % C);
    float v = ld(wte[size_t(tokens[n]) * C + c]);
    out[i] = st<T>(wpe ? v + ld(wpe[size_t(n % T_) * C + c]) : v);
  }
}

// A gradient row's sum over the positions that add to it, the CPU backend's way: fp32 tables
// add each position's row in turn (acc starts at the stored value); 16-bit tables sum the
// positions in fp32 from zero and add the sum to the stored row with one rounding
// (kernels/cpu/cpu_backend_kernels.cc, embed_rows_backward).
template <typename T>
__device__ __forceinline__ float grad_row_start(T stored) {
  return std::is_same<T, float>::value ? ld(stored) : 0.0f;
}
template <typename T>
__device__ __forceinline__ T grad_row_end(T stored, float acc) {
  return std::is_same<T, float>::value ? st<T>(acc) : st<T>(ld(stored) + acc);
}

// The positions sorted by token, stably: order[rank] = n and sorted[rank] = tokens[n], with
// rank = #(tokens[m] < tokens[n]) + #(m < n with tokens[m] == tokens[n]). One thread per n,
// the tokens read a block's tile at a time from shared memory; O(N^2) compares, which is
// small beside the layer's GEMMs for the N = B T of one micro-batch.
__global__ void token_rank_k(int32_t* order, int32_t* sorted, const int32_t* tokens, int N) {
  __shared__ int32_t tile[kEltThreads];
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int32_t v = n < N ? tokens[n] : 0;
  int rank = 0;
  for (int base = 0; base < N; base += kEltThreads) {
    if (base + int(threadIdx.x) < N) tile[threadIdx.x] = tokens[base + threadIdx.x];
    __syncthreads();
    const int len = min(kEltThreads, N - base);
    for (int j = 0; j < len; ++j) {
      const int32_t u = tile[j];
      rank += u < v || (u == v && base + j < n);
    }
    __syncthreads();
  }
  if (n < N) {
    order[rank] = n;
    sorted[rank] = v;
  }
}

// dwte(v, c) gets the rows of dout at the positions holding token v, in increasing position
// (the CPU's order). Thread (c, i) owns column c of the token starting the sorted run at i:
// every element has one writer, no atomics, the same bits every run.
template <typename T>
__global__ void embedding_backward_wte_k(T* dwte, const T* dout, const int32_t* order,
                                         const int32_t* sorted, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int i = blockIdx.y; i < N; i += gridDim.y) {
    const int32_t v = sorted[i];
    if (i > 0 && sorted[i - 1] == v) continue;  // not the start of v's run
    T* row = dwte + size_t(v) * C + c;
    float acc = grad_row_start(*row);
    for (int j = i; j < N && sorted[j] == v; ++j) acc += ld(dout[size_t(order[j]) * C + c]);
    *row = grad_row_end(*row, acc);
  }
}

// dwpe(t, c) += dout(b, t, c) for b = 0, 1, ..., in that order, as on the CPU.
template <typename T>
__global__ void embedding_backward_wpe_k(T* dwpe, const T* dout, int B, int T_, int C) {
  const size_t total = size_t(T_) * C;
  FY_GRID_LOOP(i, total) {
    float acc = grad_row_start(dwpe[i]);
    for (int b = 0; b < B; ++b) acc += ld(dout[size_t(b) * total + i]);
    dwpe[i] = grad_row_end(dwpe[i], acc);
  }
}

// Sorted runs per column thread group of embedding_backward_wte_k (grid y, strided): enough
// blocks to keep the GPU busy at small d_model.
constexpr unsigned kEmbedSlices = 512;

// One block per row n. Statistics in math::StatAcc (double) as on the CPU, two passes over
// the row (mean, then squared deviations) so the result matches the CPU's formula. Thread i
// reads the columns i, i + blockDim.x, ... in every pass.
template <typename T>
__device__ void layernorm_row(T* out, float* mean, float* rstd, const T* in, const T* w, const T* b,
                              int C) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  math::StatAcc s = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) s += ld(x[c]);
  s = block_reduce(s, SumOp{}, math::StatAcc(0));
  const float m = static_cast<float>(s / C);
  math::StatAcc v = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    math::StatAcc d = ld(x[c]) - m;
    v += d * d;
  }
  v = block_reduce(v, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(v / C + kLayerNormEps));
  T* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = st<T>(math::layernorm_apply(ld(x[c]), m, r, ld(w[c]), ld(b[c])));
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

template <typename T>
__global__ void layernorm_forward_k(T* out, float* mean, float* rstd, const T* in, const T* w,
                                    const T* b, int C) {
  layernorm_row(out, mean, rstd, in, w, b, C);
}

// The residual add, then the row's LayerNorm of the stored sum: thread i stores the columns
// i, i + blockDim.x, ... of res and then reads only those back (layernorm_row's stride), so
// no barrier is needed between the two, and res may alias a or b.
template <typename T>
__global__ void residual_layernorm_forward_k(T* res, T* out, float* mean, float* rstd, const T* a,
                                             const T* b, const T* w, const T* bias, int C) {
  const size_t row = size_t(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    res[row + c] = st<T>(ld(a[row + c]) + ld(b[row + c]));
  layernorm_row(out, mean, rstd, res, w, bias, C);
}

// One block per row: din += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
// The weight and bias gradients are column sums, done by layernorm_dweights_k.
template <typename T>
__global__ void layernorm_backward_dx_k(T* din, const T* dout, const T* in, const T* w,
                                        const float* mean, const float* rstd, int C) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  const T* dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  math::StatAcc g_sum = 0, gx_sum = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = (ld(x[c]) - m) * r;
    float g = ld(dy[c]) * ld(w[c]);
    g_sum += g;
    gx_sum += g * xhat;
  }
  g_sum = block_reduce(g_sum, SumOp{}, math::StatAcc(0));
  gx_sum = block_reduce(gx_sum, SumOp{}, math::StatAcc(0));
  const float gm = static_cast<float>(g_sum / C), gxm = static_cast<float>(gx_sum / C);
  T* dx = din + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = (ld(x[c]) - m) * r;
    float g = ld(dy[c]) * ld(w[c]);
    dx[c] = st<T>(ld(dx[c]) + (g - gm - xhat * gxm) * r);
  }
}

// Slice by of dw(c) = sum_n dy(n,c) xhat(n,c) and db(c) = sum_n dy(n,c) over the rows
// n = by, by + gridDim.y, ...; column_slices_add adds the slices in order (no atomics).
template <typename T>
__global__ void layernorm_dweights_k(float* part_w, float* part_b, const T* dout, const T* in,
                                     const float* mean, const float* rstd, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0.0f, sb = 0.0f;
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    size_t i = size_t(n) * C + c;
    sw += ld(dout[i]) * ((ld(in[i]) - mean[n]) * rstd[n]);
    sb += ld(dout[i]);
  }
  part_w[size_t(blockIdx.y) * C + c] = sw;
  part_b[size_t(blockIdx.y) * C + c] = sb;
}

struct GeluF {
  __device__ float operator()(float x) const { return math::gelu(x); }
};
// gelu_backward: f(in, dout).
struct GeluGradF {
  __device__ float operator()(float x, float dy) const { return dy * math::gelu_grad(x); }
};
struct AddF {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// out[i] = f(a[i]) (and f(a[i], b[i])), widened, computed in fp32, rounded once; in 16-byte
// vectors when `vec` (every pointer aligned), the tail element by element.
template <typename T, typename F>
__global__ void map1_k(T* out, const T* a, size_t n, F f, bool vec) {
  constexpr int K = Vec16<T>::kN;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / K;
    FY_GRID_LOOP(i, nv) {
      const Vec16<T> x = reinterpret_cast<const Vec16<T>*>(a)[i];
      Vec16<T> o;
#pragma unroll
      for (int k = 0; k < K; ++k) o.v[k] = st<T>(f(ld(x.v[k])));
      reinterpret_cast<Vec16<T>*>(out)[i] = o;
    }
    done = nv * K;
  }
  FY_GRID_LOOP(i, n - done) out[done + i] = st<T>(f(ld(a[done + i])));
}

template <typename T, typename F>
__global__ void map2_k(T* out, const T* a, const T* b, size_t n, F f, bool vec) {
  constexpr int K = Vec16<T>::kN;
  size_t done = 0;
  if (vec) {
    const size_t nv = n / K;
    FY_GRID_LOOP(i, nv) {
      const Vec16<T> x = reinterpret_cast<const Vec16<T>*>(a)[i],
                     y = reinterpret_cast<const Vec16<T>*>(b)[i];
      Vec16<T> o;
#pragma unroll
      for (int k = 0; k < K; ++k) o.v[k] = st<T>(f(ld(x.v[k]), ld(y.v[k])));
      reinterpret_cast<Vec16<T>*>(out)[i] = o;
    }
    done = nv * K;
  }
  FY_GRID_LOOP(i, n - done) out[done + i] = st<T>(f(ld(a[done + i]), ld(b[done + i])));
}

// The logsumexp of one row of V logits, returned to every thread of the block (one block per
// row): the row maximum, then sum exp(l - max) in double as on the CPU. 16-byte vectors over
// the row where it is aligned (ldv a multiple of the vector and the logits aligned: the padded
// vocabulary), the rest element by element.
template <typename T>
__device__ float crossentropy_row_lse(const T* l, int V, bool vec) {
  constexpr int K = Vec16<T>::kN;
  const int vend = vec ? V / K * K : 0;
  const Vec16<T>* lv = reinterpret_cast<const Vec16<T>*>(l);
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < vend / K; j += blockDim.x) {
    const Vec16<T> x = lv[j];
#pragma unroll
    for (int k = 0; k < K; ++k) mx = fmaxf(mx, ld(x.v[k]));
  }
  for (int v = vend + threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, ld(l[v]));
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  double s = 0;
  for (int j = threadIdx.x; j < vend / K; j += blockDim.x) {
    const Vec16<T> x = lv[j];
#pragma unroll
    for (int k = 0; k < K; ++k) s += math::exp_fast(ld(x.v[k]) - mx);
  }
  for (int v = vend + threadIdx.x; v < V; v += blockDim.x) s += math::exp_fast(ld(l[v]) - mx);
  s = block_reduce(s, SumOp{}, 0.0);
  return mx + static_cast<float>(log(s));
}

template <typename T>
__device__ bool row_vectors_aligned(const T* logits, int ldv) {
  return ldv % Vec16<T>::kN == 0 && (reinterpret_cast<uintptr_t>(logits) & 15u) == 0;
}

// One block per row.
template <typename T>
__global__ void crossentropy_forward_k(float* losses, float* lse, const T* logits,
                                       const int32_t* targets, int V, int ldv) {
  const size_t n = blockIdx.x;
  // An ignored target (kIgnoreTarget, a masked-out position) has loss 0 and lse 0
  // (backend.h). The whole block reads the same target, so it returns together, before any
  // block_reduce barrier.
  if (targets[n] == kIgnoreTarget) {
    if (threadIdx.x == 0) losses[n] = lse[n] = 0.0f;
    return;
  }
  const T* l = logits + n * ldv;
  const float z = crossentropy_row_lse(l, V, row_vectors_aligned(logits, ldv));
  if (threadIdx.x == 0) {
    lse[n] = z;
    losses[n] = z - ld(l[targets[n]]);
  }
}

// One element of the backward: softmax from the saved logsumexp, times scale, minus scale at
// the target; 0 on a row whose target is kIgnoreTarget (t < 0 here) and in the padding
// columns v >= V. The CPU's order of operations.
template <typename T>
__device__ __forceinline__ T crossentropy_grad(T l, int v, int V, int32_t t, float z, float scale) {
  if (v >= V || t == kIgnoreTarget) return st<T>(0.0f);
  float g = math::exp_fast(ld(l) - z) * scale;
  if (v == t) g -= scale;
  return st<T>(g);
}

// The gradient over one row of ldv elements, in place, by the block.
template <typename T>
__device__ void crossentropy_row_grad(T* l, float z, int32_t t, float scale, int V, int ldv,
                                      bool vec) {
  constexpr int K = Vec16<T>::kN;
  const int vend = vec ? ldv : 0;
  Vec16<T>* lv = reinterpret_cast<Vec16<T>*>(l);
  for (int j = threadIdx.x; j < vend / K; j += blockDim.x) {
    Vec16<T> x = lv[j];
#pragma unroll
    for (int k = 0; k < K; ++k) x.v[k] = crossentropy_grad(x.v[k], j * K + k, V, t, z, scale);
    lv[j] = x;
  }
  for (int v = vend + threadIdx.x; v < ldv; v += blockDim.x)
    l[v] = crossentropy_grad(l[v], v, V, t, z, scale);
}

// One block per row of (N, ldv).
template <typename T>
__global__ void crossentropy_backward_k(T* logits, const float* lse, const int32_t* targets,
                                        float scale, int V, int ldv) {
  const size_t n = blockIdx.x;
  crossentropy_row_grad(logits + n * ldv, lse[n], targets[n], scale, V, ldv,
                        row_vectors_aligned(logits, ldv));
}

// Both for one row per block: the row is read for its logsumexp and then rewritten as its
// gradient while it is still in L2, one pass over the logits instead of two.
template <typename T>
__global__ void crossentropy_forward_backward_k(float* losses, float* lse, T* logits,
                                                const int32_t* targets, float scale, int V,
                                                int ldv) {
  const size_t n = blockIdx.x;
  T* l = logits + n * ldv;
  const int32_t t = targets[n];
  const bool vec = row_vectors_aligned(logits, ldv);
  float z = 0.0f;
  if (t == kIgnoreTarget) {  // the whole block takes this branch
    if (threadIdx.x == 0) losses[n] = lse[n] = 0.0f;
  } else {
    z = crossentropy_row_lse(l, V, vec);
    if (threadIdx.x == 0) {
      lse[n] = z;
      losses[n] = z - ld(l[t]);
    }
    __syncthreads();  // the target's logit is read before the row becomes the gradient
  }
  crossentropy_row_grad(l, z, t, scale, V, ldv, vec);
}

}  // namespace

void CudaBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                    const void* wpe, int B, int T, int C) {
  size_t total = size_t(B) * T * C;
  if (!total) return;
  FY_TYPED(E, {
    FY_LAUNCH(embedding_forward_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(out), tokens,
              static_cast<const E*>(wte), static_cast<const E*>(wpe), T, C, total);
  });
}

void CudaBackend::embedding_backward(void* dwte, void* dwpe, const void* dout,
                                     const int32_t* tokens, int B, int T, int C) {
  const int N = B * T;
  if (!N || !C) return;
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  const unsigned runs = std::min<unsigned>(kEmbedSlices, N);
  std::lock_guard<std::mutex> lock(scratch_mu());
  int32_t* order = static_cast<int32_t*>(scratch(2 * sizeof(int32_t) * size_t(N)));
  int32_t* sorted = order + N;
  FY_LAUNCH(token_rank_k, (N + kEltThreads - 1) / kEltThreads, kEltThreads, order, sorted, tokens,
            N);
  FY_TYPED(E, {
    FY_LAUNCH(embedding_backward_wte_k<E>, dim3(cols, runs), kEltThreads, static_cast<E*>(dwte),
              static_cast<const E*>(dout), order, sorted, N, C);
    if (dwpe)
      FY_LAUNCH(embedding_backward_wpe_k<E>, elt_blocks(size_t(T) * C), kEltThreads,
                static_cast<E*>(dwpe), static_cast<const E*>(dout), B, T, C);
  });
}

void CudaBackend::layernorm_forward(void* out, float* mean, float* rstd, const void* in,
                                    const void* w, const void* b, int N, int C) {
  if (!N) return;
  FY_TYPED(E, {
    FY_LAUNCH(layernorm_forward_k<E>, N, kRowThreads, static_cast<E*>(out), mean, rstd,
              static_cast<const E*>(in), static_cast<const E*>(w), static_cast<const E*>(b), C);
  });
}

void CudaBackend::residual_layernorm_forward(void* res, void* out, float* mean, float* rstd,
                                             const void* a, const void* b, const void* w,
                                             const void* bias, int N, int C) {
  if (!N) return;
  FY_TYPED(E, {
    FY_LAUNCH(residual_layernorm_forward_k<E>, N, kRowThreads, static_cast<E*>(res),
              static_cast<E*>(out), mean, rstd, static_cast<const E*>(a), static_cast<const E*>(b),
              static_cast<const E*>(w), static_cast<const E*>(bias), C);
  });
}

void CudaBackend::layernorm_backward(void* din, void* dw, void* db, const void* dout,
                                     const void* in, const void* w, const float* mean,
                                     const float* rstd, int N, int C) {
  if (!N) return;
  const int slices = wide_reduce_slices(N, C);
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part_w = static_cast<float*>(scratch(2 * sizeof(float) * slices * size_t(C)));
  float* part_b = part_w + size_t(slices) * C;
  FY_TYPED(E, {
    const E *dy = static_cast<const E*>(dout), *x = static_cast<const E*>(in);
    FY_LAUNCH(layernorm_backward_dx_k<E>, N, kRowThreads, static_cast<E*>(din), dy, x,
              static_cast<const E*>(w), mean, rstd, C);
    FY_LAUNCH(layernorm_dweights_k<E>, dim3(cols, slices), kEltThreads, part_w, part_b, dy, x, mean,
              rstd, N, C);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(C), slices_add_block(), static_cast<E*>(dw),
              part_w, slices, C);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(C), slices_add_block(), static_cast<E*>(db),
              part_b, slices, C);
  });
}

void CudaBackend::gelu_forward(void* out, const void* in, size_t n) {
  if (!n) return;
  const bool vec = all_aligned16(out, in);
  FY_TYPED(E, {
    FY_LAUNCH((map1_k<E, GeluF>), elt_blocks(vec ? n / Vec16<E>::kN : n), kEltThreads,
              static_cast<E*>(out), static_cast<const E*>(in), n, GeluF{}, vec);
  });
}

void CudaBackend::gelu_backward(void* din, const void* in, const void* dout, size_t n) {
  if (!n) return;
  const bool vec = all_aligned16(din, in, dout);
  FY_TYPED(E, {
    FY_LAUNCH((map2_k<E, GeluGradF>), elt_blocks(vec ? n / Vec16<E>::kN : n), kEltThreads,
              static_cast<E*>(din), static_cast<const E*>(in), static_cast<const E*>(dout), n,
              GeluGradF{}, vec);
  });
}

void CudaBackend::add(void* out, const void* a, const void* b, size_t n) {
  if (!n) return;
  const bool vec = all_aligned16(out, a, b);
  FY_TYPED(E, {
    FY_LAUNCH((map2_k<E, AddF>), elt_blocks(vec ? n / Vec16<E>::kN : n), kEltThreads,
              static_cast<E*>(out), static_cast<const E*>(a), static_cast<const E*>(b), n, AddF{},
              vec);
  });
}

void CudaBackend::crossentropy_forward(float* losses, float* lse, const void* logits,
                                       const int32_t* targets, int N, int V, int ld) {
  if (!N) return;
  FY_TYPED(E, {
    FY_LAUNCH(crossentropy_forward_k<E>, N, kRowThreads, losses, lse, static_cast<const E*>(logits),
              targets, V, ld);
  });
}

void CudaBackend::crossentropy_backward(void* logits, const float* lse, const int32_t* targets,
                                        float scale, int N, int V, int ld) {
  if (!N || !ld) return;
  FY_TYPED(E, {
    FY_LAUNCH(crossentropy_backward_k<E>, N, kRowThreads, static_cast<E*>(logits), lse, targets,
              scale, V, ld);
  });
}

void CudaBackend::crossentropy_forward_backward(float* losses, float* lse, void* logits,
                                                const int32_t* targets, float scale, int N, int V,
                                                int ld) {
  if (!N || !ld) return;
  FY_TYPED(E, {
    FY_LAUNCH(crossentropy_forward_backward_k<E>, N, kRowThreads, losses, lse,
              static_cast<E*>(logits), targets, scale, V, ld);
  });
}

}  // namespace fuyou::cuda
