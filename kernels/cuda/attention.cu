// Causal self-attention on the CUDA backend. With 16-bit tensors and runtime.attention auto or
// cudnn it runs on cuDNN's fused flash attention (cudnn_attention.cc); otherwise, for a shape
// cuDNN refuses, and for packed records (document-masked: each query attends its own record,
// Backend::attention_forward's pos), in the unfused form below: for each batch row, its heads
// a chunk at a time, strided-batched cuBLAS GEMMs around one causal-softmax launch per chunk,
// in (T, T) fp32 blocks of the backend's scratch (at most 64 MiB of them; one head at a time,
// the (2, T, T) scratch the model's workspace lends, Backend::attention_forward); 16-bit
// tensors are widened per chunk and the results rounded once. The forward keeps each query row's
// log-sum-exp; the backward recomputes the probabilities from it, as the CPU backend
// (kernels/cpu/attention.cc) does block by block, so the two can be compared element by
// element. Nothing of size T x T outlives a call (cuDNN's path needs no T x T scratch at all,
// and far fewer launches). The attention GEMMs stay fp32 whatever
// runtime.precision says: the precision applies to matmul_forward / matmul_backward only,
// as on the CPU backend.
#include <algorithm>
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// The first key row t attends: the start of its record (pos: one batch row's positions within
// their records, Backend::attention_forward; null: the row is one record).
__device__ inline int record_start(const int32_t* pos, int t) { return pos ? t - pos[t] : 0; }

// One block per row t of head blockIdx.y's s(T,T) (the heads' T x T blocks one after the
// other): entries lo..t (lo = the start of t's record) become the softmax of the scores, the
// rest of the row zero, and lse[t] the row's log-sum-exp (the CPU's softmax_causal_row, with
// the block reductions replacing its serial loops). lse holds the heads' rows one after the
// other too.
__global__ void softmax_causal_k(float* s, float* lse, const int32_t* pos, int T) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  float* row = s + (size_t(blockIdx.y) * T + t) * T;
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
  if (threadIdx.x == 0) lse[size_t(blockIdx.y) * T + t] = mx + logf(sum);
}

// One block per row t of head blockIdx.y: the probabilities again from the scores,
// exp(s - lse[t]) over lo..t, zero elsewhere (the CPU's softmax_causal_row_recompute). In
// place.
__global__ void softmax_recompute_k(float* s, const float* lse, const int32_t* pos, int T) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  float* row = s + (size_t(blockIdx.y) * T + t) * T;
  const float l = lse[size_t(blockIdx.y) * T + t];
  for (int j = threadIdx.x; j < T; j += blockDim.x)
    row[j] = j >= lo && j <= t ? math::exp_fast(row[j] - l) : 0.0f;
}

// One block per row t of head blockIdx.y: dS = scale * P * (dP - sum_j P_j dP_j) over lo..t,
// zero elsewhere (the CPU's softmax_causal_row_backward). In place on dP.
__global__ void softmax_causal_backward_k(const float* p, float* dp, const int32_t* pos, int T,
                                          float scale) {
  const int t = blockIdx.x, lo = record_start(pos, t);
  const size_t r = (size_t(blockIdx.y) * T + t) * T;
  const float* pr = p + r;
  float* d = dp + r;
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

// The q, k and v parts of a chunk of heads in one launch: part p (0 q, 1 k, 2 v) of src, at
// p C within each row of `stride` elements, widened into dst + p cap as (rows, cols) dense
// fp32; n = rows cols.
template <typename T>
__global__ void widen_qkv_k(float* dst, size_t cap, const T* src, int C, int cols, int stride,
                            size_t n) {
  FY_GRID_LOOP(i, 3 * n) {
    const size_t p = i / n, j = i % n;
    dst[p * cap + j] = ld(src[p * C + (j / cols) * size_t(stride) + j % cols]);
  }
}

// Their gradients back: src + p cap (rows, cols) dense fp32 rounded into part p of dst.
template <typename T>
__global__ void round_qkv_k(T* dst, const float* src, size_t cap, int C, int cols, int stride,
                            size_t n) {
  FY_GRID_LOOP(i, 3 * n) {
    const size_t p = i / n, j = i % n;
    dst[p * C + (j / cols) * size_t(stride) + j % cols] = st<T>(src[p * cap + j]);
  }
}

// G heads of one batch row at a time, in fp32. Head i of a chunk reads q, k, v (T, hd) at
// q + i hd, k + i hd, v + i hd (row stride ld) and writes its output at o + i hd (row stride
// ldo): one strided-batched GEMM per product for the chunk's heads, one launch per softmax,
// instead of a launch of each per head. s holds the chunk's (T, T) blocks one after the other
// (G of them forward, 2 G backward), l the chunk's log-sum-exps (G T). The GEMMs are cuBLAS's
// batched form of the same products, so results stay within the fp32 bounds the tests hold
// them to against the CPU backend.
struct HeadChunk {
  const float *q, *k, *v;
  int ld;
  int G, T, hd;
  float scale;
  const int32_t* pos;  // the batch row's positions within their records, or null
};

void heads_forward(CudaBackend& be, const HeadChunk& c, float* o, int ldo, float* l, float* s) {
  const long long tt = static_cast<long long>(c.T) * c.T;
  be.gemm(false, true, c.T, c.T, c.hd, c.scale, c.q, c.ld, c.hd, c.k, c.ld, c.hd, 0.0f, s, c.T, tt,
          c.G, false);
  softmax_causal_k<<<dim3(c.T, c.G), kRowThreads, 0, be.compute_stream()>>>(s, l, c.pos, c.T);
  FY_CUDA_LAUNCHED();
  be.gemm(false, false, c.T, c.hd, c.T, 1.0f, s, c.T, tt, c.v, c.ld, c.hd, 0.0f, o, ldo, c.hd, c.G,
          false);
}

// The backward of heads_forward: dq, dk, dv (T, hd) per head at i hd of row stride ldd
// overwritten, from dO (T, hd) per head at i hd of row stride ldo; p and dp G (T, T) blocks
// each.
void heads_backward(CudaBackend& be, const HeadChunk& c, float* dq, float* dk, float* dv, int ldd,
                    const float* dO, int ldo, const float* l, float* p, float* dp) {
  // P from the scores and lse; dV = P^T dO; dP = dO V^T; dS; dQ = dS K; dK = dS^T Q.
  const long long tt = static_cast<long long>(c.T) * c.T;
  const int T = c.T, hd = c.hd, G = c.G;
  be.gemm(false, true, T, T, hd, c.scale, c.q, c.ld, hd, c.k, c.ld, hd, 0.0f, p, T, tt, G, false);
  softmax_recompute_k<<<dim3(T, G), kRowThreads, 0, be.compute_stream()>>>(p, l, c.pos, T);
  FY_CUDA_LAUNCHED();
  be.gemm(true, false, T, hd, T, 1.0f, p, T, tt, dO, ldo, hd, 0.0f, dv, ldd, hd, G, false);
  be.gemm(false, true, T, T, hd, 1.0f, dO, ldo, hd, c.v, c.ld, hd, 0.0f, dp, T, tt, G, false);
  softmax_causal_backward_k<<<dim3(T, G), kRowThreads, 0, be.compute_stream()>>>(p, dp, c.pos, T,
                                                                                 c.scale);
  FY_CUDA_LAUNCHED();
  be.gemm(false, false, T, hd, T, 1.0f, dp, T, tt, c.k, c.ld, hd, 0.0f, dq, ldd, hd, G, false);
  be.gemm(true, false, T, hd, T, 1.0f, dp, T, tt, c.q, c.ld, hd, 0.0f, dk, ldd, hd, G, false);
}

// The backend scratch one batched call may take for its (T, T) blocks and, with 16-bit
// tensors, its fp32 copies of the chunk's q, k, v and the rest (`per_head_rows` (T, hd)
// blocks per head: 4 forward, 7 backward). One head at a time uses the (2, T, T) scratch the
// model lends instead (Backend::attention_forward), so a long sequence costs no memory
// outside the arena beyond one head's copies.
constexpr size_t kAttentionScratch = 64ull << 20;

// Heads per batched call: as many as kAttentionScratch holds, at least one, at most H.
int heads_per_call(int H, int T, int hd, int tt_blocks, int per_head_rows, bool widened) {
  const size_t per_head =
      sizeof(float) * (size_t(tt_blocks) * T * T + (widened ? size_t(per_head_rows) * T * hd : 0));
  return static_cast<int>(std::clamp<size_t>(kAttentionScratch / per_head, 1, H));
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
// The heads of one batch row go G at a time (heads_per_call) through batched GEMMs. fp32
// tensors are used in place; 16-bit ones are widened per chunk of heads into fp32 blocks of
// the backend's scratch and the results rounded back once, so the arithmetic is the fp32
// path's (as the CPU backend's 16-bit attention is its fp32 kernel on widened inputs).
void CudaBackend::attention_forward(void* out_v, float* lse, float* scratch_tt, const void* qkv_v,
                                    int B, int T, int C, int H, const int32_t* pos) {
  if (!B || !T) return;
  bind();
  // cuDNN's graphs here are causal over whole rows: packed records run on the kernels.
  if (use_cudnn()) {
    if (!pos && cudnn_forward(out_v, lse, qkv_v, B, T, C, H)) return;
    if (pos) refused("forward", kPackedRefusal);
  }
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const bool widened = storage_ != ElemType::kF32;
  const int G = heads_per_call(H, T, hd, 1, 4, widened);
  const size_t tt = static_cast<size_t>(T) * T, tg = static_cast<size_t>(T) * G * hd;
  std::lock_guard<std::mutex> lock(scratch_mu());
  // The chunk's G (T, T) blocks (one head: the lent scratch), then q | k | v | o (T, G hd).
  const size_t own_floats = (G > 1 ? G * tt : 0) + (widened ? 4 * tg : 0);
  float* own = own_floats ? static_cast<float*>(scratch(sizeof(float) * own_floats)) : nullptr;
  float* s = G > 1 ? own : scratch_tt;
  float* dense = G > 1 ? own + G * tt : own;
  for (int b = 0; b < B; ++b)
    for (int h0 = 0; h0 < H; h0 += G) {
      const int g = std::min(G, H - h0), w = g * hd;  // the chunk's heads and columns
      const size_t in0 = static_cast<size_t>(b) * T * ld + h0 * hd,
                   out0 = static_cast<size_t>(b) * T * C + h0 * hd;
      float* l = lse + (static_cast<size_t>(b) * H + h0) * T;
      const int32_t* bpos = pos ? pos + static_cast<size_t>(b) * T : nullptr;
      if (!widened) {
        const float* q = static_cast<const float*>(qkv_v) + in0;
        heads_forward(*this, {q, q + C, q + 2 * C, ld, g, T, hd, scale, bpos},
                      static_cast<float*>(out_v) + out0, C, l, s);
        continue;
      }
      float *q = dense, *k = q + tg, *v = k + tg, *o = v + tg;
      const size_t n = static_cast<size_t>(T) * w;
      FY_TYPED(E, {
        FY_LAUNCH(widen_qkv_k<E>, elt_blocks(3 * n), kEltThreads, q, tg,
                  static_cast<const E*>(qkv_v) + in0, C, w, ld, n);
        heads_forward(*this, {q, k, v, w, g, T, hd, scale, bpos}, o, w, l, s);
        FY_LAUNCH(round_block_k<E>, elt_blocks(n), kEltThreads, static_cast<E*>(out_v) + out0, o, w,
                  C, n);
      });
    }
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
  const int hd = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const bool widened = storage_ != ElemType::kF32;
  const int G = heads_per_call(H, T, hd, 2, 7, widened);
  const size_t tt = static_cast<size_t>(T) * T, tg = static_cast<size_t>(T) * G * hd;
  std::lock_guard<std::mutex> lock(scratch_mu());
  // The probabilities' and their gradient's G (T, T) blocks each (one head: the lent (2, T, T)
  // scratch), then q | k | v | dO | dq | dk | dv (T, G hd).
  const size_t own_floats = (G > 1 ? 2 * G * tt : 0) + (widened ? 7 * tg : 0);
  float* own = own_floats ? static_cast<float*>(scratch(sizeof(float) * own_floats)) : nullptr;
  float* p = G > 1 ? own : scratch_tt;
  float* dp = p + G * tt;
  float* dense = G > 1 ? own + 2 * G * tt : own;
  for (int b = 0; b < B; ++b)
    for (int h0 = 0; h0 < H; h0 += G) {
      const int g = std::min(G, H - h0), w = g * hd;
      const size_t in0 = static_cast<size_t>(b) * T * ld + h0 * hd,
                   out0 = static_cast<size_t>(b) * T * C + h0 * hd;
      const float* l = lse + (static_cast<size_t>(b) * H + h0) * T;
      const int32_t* bpos = pos ? pos + static_cast<size_t>(b) * T : nullptr;
      if (!widened) {
        const float* q = static_cast<const float*>(qkv_v) + in0;
        float* dq = static_cast<float*>(dqkv_v) + in0;
        heads_backward(*this, {q, q + C, q + 2 * C, ld, g, T, hd, scale, bpos}, dq, dq + C,
                       dq + 2 * C, ld, static_cast<const float*>(dout_v) + out0, C, l, p, dp);
        continue;
      }
      float *q = dense, *k = q + tg, *v = k + tg, *dO = v + tg, *dq = dO + tg;
      const size_t n = static_cast<size_t>(T) * w;
      FY_TYPED(E, {
        FY_LAUNCH(widen_qkv_k<E>, elt_blocks(3 * n), kEltThreads, q, tg,
                  static_cast<const E*>(qkv_v) + in0, C, w, ld, n);
        FY_LAUNCH(widen_block_k<E>, elt_blocks(n), kEltThreads, dO,
                  static_cast<const E*>(dout_v) + out0, w, C, n);
        heads_backward(*this, {q, k, v, w, g, T, hd, scale, bpos}, dq, dq + tg, dq + 2 * tg, w, dO,
                       w, l, p, dp);
        FY_LAUNCH(round_qkv_k<E>, elt_blocks(3 * n), kEltThreads, static_cast<E*>(dqkv_v) + in0, dq,
                  tg, C, w, ld, n);
      });
    }
}

}  // namespace fuyou::cuda
