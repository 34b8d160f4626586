// The opt and llama families' kernels on the CUDA backend: RMSNorm, rotary embeddings, the
// repeated-head form of grouped-query attention, SwiGLU and ReLU. Semantics and the order of
// operations follow kernels/cpu/ops_families.cc; per-element math is element_math.h. Templates
// on the storage type, as in ops.cu.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// One block per row: sum of squares in math::StatAcc, as on the CPU. Thread i reads the
// columns i, i + blockDim.x, ...
template <typename T>
__device__ void rmsnorm_row(T* out, float* rstd, const T* in, const T* w, float eps, int C) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  math::StatAcc ss = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float xc = ld(x[c]);
    ss += static_cast<math::StatAcc>(xc) * xc;
  }
  ss = block_reduce(ss, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(ss / C + eps));
  T* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = st<T>(math::rmsnorm_apply(ld(x[c]), r, ld(w[c])));
  if (threadIdx.x == 0) rstd[n] = r;
}

template <typename T>
__global__ void rmsnorm_forward_k(T* out, float* rstd, const T* in, const T* w, float eps, int C) {
  rmsnorm_row(out, rstd, in, w, eps, C);
}

// The residual add, then the row's RMSNorm of the stored sum; as residual_layernorm_forward_k
// (ops.cu), each thread reads back only the columns it stored.
template <typename T>
__global__ void residual_rmsnorm_forward_k(T* res, T* out, float* rstd, const T* a, const T* b,
                                           const T* w, float eps, int C) {
  const size_t row = size_t(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    res[row + c] = st<T>(ld(a[row + c]) + ld(b[row + c]));
  rmsnorm_row(out, rstd, res, w, eps, C);
}

// One block per row: din += rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
template <typename T>
__global__ void rmsnorm_backward_dx_k(T* din, const T* dout, const T* in, const T* w,
                                      const float* rstd, int C) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  const T* dy = dout + n * C;
  const float r = rstd[n];
  math::StatAcc gx = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    gx += static_cast<math::StatAcc>(ld(dy[c]) * ld(w[c])) * (ld(x[c]) * r);
  gx = block_reduce(gx, SumOp{}, math::StatAcc(0));
  const float gxm = static_cast<float>(gx / C);
  T* dx = din + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = ld(x[c]) * r;
    dx[c] = st<T>(ld(dx[c]) + (ld(dy[c]) * ld(w[c]) - xhat * gxm) * r);
  }
}

// part(by, c) = sum of dy(n,c) x(n,c) rstd(n) over the rows n = by, by + gridDim.y, ...;
// column_slices_add adds the slices into dw in order (no atomics: the same bits every run).
template <typename T>
__global__ void rmsnorm_dweight_k(float* part, const T* dout, const T* in, const float* rstd, int N,
                                  int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    size_t i = size_t(n) * C + c;
    s += ld(dout[i]) * (ld(in[i]) * rstd[n]);
  }
  part[size_t(blockIdx.y) * C + c] = s;
}

// Qwen3's q/k norm: one block per (row n, head h < Hq + Hkv), blockIdx.x = n (Hq + Hkv) + h;
// the head's D values start at n (Hq + 2Hkv) D + h D. In place: each thread writes only the
// columns it read.
constexpr int kHeadThreads = 64;

__device__ inline size_t qk_head_offset(unsigned j, int Hq, int Hkv, int D) {
  const unsigned heads = Hq + Hkv, n = j / heads, h = j % heads;
  return (size_t(n) * (Hq + 2 * Hkv) + h) * D;
}

template <typename T>
__global__ void qk_norm_forward_k(T* qkvc, T* saved, float* rstd, const T* qw, const T* kw,
                                  float eps, int Hq, int Hkv, int D) {
  const unsigned j = blockIdx.x;
  T* x = qkvc + qk_head_offset(j, Hq, Hkv, D);
  const T* w = j % (Hq + Hkv) < unsigned(Hq) ? qw : kw;
  math::StatAcc ss = 0;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float xc = ld(x[c]);
    ss += static_cast<math::StatAcc>(xc) * xc;
    if (saved) saved[size_t(j) * D + c] = x[c];
  }
  ss = block_reduce(ss, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(ss / D + eps));
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    x[c] = st<T>(math::rmsnorm_apply(ld(x[c]), r, ld(w[c])));
  if (threadIdx.x == 0) rstd[j] = r;
}

// The input gradient of each head, overwriting the output gradient (rmsnorm_backward_dx_k's
// formula); launched after qk_norm_dweight_k has read the output gradient.
template <typename T>
__global__ void qk_norm_backward_dx_k(T* dqkvc, const T* saved, const T* qw, const T* kw,
                                      const float* rstd, int Hq, int Hkv, int D) {
  const unsigned j = blockIdx.x;
  T* d = dqkvc + qk_head_offset(j, Hq, Hkv, D);
  const T* x = saved + size_t(j) * D;
  const T* w = j % (Hq + Hkv) < unsigned(Hq) ? qw : kw;
  const float r = rstd[j];
  math::StatAcc gx = 0;
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    gx += static_cast<math::StatAcc>(ld(d[c]) * ld(w[c])) * (ld(x[c]) * r);
  gx = block_reduce(gx, SumOp{}, math::StatAcc(0));
  const float gxm = static_cast<float>(gx / D);
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float xhat = ld(x[c]) * r;
    d[c] = st<T>((ld(d[c]) * ld(w[c]) - xhat * gxm) * r);
  }
}

// part(by, c) for the q heads (which 0) or the k heads (1): the sum of dy x rstd over that
// kind's heads j = by, by + gridDim.y, ... of every row; column_slices_add adds the slices.
template <typename T>
__global__ void qk_norm_dweight_k(float* part, const T* dqkvc, const T* saved, const float* rstd,
                                  int N, int Hq, int Hkv, int D, int which) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= D) return;
  const int per_row = which ? Hkv : Hq, first = which ? Hq : 0;
  const unsigned count = unsigned(N) * per_row;
  float s = 0.0f;
  for (unsigned i = blockIdx.y; i < count; i += gridDim.y) {
    const unsigned j = (i / per_row) * (Hq + Hkv) + first + i % per_row;
    s += ld(dqkvc[qk_head_offset(j, Hq, Hkv, D) + c]) * (ld(saved[size_t(j) * D + c]) * rstd[j]);
  }
  part[size_t(blockIdx.y) * D + c] = s;
}

// One thread per (row n, head h of the Hq + Hkv rotated heads, pair i < D/2); row n at position
// pos[n] (packed records), or n % T_ when pos is null.
// The table travels by value in the kernel's parameters (about 1 KiB, under CUDA's 4 KiB).
template <typename T>
__global__ void rope_k(T* qkvc, int T_, int Hq, int Hkv, int D, const RopeTable rope, float sign,
                       const int32_t* pos, size_t total) {
  const int half = D / 2, heads = Hq + Hkv;
  const size_t row = static_cast<size_t>(Hq + 2 * Hkv) * D;
  FY_GRID_LOOP(idx, total) {
    const int i = static_cast<int>(idx % half);
    const int h = static_cast<int>((idx / half) % heads);
    const size_t n = idx / (static_cast<size_t>(half) * heads);
    const float a = math::rope_angle(pos ? pos[n] : static_cast<int>(n % T_), rope.inv_freq[i]);
    T* x = qkvc + n * row + static_cast<size_t>(h) * D;
    float x0 = ld(x[i]), x1 = ld(x[half + i]);
    math::rope_rotate(x0, x1, cosf(a) * rope.scale, sign * (sinf(a) * rope.scale));
    x[i] = st<T>(x0);
    x[half + i] = st<T>(x1);
  }
}

// One thread per element of qkv(N, 3C): q copied, k/v head h read from compact head h / G.
template <typename T>
__global__ void repeat_kv_forward_k(T* qkv, const T* qkvc, int Hq, int Hkv, int D, size_t total) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / (3 * C), e = idx % (3 * C);
    const T* src = qkvc + n * (C + 2 * KV);
    if (e < C) {
      qkv[idx] = src[e];
    } else {
      const size_t part = e / C;  // 1 = k, 2 = v
      const size_t within = e % C;
      const size_t h = within / D, k = within % D;
      qkv[idx] = src[C + (part - 1) * KV + (h / G) * D + k];
    }
  }
}

// One thread per element of dqkvc(N, C + 2 KV): q copied, each compact k/v element the sum
// of its G copies in head order (the CPU's order), in fp32, rounded once.
template <typename T>
__global__ void repeat_kv_backward_k(T* dqkvc, const T* dqkv, int Hq, int Hkv, int D,
                                     size_t total) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / (C + 2 * KV), e = idx % (C + 2 * KV);
    const T* src = dqkv + n * 3 * C;
    if (e < C) {
      dqkvc[idx] = src[e];
    } else {
      const size_t part = 1 + (e - C) / KV;
      const size_t within = (e - C) % KV;
      const size_t j = within / D, k = within % D;
      float s = 0.0f;
      for (int g = 0; g < G; ++g) s += ld(src[part * C + (j * G + g) * D + k]);
      dqkvc[idx] = st<T>(s);
    }
  }
}

template <typename T>
__global__ void swiglu_forward_k(T* out, const T* gu, int F, size_t total) {
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / F, f = idx % F;
    const T* g = gu + n * 2 * F;
    out[idx] = st<T>(math::silu(ld(g[f])) * ld(g[F + f]));
  }
}

template <typename T>
__global__ void swiglu_backward_k(T* dgu, const T* gu, const T* dout, int F, size_t total) {
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / F, f = idx % F;
    const T* g = gu + n * 2 * F;
    T* dg = dgu + n * 2 * F;
    const float dy = ld(dout[idx]), gate = ld(g[f]), up = ld(g[F + f]);
    dg[f] = st<T>(dy * up * math::silu_grad(gate));
    dg[F + f] = st<T>(dy * math::silu(gate));
  }
}

template <typename T>
__global__ void relu_forward_k(T* out, const T* in, size_t n) {
  FY_GRID_LOOP(i, n) out[i] = st<T>(math::relu(ld(in[i])));
}

template <typename T>
__global__ void relu_backward_k(T* din, const T* in, const T* dout, size_t n) {
  FY_GRID_LOOP(i, n) din[i] = st<T>(ld(dout[i]) * math::relu_grad(ld(in[i])));
}

}  // namespace

void CudaBackend::rmsnorm_forward(void* out, float* rstd, const void* in, const void* w, float eps,
                                  int N, int C) {
  if (!N) return;
  FY_TYPED(E, FY_LAUNCH(rmsnorm_forward_k<E>, N, kRowThreads, static_cast<E*>(out), rstd,
                        static_cast<const E*>(in), static_cast<const E*>(w), eps, C));
}

void CudaBackend::residual_rmsnorm_forward(void* res, void* out, float* rstd, const void* a,
                                           const void* b, const void* w, float eps, int N, int C) {
  if (!N) return;
  FY_TYPED(E, FY_LAUNCH(residual_rmsnorm_forward_k<E>, N, kRowThreads, static_cast<E*>(res),
                        static_cast<E*>(out), rstd, static_cast<const E*>(a),
                        static_cast<const E*>(b), static_cast<const E*>(w), eps, C));
}

void CudaBackend::rmsnorm_backward(void* din, void* dw, const void* dout, const void* in,
                                   const void* w, const float* rstd, int N, int C) {
  if (!N) return;
  const int slices = reduce_slices(N);
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part = static_cast<float*>(scratch(sizeof(float) * slices * size_t(C)));
  FY_TYPED(E, {
    const E *dy = static_cast<const E*>(dout), *x = static_cast<const E*>(in);
    FY_LAUNCH(rmsnorm_backward_dx_k<E>, N, kRowThreads, static_cast<E*>(din), dy, x,
              static_cast<const E*>(w), rstd, C);
    FY_LAUNCH(rmsnorm_dweight_k<E>, dim3(cols, slices), kEltThreads, part, dy, x, rstd, N, C);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(C), slices_add_block(), static_cast<E*>(dw),
              part, slices, C);
  });
}

void CudaBackend::qk_norm_forward(void* qkvc, void* saved, float* rstd, const void* qw,
                                  const void* kw, float eps, int N, int Hq, int Hkv, int D) {
  if (!N) return;
  FY_TYPED(E, FY_LAUNCH(qk_norm_forward_k<E>, N * (Hq + Hkv), kHeadThreads, static_cast<E*>(qkvc),
                        static_cast<E*>(saved), rstd, static_cast<const E*>(qw),
                        static_cast<const E*>(kw), eps, Hq, Hkv, D));
}

void CudaBackend::qk_norm_backward(void* dqkvc, void* dqw, void* dkw, const void* saved,
                                   const void* qw, const void* kw, const float* rstd, int N, int Hq,
                                   int Hkv, int D) {
  if (!N) return;
  const int slices = reduce_slices(N);
  const unsigned cols = (D + kEltThreads - 1) / kEltThreads;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part = static_cast<float*>(scratch(sizeof(float) * 2 * slices * size_t(D)));
  FY_TYPED(E, {
    const E* x = static_cast<const E*>(saved);
    E* d = static_cast<E*>(dqkvc);
    for (int which = 0; which < 2; ++which)
      FY_LAUNCH(qk_norm_dweight_k<E>, dim3(cols, slices), kEltThreads,
                part + size_t(which) * slices * D, d, x, rstd, N, Hq, Hkv, D, which);
    FY_LAUNCH(qk_norm_backward_dx_k<E>, N * (Hq + Hkv), kHeadThreads, d, x,
              static_cast<const E*>(qw), static_cast<const E*>(kw), rstd, Hq, Hkv, D);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(D), slices_add_block(), static_cast<E*>(dqw),
              part, slices, D);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(D), slices_add_block(), static_cast<E*>(dkw),
              part + size_t(slices) * D, slices, D);
  });
}

void CudaBackend::rope_forward(void* qkvc, int B, int T, int Hq, int Hkv, int D,
                               const RopeTable& rope, const int32_t* pos) {
  size_t total = static_cast<size_t>(B) * T * (Hq + Hkv) * (D / 2);
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(rope_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(qkvc), T, Hq,
                        Hkv, D, rope, 1.0f, pos, total));
}

void CudaBackend::rope_backward(void* dqkvc, int B, int T, int Hq, int Hkv, int D,
                                const RopeTable& rope, const int32_t* pos) {
  size_t total = static_cast<size_t>(B) * T * (Hq + Hkv) * (D / 2);
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(rope_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(dqkvc), T, Hq,
                        Hkv, D, rope, -1.0f, pos, total));
}

void CudaBackend::repeat_kv_forward(void* qkv, const void* qkvc, int N, int Hq, int Hkv, int D) {
  size_t total = static_cast<size_t>(N) * 3 * Hq * D;
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(repeat_kv_forward_k<E>, elt_blocks(total), kEltThreads,
                        static_cast<E*>(qkv), static_cast<const E*>(qkvc), Hq, Hkv, D, total));
}

void CudaBackend::repeat_kv_backward(void* dqkvc, const void* dqkv, int N, int Hq, int Hkv, int D) {
  size_t total = static_cast<size_t>(N) * (Hq + 2 * Hkv) * D;
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(repeat_kv_backward_k<E>, elt_blocks(total), kEltThreads,
                        static_cast<E*>(dqkvc), static_cast<const E*>(dqkv), Hq, Hkv, D, total));
}

void CudaBackend::swiglu_forward(void* out, const void* gu, int N, int F) {
  size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(swiglu_forward_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(out),
                        static_cast<const E*>(gu), F, total));
}

void CudaBackend::swiglu_backward(void* dgu, const void* gu, const void* dout, int N, int F) {
  size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(swiglu_backward_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(dgu),
                        static_cast<const E*>(gu), static_cast<const E*>(dout), F, total));
}

void CudaBackend::relu_forward(void* out, const void* in, size_t n) {
  if (!n) return;
  FY_TYPED(E, FY_LAUNCH(relu_forward_k<E>, elt_blocks(n), kEltThreads, static_cast<E*>(out),
                        static_cast<const E*>(in), n));
}

void CudaBackend::relu_backward(void* din, const void* in, const void* dout, size_t n) {
  if (!n) return;
  FY_TYPED(E, FY_LAUNCH(relu_backward_k<E>, elt_blocks(n), kEltThreads, static_cast<E*>(din),
                        static_cast<const E*>(in), static_cast<const E*>(dout), n));
}

}  // namespace fuyou::cuda
