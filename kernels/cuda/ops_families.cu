// The opt and llama families' kernels on the CUDA backend: RMSNorm, rotary embeddings, the
// repeated-head form of grouped-query attention, SwiGLU and ReLU. Semantics and the order of
// operations follow kernels/cpu/ops_families.cc; per-element math is element_math.h. Templates
// on the storage type, as in ops.cu.
#include <cmath>
#include <type_traits>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// ---- index width and vector width ----------------------------------------------------------
// The element-wise kernels below index with I: 32-bit where the work items fit in 31 bits
// (a division by a runtime divisor costs a fraction of a 64-bit one; a grid stride of at most
// 4096 x 256 cannot wrap past 2^32 from below 2^31), size_t beyond. They load and store K
// elements at a time: a 16-byte vector (Vec16<T>::kN) where the rows' widths and the pointers
// allow it, else K = 1; the arithmetic per element is the same, so the bits are too.
constexpr size_t kMaxIndex32 = (size_t(1) << 31) - 1;

template <typename T, int K>
struct alignas(K * sizeof(T)) VecK {
  T v[K];
};

template <typename I>
__device__ __forceinline__ I grid_first() {
  return static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
}
template <typename I>
__device__ __forceinline__ I grid_stride() {
  return static_cast<I>(gridDim.x) * blockDim.x;
}

// Calls launch(I{}, std::integral_constant<int, K>{}) with the index type for `units` work
// items (each K elements) and K = the 16-byte vector's width when `vec`, else 1.
template <typename T, typename Launch>
void with_index_and_width(size_t units, bool vec, Launch&& launch) {
  constexpr int V = Vec16<T>::kN;
  if (units <= kMaxIndex32) {
    if (vec)
      launch(uint32_t{}, std::integral_constant<int, V>{});
    else
      launch(uint32_t{}, std::integral_constant<int, 1>{});
  } else {
    if (vec)
      launch(size_t{}, std::integral_constant<int, V>{});
    else
      launch(size_t{}, std::integral_constant<int, 1>{});
  }
}

// One row's columns in groups of G = Vec16<T>::kN: thread t takes the groups t, t + blockDim.x,
// ..., and within a group the columns in order, loaded as one 16-byte vector when `vec` (the
// row aligned and C a multiple of G), else one by one (the tail group cut at C). The order each
// thread visits its columns in is the same on both paths, so its partial sums, the block's
// reduction and every bit of the result do not depend on which path ran.
template <typename T, typename Fn>
__device__ __forceinline__ void for_row_groups(const T* x, int C, bool vec, Fn&& fn) {
  constexpr int G = Vec16<T>::kN;
  const int groups = (C + G - 1) / G;
  for (int j = threadIdx.x; j < groups; j += blockDim.x) {
    const int c0 = j * G;
    if (vec) {
      const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(x)[j];
#pragma unroll
      for (int k = 0; k < G; ++k) fn(c0 + k, ld(v.v[k]));
    } else {
      for (int k = 0; k < G && c0 + k < C; ++k) fn(c0 + k, ld(x[c0 + k]));
    }
  }
}

// One block per row: sum of squares in math::StatAcc, as on the CPU, over the row's column
// groups (for_row_groups); then each thread writes the columns it read.
template <typename T>
__device__ void rmsnorm_row(T* out, float* rstd, const T* in, const T* w, float eps, int C,
                            bool vec) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  math::StatAcc ss = 0;
  for_row_groups(x, C, vec, [&](int, float xc) { ss += static_cast<math::StatAcc>(xc) * xc; });
  ss = block_reduce(ss, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(ss / C + eps));
  T* o = out + n * C;
  for_row_groups(x, C, vec,
                 [&](int c, float xc) { o[c] = st<T>(math::rmsnorm_apply(xc, r, ld(w[c]))); });
  if (threadIdx.x == 0) rstd[n] = r;
}

template <typename T>
__global__ void rmsnorm_forward_k(T* out, float* rstd, const T* in, const T* w, float eps, int C,
                                  bool vec) {
  rmsnorm_row(out, rstd, in, w, eps, C, vec);
}

// The residual add, then the row's RMSNorm of the stored sum; as residual_layernorm_forward_k
// (ops.cu), each thread reads back only the columns it stored.
template <typename T>
__global__ void residual_rmsnorm_forward_k(T* res, T* out, float* rstd, const T* a, const T* b,
                                           const T* w, float eps, int C, bool vec) {
  const size_t row = size_t(blockIdx.x) * C;
  // The sum's columns in the groups rmsnorm_row reads them in, so each thread reads back only
  // what it stored.
  T* r = res + row;
  const T* bt = b + row;
  for_row_groups(a + row, C, vec, [&](int c, float ac) { r[c] = st<T>(ac + ld(bt[c])); });
  rmsnorm_row(out, rstd, res, w, eps, C, vec);
}

// One block per row: din += rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd.
template <typename T>
__global__ void rmsnorm_backward_dx_k(T* din, const T* dout, const T* in, const T* w,
                                      const float* rstd, int C, bool vec) {
  const size_t n = blockIdx.x;
  const T* x = in + n * C;
  const T* dy = dout + n * C;
  const float r = rstd[n];
  math::StatAcc gx = 0;
  for_row_groups(dy, C, vec, [&](int c, float d) {
    gx += static_cast<math::StatAcc>(d * ld(w[c])) * (ld(x[c]) * r);
  });
  gx = block_reduce(gx, SumOp{}, math::StatAcc(0));
  const float gxm = static_cast<float>(gx / C);
  T* dx = din + n * C;
  for_row_groups(dy, C, vec, [&](int c, float d) {
    const float xhat = ld(x[c]) * r;
    dx[c] = st<T>(ld(dx[c]) + (d * ld(w[c]) - xhat * gxm) * r);
  });
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

// The q/k norm (QkNormSpans: Qwen3's heads, OLMo 2's projections): one block per (row n,
// span j), blockIdx.x = n s.spans() + j; the span starts at n s.row() + s.offset(j) in qkvc
// and at n s.saved_row() + s.offset(j) in saved. In place: each thread writes only the
// columns it read.
constexpr int kHeadThreads = 64;

struct QkSpan {
  size_t at, saved_at;  // the span's first value in qkvc and in saved
  int width;
  bool q;
};

__device__ inline QkSpan qk_span(unsigned b, QkNormSpans s) {
  const unsigned spans = s.q_spans + s.k_spans, n = b / spans, j = b % spans;
  const bool q = j < unsigned(s.q_spans);
  const size_t q_values = size_t(s.q_spans) * s.q_width, k_values = size_t(s.k_spans) * s.k_width;
  const size_t off = q ? size_t(j) * s.q_width : q_values + size_t(j - s.q_spans) * s.k_width;
  return {size_t(n) * (q_values + 2 * k_values) + off, size_t(n) * (q_values + k_values) + off,
          q ? s.q_width : s.k_width, q};
}

template <typename T>
__global__ void qk_norm_forward_k(T* qkvc, T* saved, float* rstd, const T* qw, const T* kw,
                                  float eps, QkNormSpans s) {
  const unsigned j = blockIdx.x;
  const QkSpan sp = qk_span(j, s);
  T* x = qkvc + sp.at;
  const T* w = sp.q ? qw : kw;
  const int W = sp.width;
  math::StatAcc ss = 0;
  for (int c = threadIdx.x; c < W; c += blockDim.x) {
    const float xc = ld(x[c]);
    ss += static_cast<math::StatAcc>(xc) * xc;
    if (saved) saved[sp.saved_at + c] = x[c];
  }
  ss = block_reduce(ss, SumOp{}, math::StatAcc(0));
  const float r = static_cast<float>(1.0 / sqrt(ss / W + eps));
  for (int c = threadIdx.x; c < W; c += blockDim.x)
    x[c] = st<T>(math::rmsnorm_apply(ld(x[c]), r, ld(w[c])));
  if (threadIdx.x == 0) rstd[j] = r;
}

// The input gradient of each span, overwriting the output gradient (rmsnorm_backward_dx_k's
// formula); launched after qk_norm_dweight_k has read the output gradient.
template <typename T>
__global__ void qk_norm_backward_dx_k(T* dqkvc, const T* saved, const T* qw, const T* kw,
                                      const float* rstd, QkNormSpans s) {
  const unsigned j = blockIdx.x;
  const QkSpan sp = qk_span(j, s);
  T* d = dqkvc + sp.at;
  const T* x = saved + sp.saved_at;
  const T* w = sp.q ? qw : kw;
  const int W = sp.width;
  const float r = rstd[j];
  math::StatAcc gx = 0;
  for (int c = threadIdx.x; c < W; c += blockDim.x)
    gx += static_cast<math::StatAcc>(ld(d[c]) * ld(w[c])) * (ld(x[c]) * r);
  gx = block_reduce(gx, SumOp{}, math::StatAcc(0));
  const float gxm = static_cast<float>(gx / W);
  for (int c = threadIdx.x; c < W; c += blockDim.x) {
    const float xhat = ld(x[c]) * r;
    d[c] = st<T>((ld(d[c]) * ld(w[c]) - xhat * gxm) * r);
  }
}

// part(by, c) for the q spans (which 0) or the k spans (1): the sum of dy x rstd over that
// kind's spans i = by, by + gridDim.y, ... of every row; column_slices_add adds the slices.
template <typename T>
__global__ void qk_norm_dweight_k(float* part, const T* dqkvc, const T* saved, const float* rstd,
                                  int N, QkNormSpans s, int which) {
  const int W = which ? s.k_width : s.q_width;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= W) return;
  const int per_row = which ? s.k_spans : s.q_spans, first = which ? s.q_spans : 0;
  const unsigned count = unsigned(N) * per_row, spans = s.q_spans + s.k_spans;
  float sum = 0.0f;
  for (unsigned i = blockIdx.y; i < count; i += gridDim.y) {
    const unsigned j = (i / per_row) * spans + first + i % per_row;
    const QkSpan sp = qk_span(j, s);
    sum += ld(dqkvc[sp.at + c]) * (ld(saved[sp.saved_at + c]) * rstd[j]);
  }
  part[size_t(blockIdx.y) * W + c] = sum;
}

// One thread per (row n, head h of the Hq + Hkv rotated heads, K pairs i..i+K-1 of the D/2);
// row n at position pos[n] (packed records), or n % T_ when pos is null. K > 1 loads and
// stores the K first and K second halves of the pairs as two vectors (D/2 a multiple of K).
// The table travels by value in the kernel's parameters (about 1 KiB, under CUDA's 4 KiB).
template <typename T, typename I, int K>
__global__ void rope_k(T* qkvc, int T_, int Hq, int Hkv, int D, const RopeTable rope, float sign,
                       const int32_t* pos, I total) {
  using V = VecK<T, K>;
  const I groups = static_cast<I>(D / 2 / K), heads = static_cast<I>(Hq + Hkv);
  const size_t row = static_cast<size_t>(Hq + 2 * Hkv) * D;
  for (I idx = grid_first<I>(); idx < total; idx += grid_stride<I>()) {
    const I rest = idx / groups, g = idx - rest * groups;
    const I n = rest / heads, h = rest - n * heads;
    const int p = pos ? pos[n] : static_cast<int>(n % static_cast<I>(T_));
    T* x = qkvc + static_cast<size_t>(n) * row + static_cast<size_t>(h) * D +
           static_cast<size_t>(g) * K;
    V a = *reinterpret_cast<const V*>(x), b = *reinterpret_cast<const V*>(x + D / 2);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float ang = math::rope_angle(p, rope.inv_freq[g * K + k]);
      float x0 = ld(a.v[k]), x1 = ld(b.v[k]);
      math::rope_rotate(x0, x1, cosf(ang) * rope.scale, sign * (sinf(ang) * rope.scale));
      a.v[k] = st<T>(x0);
      b.v[k] = st<T>(x1);
    }
    *reinterpret_cast<V*>(x) = a;
    *reinterpret_cast<V*>(x + D / 2) = b;
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

// gu (N, 2F): gate in columns [0, F), up in [F, 2F); out (N, F). K elements per work item
// (F a multiple of K when K > 1).
template <typename T, typename I, int K>
__global__ void swiglu_forward_k(T* out, const T* gu, I Fk, I total) {
  using V = VecK<T, K>;
  const V* g = reinterpret_cast<const V*>(gu);
  for (I idx = grid_first<I>(); idx < total; idx += grid_stride<I>()) {
    const I n = idx / Fk, f = idx - n * Fk;
    const V gate = g[static_cast<size_t>(n) * 2 * Fk + f],
            up = g[static_cast<size_t>(n) * 2 * Fk + Fk + f];
    V o;
#pragma unroll
    for (int k = 0; k < K; ++k) o.v[k] = st<T>(math::silu(ld(gate.v[k])) * ld(up.v[k]));
    reinterpret_cast<V*>(out)[idx] = o;
  }
}

template <typename T, typename I, int K>
__global__ void swiglu_backward_k(T* dgu, const T* gu, const T* dout, I Fk, I total) {
  using V = VecK<T, K>;
  const V* g = reinterpret_cast<const V*>(gu);
  V* dg = reinterpret_cast<V*>(dgu);
  for (I idx = grid_first<I>(); idx < total; idx += grid_stride<I>()) {
    const I n = idx / Fk, f = idx - n * Fk;
    const size_t at = static_cast<size_t>(n) * 2 * Fk + f;
    const V gate = g[at], up = g[at + Fk], dy = reinterpret_cast<const V*>(dout)[idx];
    V dgate, dup;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float d = ld(dy.v[k]), gt = ld(gate.v[k]);
      dgate.v[k] = st<T>(d * ld(up.v[k]) * math::silu_grad(gt));
      dup.v[k] = st<T>(d * math::silu(gt));
    }
    dg[at] = dgate;
    dg[at + Fk] = dup;
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
  FY_TYPED(E, {
    const bool vec = C % Vec16<E>::kN == 0 && all_aligned16(out, in);
    FY_LAUNCH(rmsnorm_forward_k<E>, N, kRowThreads, static_cast<E*>(out), rstd,
              static_cast<const E*>(in), static_cast<const E*>(w), eps, C, vec);
  });
}

void CudaBackend::residual_rmsnorm_forward(void* res, void* out, float* rstd, const void* a,
                                           const void* b, const void* w, float eps, int N, int C) {
  if (!N) return;
  FY_TYPED(E, {
    const bool vec = C % Vec16<E>::kN == 0 && all_aligned16(res, out, a);
    FY_LAUNCH(residual_rmsnorm_forward_k<E>, N, kRowThreads, static_cast<E*>(res),
              static_cast<E*>(out), rstd, static_cast<const E*>(a), static_cast<const E*>(b),
              static_cast<const E*>(w), eps, C, vec);
  });
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
    const bool vec = C % Vec16<E>::kN == 0 && all_aligned16(dout);
    FY_LAUNCH(rmsnorm_backward_dx_k<E>, N, kRowThreads, static_cast<E*>(din), dy, x,
              static_cast<const E*>(w), rstd, C, vec);
    FY_LAUNCH(rmsnorm_dweight_k<E>, dim3(cols, slices), kEltThreads, part, dy, x, rstd, N, C);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(C), slices_add_block(), static_cast<E*>(dw),
              part, slices, C);
  });
}

void CudaBackend::qk_norm_forward(void* qkvc, void* saved, float* rstd, const void* qw,
                                  const void* kw, float eps, int N, const QkNormSpans& s) {
  if (!N) return;
  FY_TYPED(E, FY_LAUNCH(qk_norm_forward_k<E>, N * s.spans(), kHeadThreads, static_cast<E*>(qkvc),
                        static_cast<E*>(saved), rstd, static_cast<const E*>(qw),
                        static_cast<const E*>(kw), eps, s));
}

void CudaBackend::qk_norm_backward(void* dqkvc, void* dqw, void* dkw, const void* saved,
                                   const void* qw, const void* kw, const float* rstd, int N,
                                   const QkNormSpans& s) {
  if (!N) return;
  const int slices = reduce_slices(N);
  const int width[2] = {s.q_width, s.k_width};
  std::lock_guard<std::mutex> lock(scratch_mu());
  float* part = static_cast<float*>(
      scratch(sizeof(float) * slices * (size_t(s.q_width) + size_t(s.k_width))));
  float* parts[2] = {part, part + size_t(slices) * s.q_width};
  FY_TYPED(E, {
    const E* x = static_cast<const E*>(saved);
    E* d = static_cast<E*>(dqkvc);
    for (int which = 0; which < 2; ++which) {
      const unsigned cols = (width[which] + kEltThreads - 1) / kEltThreads;
      FY_LAUNCH(qk_norm_dweight_k<E>, dim3(cols, slices), kEltThreads, parts[which], d, x, rstd, N,
                s, which);
    }
    FY_LAUNCH(qk_norm_backward_dx_k<E>, N * s.spans(), kHeadThreads, d, x,
              static_cast<const E*>(qw), static_cast<const E*>(kw), rstd, s);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(s.q_width), slices_add_block(),
              static_cast<E*>(dqw), parts[0], slices, s.q_width);
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(s.k_width), slices_add_block(),
              static_cast<E*>(dkw), parts[1], slices, s.k_width);
  });
}

// rope_forward and rope_backward: the rotation by +angle and by -angle (its transpose).
template <typename E>
void CudaBackend::rope_launch(void* qkvc, int B, int T, int Hq, int Hkv, int D,
                              const RopeTable& rope, const int32_t* pos, float sign) {
  const size_t pairs = static_cast<size_t>(B) * T * (Hq + Hkv) * (D / 2);
  const bool vec = (D / 2) % Vec16<E>::kN == 0 && all_aligned16(qkvc);
  const size_t units = vec ? pairs / Vec16<E>::kN : pairs;
  with_index_and_width<E>(units, vec, [&](auto i, auto k) {
    using I = decltype(i);
    FY_LAUNCH((rope_k<E, I, decltype(k)::value>), elt_blocks(units), kEltThreads,
              static_cast<E*>(qkvc), T, Hq, Hkv, D, rope, sign, pos, static_cast<I>(units));
  });
}

void CudaBackend::rope_forward(void* qkvc, int B, int T, int Hq, int Hkv, int D,
                               const RopeTable& rope, const int32_t* pos) {
  if (size_t(B) * T * (Hq + Hkv) * (D / 2) == 0) return;
  FY_TYPED(E, rope_launch<E>(qkvc, B, T, Hq, Hkv, D, rope, pos, 1.0f));
}

void CudaBackend::rope_backward(void* dqkvc, int B, int T, int Hq, int Hkv, int D,
                                const RopeTable& rope, const int32_t* pos) {
  if (size_t(B) * T * (Hq + Hkv) * (D / 2) == 0) return;
  FY_TYPED(E, rope_launch<E>(dqkvc, B, T, Hq, Hkv, D, rope, pos, -1.0f));
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
  const size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_TYPED(E, {
    const bool vec = F % Vec16<E>::kN == 0 && all_aligned16(out, gu);
    const size_t units = vec ? total / Vec16<E>::kN : total;
    with_index_and_width<E>(units, vec, [&](auto i, auto k) {
      using I = decltype(i);
      constexpr int K = decltype(k)::value;
      FY_LAUNCH((swiglu_forward_k<E, I, K>), elt_blocks(units), kEltThreads, static_cast<E*>(out),
                static_cast<const E*>(gu), static_cast<I>(F / K), static_cast<I>(units));
    });
  });
}

void CudaBackend::swiglu_backward(void* dgu, const void* gu, const void* dout, int N, int F) {
  const size_t total = static_cast<size_t>(N) * F;
  if (!total) return;
  FY_TYPED(E, {
    const bool vec = F % Vec16<E>::kN == 0 && all_aligned16(dgu, gu, dout);
    const size_t units = vec ? total / Vec16<E>::kN : total;
    with_index_and_width<E>(units, vec, [&](auto i, auto k) {
      using I = decltype(i);
      constexpr int K = decltype(k)::value;
      FY_LAUNCH((swiglu_backward_k<E, I, K>), elt_blocks(units), kEltThreads, static_cast<E*>(dgu),
                static_cast<const E*>(gu), static_cast<const E*>(dout), static_cast<I>(F / K),
                static_cast<I>(units));
    });
  });
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
