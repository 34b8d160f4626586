// The opt and llama families' kernels on the CUDA backend: RMSNorm, rotary embeddings, the
// repeated-head form of grouped-query attention, SwiGLU and ReLU. Semantics and the order of
// operations follow kernels/cpu/ops_families.cc; per-element math is element_math.h.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// One block per row: sum of squares in math::StatAcc, as on the CPU.
__global__ void rmsnorm_forward_k(float* out, float* rstd, const float* in, const float* w,
                                  float eps, int C) {
  const size_t n = blockIdx.x;
  const float* x = in + n * C;
  math::StatAcc ss = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) ss += static_cast<math::StatAcc>(x[c]) * x[c];
  ss = block_reduce(ss, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(ss / C + eps));
  float* o = out + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = math::rmsnorm_apply(x[c], r, w[c]);
  if (threadIdx.x == 0) rstd[n] = r;
}

// One block per row: din += rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
__global__ void rmsnorm_backward_dx_k(float* din, const float* dout, const float* in,
                                      const float* w, const float* rstd, int C) {
  const size_t n = blockIdx.x;
  const float* x = in + n * C;
  const float* dy = dout + n * C;
  const float r = rstd[n];
  math::StatAcc gx = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    gx += static_cast<math::StatAcc>(dy[c] * w[c]) * (x[c] * r);
  gx = block_reduce(gx, SumOp{}, math::StatAcc(0));
  const float gxm = static_cast<float>(gx / C);
  float* dx = din + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xhat = x[c] * r;
    dx[c] += (dy[c] * w[c] - xhat * gxm) * r;
  }
}

// part(by, c) = sum of dy(n,c) x(n,c) rstd(n) over the rows n = by, by + gridDim.y, ...;
// column_slices_add adds the slices into dw in order (no atomics: the same bits every run).
__global__ void rmsnorm_dweight_k(float* part, const float* dout, const float* in,
                                  const float* rstd, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    size_t i = size_t(n) * C + c;
    s += dout[i] * (in[i] * rstd[n]);
  }
  part[size_t(blockIdx.y) * C + c] = s;
}

// One thread per (row n, head h of the Hq + Hkv rotated heads, pair i < D/2).
__global__ void rope_k(float* qkvc, int T, int Hq, int Hkv, int D, float theta, float sign,
                       size_t total) {
  const int half = D / 2, heads = Hq + Hkv;
  const size_t row = static_cast<size_t>(Hq + 2 * Hkv) * D;
  FY_GRID_LOOP(idx, total) {
    const int i = static_cast<int>(idx % half);
    const int h = static_cast<int>((idx / half) % heads);
    const size_t n = idx / (static_cast<size_t>(half) * heads);
    const float a = math::rope_angle(static_cast<int>(n % T), i, D, theta);
    float* x = qkvc + n * row + static_cast<size_t>(h) * D;
    math::rope_rotate(x[i], x[half + i], cosf(a), sign * sinf(a));
  }
}

// One thread per element of qkv(N, 3C): q copied, k/v head h read from compact head h / G.
__global__ void repeat_kv_forward_k(float* qkv, const float* qkvc, int Hq, int Hkv, int D,
                                    size_t total) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / (3 * C), e = idx % (3 * C);
    const float* src = qkvc + n * (C + 2 * KV);
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
// of its G copies in head order (the CPU's order).
__global__ void repeat_kv_backward_k(float* dqkvc, const float* dqkv, int Hq, int Hkv, int D,
                                     size_t total) {
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const int G = Hq / Hkv;
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / (C + 2 * KV), e = idx % (C + 2 * KV);
    const float* src = dqkv + n * 3 * C;
    if (e < C) {
      dqkvc[idx] = src[e];
    } else {
      const size_t part = 1 + (e - C) / KV;
      const size_t within = (e - C) % KV;
      const size_t j = within / D, k = within % D;
      float s = 0.0f;
      for (int g = 0; g < G; ++g) s += src[part * C + (j * G + g) * D + k];
      dqkvc[idx] = s;
    }
  }
}

__global__ void swiglu_forward_k(float* out, const float* gu, int F, size_t total) {
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / F, f = idx % F;
    const float* g = gu + n * 2 * F;
    out[idx] = math::silu(g[f]) * g[F + f];
  }
}

__global__ void swiglu_backward_k(float* dgu, const float* gu, const float* dout, int F,
                                  size_t total) {
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / F, f = idx % F;
    const float* g = gu + n * 2 * F;
    float* dg = dgu + n * 2 * F;
    const float dy = dout[idx];
    dg[f] = dy * g[F + f] * math::silu_grad(g[f]);
    dg[F + f] = dy * math::silu(g[f]);
  }
}

__global__ void relu_forward_k(float* out, const float* in, size_t n) {
  FY_GRID_LOOP(i, n) out[i] = math::relu(in[i]);
}

__global__ void relu_backward_k(float* din, const float* in, const float* dout, size_t n) {
  FY_GRID_LOOP(i, n) din[i] = dout[i] * math::relu_grad(in[i]);
}

}  // namespace

void CudaBackend::rmsnorm_forward(void* out_v, float* rstd, const void* in_v, const void* w_v,
                                  float eps, int N, int C) {
  float* out = static_cast<float*>(out_v);
  const float* in = static_cast<const float*>(in_v);
  const float* w = static_cast<const float*>(w_v);
  if (!N) return;
  FY_LAUNCH(rmsnorm_forward_k, N, kRowThreads, out, rstd, in, w, eps, C);
}

void CudaBackend::rmsnorm_backward(void* din_v, void* dw_v, const void* dout_v, const void* in_v,
                                   const void* w_v, const float* rstd, int N, int C) {
  float* din = static_cast<float*>(din_v);
  float* dw = static_cast<float*>(dw_v);
  const float* dout = static_cast<const float*>(dout_v);
  const float* in = static_cast<const float*>(in_v);
  const float* w = static_cast<const float*>(w_v);
  if (!N) return;
  FY_LAUNCH(rmsnorm_backward_dx_k, N, kRowThreads, din, dout, in, w, rstd, C);
  const int slices = reduce_slices(N);
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part = static_cast<float*>(scratch(sizeof(float) * slices * size_t(C)));
  FY_LAUNCH(rmsnorm_dweight_k, dim3(cols, slices), kEltThreads, part, dout, in, rstd, N, C);
  FY_LAUNCH(column_slices_add, cols, kEltThreads, dw, part, slices, C);
}

void CudaBackend::rope_forward(void* qkvc_v, int B, int T, int Hq, int Hkv, int D, float theta) {
  float* qkvc = static_cast<float*>(qkvc_v);
  size_t total = static_cast<size_t>(B) * T * (Hq + Hkv) * (D / 2);
  if (!total) return;
  FY_LAUNCH(rope_k, elt_blocks(total), kEltThreads, qkvc, T, Hq, Hkv, D, theta, 1.0f, total);
}

void CudaBackend::rope_backward(void* dqkvc_v, int B, int T, int Hq, int Hkv, int D, float theta) {
  float* dqkvc = static_cast<float*>(dqkvc_v);
  size_t total = static_cast<size_t>(B) * T * (Hq + Hkv) * (D / 2);
  if (!total) return;
  FY_LAUNCH(rope_k, elt_blocks(total), kEltThreads, dqkvc, T, Hq, Hkv, D, theta, -1.0f, total);
}

void CudaBackend::repeat_kv_forward(void* qkv_v, const void* qkvc_v, int N, int Hq, int Hkv, int D) {
  float* qkv = static_cast<float*>(qkv_v);
  const float* qkvc = static_cast<const float*>(qkvc_v);
  size_t total = static_cast<size_t>(N) * 3 * Hq * D;
  if (!total) return;
  FY_LAUNCH(repeat_kv_forward_k, elt_blocks(total), kEltThreads, qkv, qkvc, Hq, Hkv, D, total);
}

void CudaBackend::repeat_kv_backward(void* dqkvc_v, const void* dqkv_v, int N, int Hq, int Hkv,
                                     int D) {
  float* dqkvc = static_cast<float*>(dqkvc_v);
  const float* dqkv = static_cast<const float*>(dqkv_v);
  size_t total = static_cast<size_t>(N) * (Hq + 2 * Hkv) * D;
  if (!total) return;
  FY_LAUNCH(repeat_kv_backward_k, elt_blocks(total), kEltThreads, dqkvc, dqkv, Hq, Hkv, D, total);
}

void CudaBackend::swiglu_forward(void* out_v, const void* gu_v, int N, int F) {
  float* out = static_cast<float*>(out_v);
  const float* gu = static_cast<const float*>(gu_v);
  size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_LAUNCH(swiglu_forward_k, elt_blocks(total), kEltThreads, out, gu, F, total);
}

void CudaBackend::swiglu_backward(void* dgu_v, const void* gu_v, const void* dout_v, int N, int F) {
  float* dgu = static_cast<float*>(dgu_v);
  const float* gu = static_cast<const float*>(gu_v);
  const float* dout = static_cast<const float*>(dout_v);
  size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_LAUNCH(swiglu_backward_k, elt_blocks(total), kEltThreads, dgu, gu, dout, F, total);
}

void CudaBackend::relu_forward(void* out_v, const void* in_v, size_t n) {
  float* out = static_cast<float*>(out_v);
  const float* in = static_cast<const float*>(in_v);
  if (!n) return;
  FY_LAUNCH(relu_forward_k, elt_blocks(n), kEltThreads, out, in, n);
}

void CudaBackend::relu_backward(void* din_v, const void* in_v, const void* dout_v, size_t n) {
  float* din = static_cast<float*>(din_v);
  const float* in = static_cast<const float*>(in_v);
  const float* dout = static_cast<const float*>(dout_v);
  if (!n) return;
  FY_LAUNCH(relu_backward_k, elt_blocks(n), kEltThreads, din, in, dout, n);
}

}  // namespace fuyou::cuda
