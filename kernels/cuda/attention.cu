// Causal self-attention on the CUDA backend. With 16-bit tensors and runtime.attention auto or
// cudnn it runs on cuDNN's fused flash attention (cudnn_attention.cc); otherwise, for a shape
// cuDNN refuses, and for packed records (document-masked: each query attends its own record,
// Backend::attention_forward's pos), in the unfused form below: for one (batch row, head)
// at a time, cuBLAS GEMMs around causal-softmax kernels in the (2, T, T) fp32 scratch the
// model's workspace lends (Backend::attention_forward); 16-bit tensors are widened per (batch
// row, head) and the results rounded once. The forward keeps each query row's
// log-sum-exp; the backward recomputes the probabilities from it, as the CPU backend
// (kernels/cpu/attention.cc) does block by block, so the two can be compared element by
// element. Nothing of size T x T outlives a call (cuDNN's path needs no T x T scratch at all,
// and far fewer launches). The attention GEMMs stay fp32 whatever
// runtime.precision says: the precision applies to matmul_forward / matmul_backward only,
// as on the CPU backend.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// The first key row t attends: the start of its record (pos: one batch row's positions within
// their records, Backend::attention_forward; null: the row is one record).
__device__ inline int record_start(const int32_t* pos, int t) { return pos ? t - pos[t] : 0; }

// One block per row t of s(T,T): entries lo..t (lo = the start of t's record) become the
// softmax of the scores, the rest of the row zero, and lse[t] the row's log-sum-exp (the
// CPU's softmax_causal_row, with the block reductions replacing its serial loops).
__global__ void softmax_causal_k(float* s, float* lse, const int32_t* pos, int T) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  float* row = s + static_cast<size_t>(t) * T;
  float mx = -INFINITY;
  for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, MaxOp{}, -INFINITY);
  float sum = 0.0f;
  for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) {
    float e = math::exp_fast(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, SumOp{}, 0.0f);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < T; j += blockDim.x)
    row[j] = j >= lo && j <= t ? row[j] * inv : 0.0f;
  if (threadIdx.x == 0) lse[t] = mx + logf(sum);
}

// One block per row t: the probabilities again from the scores, exp(s - lse[t]) over lo..t,
// zero elsewhere (the CPU's softmax_causal_row_recompute). In place.
__global__ void softmax_recompute_k(float* s, const float* lse, const int32_t* pos, int T) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  float* row = s + static_cast<size_t>(t) * T;
  const float l = lse[t];
  for (int j = threadIdx.x; j < T; j += blockDim.x)
    row[j] = j >= lo && j <= t ? math::exp_fast(row[j] - l) : 0.0f;
}

// One block per row: dS = scale * P * (dP - sum_j P_j dP_j) over lo..t, zero elsewhere (the
// CPU's softmax_causal_row_backward). In place on dP.
__global__ void softmax_causal_backward_k(const float* p, float* dp, const int32_t* pos, int T,
                                          float scale) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  const float* pr = p + static_cast<size_t>(t) * T;
  float* d = dp + static_cast<size_t>(t) * T;
  float dot = 0.0f;
  for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) dot += pr[j] * d[j];
  dot = block_reduce(dot, SumOp{}, 0.0f);
  for (int j = threadIdx.x; j < T; j += blockDim.x)
    d[j] = j >= lo && j <= t ? scale * pr[j] * (d[j] - dot) : 0.0f;
}

// dst(rows, cols) dense fp32 = src(rows, cols) of row stride ld, widened.
template <typename T>
__global__ void widen_block_k(float* dst, const T* src, int cols, int stride, size_t total) {
  FY_GRID_LOOP(i, total) dst[i] = ld(src[(i / cols) * size_t(stride) + i % cols]);
}

// dst(rows, cols) of row stride ld = src(rows, cols) dense fp32, rounded once.
template <typename T>
__global__ void round_block_k(T* dst, const float* src, int cols, int stride, size_t total) {
  FY_GRID_LOOP(i, total) dst[(i / cols) * size_t(stride) + i % cols] = st<T>(src[i]);
}

// One (batch row, head) forward in fp32: q, k, v (T, hd) of row stride ld, out o (T, hd) of
// row stride ldo, the row log-sum-exps l(T), s a (T, T) scratch, pos the row's positions
// within their records (null: one record).
void head_forward(CudaBackend& be, float* o, int ldo, float* l, float* s, const float* q,
                  const float* k, const float* v, int ld, int T, int hd, float scale,
                  const int32_t* pos) {
  be.gemm(false, true, T, T, hd, scale, q, ld, 0, k, ld, 0, 0.0f, s, T, 0, 1, false);
  softmax_causal_k<<<static_cast<unsigned>(T), kRowThreads, 0, be.compute_stream()>>>(s, l, pos, T);
  FY_CUDA_LAUNCHED();
  be.gemm(false, false, T, hd, T, 1.0f, s, T, 0, v, ld, 0, 0.0f, o, ldo, 0, 1, false);
}

// The backward of head_forward: dq, dk, dv (T, hd) of row stride ldd overwritten, from dO
// (T, hd) of row stride ldo; p and dp (T, T) scratch.
void head_backward(CudaBackend& be, float* dq, float* dk, float* dv, int ldd, float* p, float* dp,
                   const float* dO, int ldo, const float* q, const float* k, const float* v, int ld,
                   const float* l, int T, int hd, float scale, const int32_t* pos) {
  // P from the scores and lse; dV = P^T dO; dP = dO V^T; dS; dQ = dS K; dK = dS^T Q.
  be.gemm(false, true, T, T, hd, scale, q, ld, 0, k, ld, 0, 0.0f, p, T, 0, 1, false);
  softmax_recompute_k<<<static_cast<unsigned>(T), kRowThreads, 0, be.compute_stream()>>>(p, l, pos,
                                                                                         T);
  FY_CUDA_LAUNCHED();
  be.gemm(true, false, T, hd, T, 1.0f, p, T, 0, dO, ldo, 0, 0.0f, dv, ldd, 0, 1, false);
  be.gemm(false, true, T, T, hd, 1.0f, dO, ldo, 0, v, ld, 0, 0.0f, dp, T, 0, 1, false);
  softmax_causal_backward_k<<<static_cast<unsigned>(T), kRowThreads, 0, be.compute_stream()>>>(
      p, dp, pos, T, scale);
  FY_CUDA_LAUNCHED();
  be.gemm(false, false, T, hd, T, 1.0f, dp, T, 0, k, ld, 0, 0.0f, dq, ldd, 0, 1, false);
  be.gemm(true, false, T, hd, T, 1.0f, dp, T, 0, q, ld, 0, 0.0f, dk, ldd, 0, 1, false);
}

// Why a packed batch does not go to cuDNN (logged once, as its own refusals are).
constexpr const char* kPackedRefusal =
    "packed records: its graphs here mask whole rows causally, not each record (document masking)";

}  // namespace

// cuDNN's fused attention (cudnn_attention.cc), false when it refuses the shape (logged once).
bool CudaBackend::cudnn_forward(void* out, float* lse, const void* qkv, int B, int T, int C,
                                int H) {
  std::string why;
  if (cudnn_->forward(storage_, out, lse, qkv, B, T, C, H, &why)) return true;
  refused("forward", why);
  return false;
}

bool CudaBackend::cudnn_backward(void* dqkv, const void* dout, const void* out, const void* qkv,
                                 const float* lse, int B, int T, int C, int H) {
  std::string why;
  if (cudnn_->backward(storage_, dqkv, dout, out, qkv, lse, B, T, C, H, &why)) return true;
  refused("backward", why);
  return false;
}

// For batch row b, head h: q at qkv + b*T*3C + h*hd with row stride 3C, k at +C, v at +2C.
// fp32 tensors are used in place; 16-bit ones are widened per (batch row, head) into fp32
// blocks of the backend's scratch and the results rounded back once, so the arithmetic is
// the fp32 path's (as the CPU backend's 16-bit attention is its fp32 kernel on widened
// inputs).
void CudaBackend::attention_forward(void* out_v, float* lse, float* scratch_tt, const void* qkv_v,
                                    int B, int T, int C, int H, const int32_t* pos) {
  if (!B || !T) return;
  bind();
  // cuDNN's graphs here are causal over whole rows: packed records run on the kernels.
  if (use_cudnn()) {
    if (!pos && cudnn_forward(out_v, lse, qkv_v, B, T, C, H)) return;
    if (pos) refused("forward", kPackedRefusal);
  }
  auto row_pos = [&](int b) { return pos ? pos + static_cast<size_t>(b) * T : nullptr; };
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (storage_ == ElemType::kF32) {
    float* out = static_cast<float*>(out_v);
    const float* qkv = static_cast<const float*>(qkv_v);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const float* q = qkv + static_cast<size_t>(b) * T * ld + h * hd;
        head_forward(*this, out + static_cast<size_t>(b) * T * C + h * hd, C,
                     lse + (static_cast<size_t>(b) * H + h) * T, scratch_tt, q, q + C, q + 2 * C,
                     ld, T, hd, scale, row_pos(b));
      }
    return;
  }
  const size_t th = static_cast<size_t>(T) * hd;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* q = static_cast<float*>(scratch(4 * th * sizeof(float)));  // q | k | v | o, dense
  float *k = q + th, *v = k + th, *o = v + th;
  FY_TYPED(E, {
    const E* qkv = static_cast<const E*>(qkv_v);
    E* out = static_cast<E*>(out_v);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const E* src = qkv + static_cast<size_t>(b) * T * ld + h * hd;
        for (int part = 0; part < 3; ++part)
          FY_LAUNCH(widen_block_k<E>, elt_blocks(th), kEltThreads, q + part * th, src + part * C,
                    hd, ld, th);
        head_forward(*this, o, hd, lse + (static_cast<size_t>(b) * H + h) * T, scratch_tt, q, k, v,
                     hd, T, hd, scale, row_pos(b));
        FY_LAUNCH(round_block_k<E>, elt_blocks(th), kEltThreads,
                  out + static_cast<size_t>(b) * T * C + h * hd, o, hd, C, th);
      }
  });
}

void CudaBackend::attention_backward(void* dqkv_v, float* scratch_tt, const void* dout_v,
                                     const void* out_v, const void* qkv_v, const float* lse, int B,
                                     int T, int C, int H, const int32_t* pos) {
  if (!B || !T) return;
  bind();
  // Without the forward's output (a caller that kept none) the kernels run the backward; packed
  // records too, as in the forward.
  if (out_v && use_cudnn()) {
    if (!pos && cudnn_backward(dqkv_v, dout_v, out_v, qkv_v, lse, B, T, C, H)) return;
    if (pos) refused("backward", kPackedRefusal);
  }
  auto row_pos = [&](int b) { return pos ? pos + static_cast<size_t>(b) * T : nullptr; };
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* p = scratch_tt;                                // (T, T) probabilities
  float* dp = scratch_tt + static_cast<size_t>(T) * T;  // (T, T) their gradient
  if (storage_ == ElemType::kF32) {
    float* dqkv = static_cast<float*>(dqkv_v);
    const float* dout = static_cast<const float*>(dout_v);
    const float* qkv = static_cast<const float*>(qkv_v);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
        const float* q = qkv + row0;
        float* dq = dqkv + row0;
        head_backward(*this, dq, dq + C, dq + 2 * C, ld, p, dp,
                      dout + static_cast<size_t>(b) * T * C + h * hd, C, q, q + C, q + 2 * C, ld,
                      lse + (static_cast<size_t>(b) * H + h) * T, T, hd, scale, row_pos(b));
      }
    return;
  }
  const size_t th = static_cast<size_t>(T) * hd;
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* q = static_cast<float*>(scratch(7 * th * sizeof(float)));  // q | k | v | dO | dq | dk | dv
  float *k = q + th, *v = k + th, *dO = v + th, *dq = dO + th;
  FY_TYPED(E, {
    const E* qkv = static_cast<const E*>(qkv_v);
    const E* dout = static_cast<const E*>(dout_v);
    E* dqkv = static_cast<E*>(dqkv_v);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        const size_t row0 = static_cast<size_t>(b) * T * ld + h * hd;
        for (int part = 0; part < 3; ++part)
          FY_LAUNCH(widen_block_k<E>, elt_blocks(th), kEltThreads, q + part * th,
                    qkv + row0 + part * C, hd, ld, th);
        FY_LAUNCH(widen_block_k<E>, elt_blocks(th), kEltThreads, dO,
                  dout + static_cast<size_t>(b) * T * C + h * hd, hd, C, th);
        head_backward(*this, dq, dq + th, dq + 2 * th, hd, p, dp, dO, hd, q, k, v, hd,
                      lse + (static_cast<size_t>(b) * H + h) * T, T, hd, scale, row_pos(b));
        for (int part = 0; part < 3; ++part)
          FY_LAUNCH(round_block_k<E>, elt_blocks(th), kEltThreads, dqkv + row0 + part * C,
                    dq + part * th, hd, ld, th);
      }
  });
}

}  // namespace fuyou::cuda
