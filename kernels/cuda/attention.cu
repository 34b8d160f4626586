// Causal self-attention on the CUDA backend, in an unfused form: for one (batch row, head)
// at a time, cuBLAS GEMMs around causal-softmax kernels in the (2, T, T) fp32 scratch the
// model's workspace lends (Backend::attention_forward). The forward keeps each query row's
// log-sum-exp; the backward recomputes the probabilities from it, as the CPU backend
// (kernels/cpu/attention.cc) does block by block, so the two can be compared element by
// element. Nothing of size T x T outlives a call. A fused (flash) kernel would need no
// scratch and run far fewer launches (docs/cuda.md). The attention GEMMs stay fp32 whatever
// runtime.precision says: the precision applies to matmul_forward / matmul_backward only,
// as on the CPU backend.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// One block per row t of s(T,T): entries 0..t become the softmax of the scores, t+1..T-1
// zero, and lse[t] the row's log-sum-exp (the CPU's softmax_causal_row, with the block
// reductions replacing its serial loops).
__global__ void softmax_causal_k(float* s, float* lse, int T) {
  const int t = blockIdx.x;
  float* row = s + static_cast<size_t>(t) * T;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  float sum = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) {
    float e = math::exp_fast(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, SumOp{}, 0.0f);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < T; j += blockDim.x) row[j] = j <= t ? row[j] * inv : 0.0f;
  if (threadIdx.x == 0) lse[t] = mx + logf(sum);
}

// One block per row t: the probabilities again from the scores, exp(s - lse[t]) over 0..t,
// zero past t (the CPU's softmax_causal_row_recompute). In place.
__global__ void softmax_recompute_k(float* s, const float* lse, int T) {
  const int t = blockIdx.x;
  float* row = s + static_cast<size_t>(t) * T;
  const float l = lse[t];
  for (int j = threadIdx.x; j < T; j += blockDim.x) row[j] = j <= t ? math::exp_fast(row[j] - l) : 0.0f;
}

// One block per row: dS = scale * P * (dP - sum_j P_j dP_j) over 0..t, zero past t (the
// CPU's softmax_causal_row_backward). In place on dP.
__global__ void softmax_causal_backward_k(const float* p, float* dp, int T, float scale) {
  const int t = blockIdx.x;
  const float* pr = p + static_cast<size_t>(t) * T;
  float* d = dp + static_cast<size_t>(t) * T;
  float dot = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) dot += pr[j] * d[j];
  dot = block_reduce(dot, SumOp{}, 0.0f);
  for (int j = threadIdx.x; j < T; j += blockDim.x) d[j] = j <= t ? scale * pr[j] * (d[j] - dot) : 0.0f;
}

}  // namespace

// For batch row b, head h: q at qkv + b*T*3C + h*hd with row stride 3C, k at +C, v at +2C.
void CudaBackend::attention_forward(void* out_v, float* lse, float* scratch, const void* qkv_v, int B, int T,
                                    int C, int H) {
  float* out = static_cast<float*>(out_v);
  const float* qkv = static_cast<const float*>(qkv_v);
  if (!B || !T) return;
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* s = scratch;  // (T, T)
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
      float* o = out + static_cast<size_t>(b) * T * C + h * hd;
      float* l = lse + (static_cast<size_t>(b) * H + h) * T;
      gemm(false, true, T, T, hd, scale, q, ld, 0, q + C, ld, 0, 0.0f, s, T, 0, 1, false);
      FY_LAUNCH(softmax_causal_k, static_cast<unsigned>(T), kRowThreads, s, l, T);
      gemm(false, false, T, hd, T, 1.0f, s, T, 0, q + 2 * C, ld, 0, 0.0f, o, C, 0, 1, false);
    }
}

void CudaBackend::attention_backward(void* dqkv_v, float* scratch, const void* dout_v, const void* qkv_v,
                                     const float* lse, int B, int T, int C, int H) {
  float* dqkv = static_cast<float*>(dqkv_v);
  const float* dout = static_cast<const float*>(dout_v);
  const float* qkv = static_cast<const float*>(qkv_v);
  if (!B || !T) return;
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* p = scratch;                                    // (T, T) probabilities
  float* dp = scratch + static_cast<size_t>(T) * T;      // (T, T) their gradient
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
      const float *q = qkv + row0, *k = q + C, *v = q + 2 * C;
      float *dq = dqkv + row0, *dk = dq + C, *dv = dq + 2 * C;
      const float* dO = dout + static_cast<size_t>(b) * T * C + h * hd;
      const float* l = lse + (static_cast<size_t>(b) * H + h) * T;
      // P from the scores and lse; dV = P^T dO; dP = dO V^T; dS; dQ = dS K; dK = dS^T Q.
      gemm(false, true, T, T, hd, scale, q, ld, 0, k, ld, 0, 0.0f, p, T, 0, 1, false);
      FY_LAUNCH(softmax_recompute_k, static_cast<unsigned>(T), kRowThreads, p, l, T);
      gemm(true, false, T, hd, T, 1.0f, p, T, 0, dO, C, 0, 0.0f, dv, ld, 0, 1, false);
      gemm(false, true, T, T, hd, 1.0f, dO, C, 0, v, ld, 0, 0.0f, dp, T, 0, 1, false);
      FY_LAUNCH(softmax_causal_backward_k, static_cast<unsigned>(T), kRowThreads, p, dp, T, scale);
      gemm(false, false, T, hd, T, 1.0f, dp, T, 0, k, ld, 0, 0.0f, dq, ld, 0, 1, false);
      gemm(true, false, T, hd, T, 1.0f, dp, T, 0, q, ld, 0, 0.0f, dk, ld, 0, 1, false);
    }
}

}  // namespace fuyou::cuda
