// The CUDA backend's decoding kernels (Backend::rope_forward_at, attention_decode): a few new
// rows of one sequence against its key/value cache. Semantics follow kernels/cpu/decode.cc;
// per-element math is element_math.h. Templates on the storage type, as in ops.cu.
#include <cmath>

#include "kernels/common/element_math.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {
namespace {

// Head sizes up to this many values: each lane of a warp keeps D / 32 of a head's sums.
constexpr int kMaxHeadSize = 256;
constexpr int kDecodeThreads = 128;  // 4 warps per (row, head)

// One thread per (row n, rotated head h, pair i < D/2); row n is at position pos0 + n.
template <typename T>
__global__ void rope_at_k(T* qkvc, int pos0, int Hq, int Hkv, int D, const RopeTable rope,
                          size_t total) {
  const int half = D / 2, heads = Hq + Hkv;
  const size_t row = static_cast<size_t>(Hq + 2 * Hkv) * D;
  FY_GRID_LOOP(idx, total) {
    const int i = static_cast<int>(idx % half);
    const int h = static_cast<int>((idx / half) % heads);
    const size_t n = idx / (static_cast<size_t>(half) * heads);
    const float a = math::rope_angle(pos0 + static_cast<int>(n), rope.inv_freq[i]);
    T* x = qkvc + n * row + static_cast<size_t>(h) * D;
    float x0 = ld(x[i]), x1 = ld(x[half + i]);
    math::rope_rotate(x0, x1, cosf(a) * rope.scale, sinf(a) * rope.scale);
    x[i] = st<T>(x0);
    x[half + i] = st<T>(x1);
  }
}

// The new rows' k and v into cache rows pos0 ...
template <typename T>
__global__ void store_kv_k(T* kc, T* vc, const T* qkvc, int pos0, size_t C, size_t KV,
                           size_t total) {
  FY_GRID_LOOP(idx, total) {
    const size_t n = idx / KV, e = idx % KV, row = C + 2 * KV;
    kc[(pos0 + n) * KV + e] = qkvc[n * row + C + e];
    vc[(pos0 + n) * KV + e] = qkvc[n * row + C + KV + e];
  }
}

// One block per (new row i, query head h). Each warp takes every warps-th cache row and keeps
// a running softmax over its rows (max, sum of exponentials, weighted sum of values, the
// values' columns spread over its lanes); the warps' partial results are then combined. No
// score is stored, so any context length fits.
template <typename T>
__global__ void attention_decode_k(T* out, const T* kc, const T* vc, const T* qkvc, int pos0,
                                   int Hq, int Hkv, int D, float scale) {
  extern __shared__ float sh[];  // q (D) | warp maxima | warp sums | warp accumulators (warps x D)
  const int i = blockIdx.x / Hq, h = blockIdx.x % Hq, g = h / (Hq / Hkv), last = pos0 + i;
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D, row = C + 2 * KV;
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* q = sh;
  float* wm = q + D;
  float* ws = wm + warps;
  float* wacc = ws + warps;
  for (int d = threadIdx.x; d < D; d += blockDim.x)
    q[d] = ld(qkvc[i * row + static_cast<size_t>(h) * D + d]);
  __syncthreads();
  float m = -INFINITY, s = 0.0f, acc[kMaxHeadSize / kWarp];
  for (int t = 0; t < kMaxHeadSize / kWarp; ++t) acc[t] = 0.0f;
  for (int j = warp; j <= last; j += warps) {
    const T* k = kc + static_cast<size_t>(j) * KV + static_cast<size_t>(g) * D;
    float dot = 0.0f;
    for (int d = lane; d < D; d += kWarp) dot += q[d] * ld(k[d]);
    const float x = warp_reduce(dot, SumOp{}) * scale;
    const float mn = fmaxf(m, x), c = expf(m - mn), e = expf(x - mn);
    s = s * c + e;
    const T* v = vc + static_cast<size_t>(j) * KV + static_cast<size_t>(g) * D;
    for (int t = 0, d = lane; d < D; d += kWarp, ++t) acc[t] = acc[t] * c + e * ld(v[d]);
    m = mn;
  }
  if (lane == 0) wm[warp] = m, ws[warp] = s;
  for (int t = 0, d = lane; d < D; d += kWarp, ++t) wacc[warp * D + d] = acc[t];
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float M = -INFINITY;
    for (int w = 0; w < warps; ++w) M = fmaxf(M, wm[w]);
    float S = 0.0f, A = 0.0f;
    for (int w = 0; w < warps; ++w) {
      if (ws[w] == 0.0f) continue;  // a warp that had no row
      const float c = expf(wm[w] - M);
      S += ws[w] * c;
      A += wacc[w * D + d] * c;
    }
    out[static_cast<size_t>(i) * C + static_cast<size_t>(h) * D + d] = st<T>(A / S);
  }
}

}  // namespace

void CudaBackend::rope_forward_at(void* qkvc, int N, int pos0, int Hq, int Hkv, int D,
                                  const RopeTable& rope) {
  const size_t total = static_cast<size_t>(N) * (Hq + Hkv) * (D / 2);
  if (!total) return;
  FY_TYPED(E, FY_LAUNCH(rope_at_k<E>, elt_blocks(total), kEltThreads, static_cast<E*>(qkvc), pos0,
                        Hq, Hkv, D, rope, total));
}

void CudaBackend::attention_decode(void* out, void* k_cache, void* v_cache, const void* qkvc, int N,
                                   int pos0, int Hq, int Hkv, int D) {
  FY_CHECK(pos0 >= 0 && N >= 1 && Hkv >= 1 && Hq % Hkv == 0, "attention_decode: ", N, " rows at ",
           pos0, ", ", Hq, " query heads, ", Hkv, " key/value heads");
  if (D > kMaxHeadSize)
    throw Error(
        str("attention_decode on CUDA: head size ", D, " is above the kernel's ", kMaxHeadSize));
  const size_t C = static_cast<size_t>(Hq) * D, KV = static_cast<size_t>(Hkv) * D;
  const size_t shared =
      sizeof(float) * (D + 2 * (kDecodeThreads / kWarp) + (kDecodeThreads / kWarp) * D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  FY_TYPED(E, {
    FY_LAUNCH(store_kv_k<E>, elt_blocks(N * KV), kEltThreads, static_cast<E*>(k_cache),
              static_cast<E*>(v_cache), static_cast<const E*>(qkvc), pos0, C, KV, N * KV);
    bind();
    attention_decode_k<E><<<N * Hq, kDecodeThreads, shared, compute_>>>(
        static_cast<E*>(out), static_cast<const E*>(k_cache), static_cast<const E*>(v_cache),
        static_cast<const E*>(qkvc), pos0, Hq, Hkv, D, scale);
    FY_CUDA_LAUNCHED();
  });
}

}  // namespace fuyou::cuda
