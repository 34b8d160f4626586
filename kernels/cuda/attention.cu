// Causal self-attention on the CUDA backend, in its first, materialising form: the
// probabilities att(B,H,T,T) that the Backend interface passes between forward and backward
// are computed with strided-batched cuBLAS GEMMs (one call per batch row, batched over the
// H heads) around a causal-softmax kernel. This is the same algorithm as the CPU backend
// (kernels/cpu/attention.cc), so the two can be compared element by element; a tiled
// flash-attention form that never writes att needs an interface without att (docs/cuda.md).
// The attention GEMMs stay fp32 whatever runtime.precision says: the precision applies to
// matmul_forward / matmul_backward only, as on the CPU backend.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// One block per row r of att viewed as (B*H*T, T); the row's query position is t = r % T.
// Entries 0..t become the softmax of the scores, t+1..T-1 zero (the CPU's
// softmax_causal_row, with the block reductions replacing its serial loops).
__global__ void softmax_causal_k(float* att, int T) {
  const size_t r = blockIdx.x;
  const int t = static_cast<int>(r % T);
  float* row = att + r * T;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  float s = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) {
    float e = math::exp_fast(row[j] - mx);
    row[j] = e;
    s += e;
  }
  s = block_reduce(s, SumOp{}, 0.0f);
  const float inv = 1.0f / s;
  for (int j = threadIdx.x; j < T; j += blockDim.x) row[j] = j <= t ? row[j] * inv : 0.0f;
}

// One block per row: dS = scale * P * (dP - sum_j P_j dP_j) over 0..t, zero past t (the
// CPU's softmax_causal_row_backward). In place on dP.
__global__ void softmax_causal_backward_k(const float* att, float* datt, int T, float scale) {
  const size_t r = blockIdx.x;
  const int t = static_cast<int>(r % T);
  const float* p = att + r * T;
  float* d = datt + r * T;
  float dot = 0.0f;
  for (int j = threadIdx.x; j <= t; j += blockDim.x) dot += p[j] * d[j];
  dot = block_reduce(dot, SumOp{}, 0.0f);
  for (int j = threadIdx.x; j < T; j += blockDim.x)
    d[j] = j <= t ? scale * p[j] * (d[j] - dot) : 0.0f;
}

}  // namespace

void CudaBackend::attention_forward(void* out_v, void* att_v, const void* qkv_v, int B, int T, int C,
                                    int H) {
  float* out = static_cast<float*>(out_v);
  float* att = static_cast<float*>(att_v);
  const float* qkv = static_cast<const float*>(qkv_v);
  if (!B || !T) return;
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const long long TT = static_cast<long long>(T) * T;
  // For batch row b, head h: q at qkv + b*T*3C + h*hd with row stride 3C, k at +C, v at +2C;
  // heads are hd apart, so the H heads of one b form one strided batch.
  for (int b = 0; b < B; ++b) {
    const float* q = qkv + static_cast<size_t>(b) * T * ld;
    float* p = att + static_cast<size_t>(b) * H * TT;
    gemm(false, true, T, T, hd, scale, q, ld, hd, q + C, ld, hd, 0.0f, p, T, TT, H, false);
  }
  FY_LAUNCH(softmax_causal_k, static_cast<unsigned>(static_cast<size_t>(B) * H * T), kRowThreads,
            att, T);
  for (int b = 0; b < B; ++b) {
    const float* v = qkv + static_cast<size_t>(b) * T * ld + 2 * C;
    const float* p = att + static_cast<size_t>(b) * H * TT;
    float* o = out + static_cast<size_t>(b) * T * C;
    gemm(false, false, T, hd, T, 1.0f, p, T, TT, v, ld, hd, 0.0f, o, C, hd, H, false);
  }
}

void CudaBackend::attention_backward(void* dqkv_v, void* datt_v, const void* dout_v, const void* qkv_v,
                                     const void* att_v, int B, int T, int C, int H) {
  float* dqkv = static_cast<float*>(dqkv_v);
  float* datt = static_cast<float*>(datt_v);
  const float* dout = static_cast<const float*>(dout_v);
  const float* qkv = static_cast<const float*>(qkv_v);
  const float* att = static_cast<const float*>(att_v);
  if (!B || !T) return;
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const long long TT = static_cast<long long>(T) * T;
  for (int b = 0; b < B; ++b) {
    const size_t row0 = static_cast<size_t>(b) * T * ld;
    const float* v = qkv + row0 + 2 * C;
    float* dv = dqkv + row0 + 2 * C;
    const float* p = att + static_cast<size_t>(b) * H * TT;
    float* dp = datt + static_cast<size_t>(b) * H * TT;
    const float* dO = dout + static_cast<size_t>(b) * T * C;
    // dP = dO V^T ; dV = P^T dO
    gemm(false, true, T, T, hd, 1.0f, dO, C, hd, v, ld, hd, 0.0f, dp, T, TT, H, false);
    gemm(true, false, T, hd, T, 1.0f, p, T, TT, dO, C, hd, 0.0f, dv, ld, hd, H, false);
  }
  FY_LAUNCH(softmax_causal_backward_k, static_cast<unsigned>(static_cast<size_t>(B) * H * T),
            kRowThreads, att, datt, T, scale);
  for (int b = 0; b < B; ++b) {
    const size_t row0 = static_cast<size_t>(b) * T * ld;
    const float* q = qkv + row0;
    const float* k = q + C;
    float* dq = dqkv + row0;
    float* dk = dq + C;
    const float* ds = datt + static_cast<size_t>(b) * H * TT;
    // dQ = dS K ; dK = dS^T Q
    gemm(false, false, T, hd, T, 1.0f, ds, T, TT, k, ld, hd, 0.0f, dq, ld, hd, H, false);
    gemm(true, false, T, hd, T, 1.0f, ds, T, TT, q, ld, hd, 0.0f, dk, ld, hd, H, false);
  }
}

}  // namespace fuyou::cuda
