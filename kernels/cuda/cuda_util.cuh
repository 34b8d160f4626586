// Error checks and the block-wide reduction every row kernel of the CUDA backend uses.
// Included only by .cu files.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fuyou/elem_type.h"
#include "fuyou/error.h"

namespace fuyou::cuda {

[[noreturn]] void cuda_failed(const char* file, int line, const char* call, cudaError_t e);
[[noreturn]] void cublas_failed(const char* file, int line, const char* call, cublasStatus_t s);

}  // namespace fuyou::cuda

// A CUDA runtime call that must succeed; a failure throws fuyou::Error with file:line, the
// call and the CUDA error's name and text (a device error is not recoverable here).
#define FY_CUDA(call)                                                                       \
  do {                                                                                      \
    cudaError_t fy_e_ = (call);                                                             \
    if (fy_e_ != cudaSuccess) ::fuyou::cuda::cuda_failed(__FILE__, __LINE__, #call, fy_e_); \
  } while (0)

#define FY_CUBLAS(call)                                               \
  do {                                                                \
    cublasStatus_t fy_s_ = (call);                                    \
    if (fy_s_ != CUBLAS_STATUS_SUCCESS)                               \
      ::fuyou::cuda::cublas_failed(__FILE__, __LINE__, #call, fy_s_); \
  } while (0)

// After a kernel launch: a bad launch configuration shows up here, not at the next sync.
#define FY_CUDA_LAUNCHED() FY_CUDA(cudaGetLastError())

// Launches a kernel on the backend's compute stream from inside a CudaBackend member. The
// current device is per host thread and the scheduler calls from several, so it is set on
// every launch (a cheap runtime call).
#define FY_LAUNCH(kernel, grid, block, ...)                \
  do {                                                     \
    bind();                                                \
    kernel<<<(grid), (block), 0, compute_>>>(__VA_ARGS__); \
    FY_CUDA_LAUNCHED();                                    \
  } while (0)

// Grid-stride loop: thread i of the grid visits i, i + grid size, ... below n, so any grid
// size covers any n.
#define FY_GRID_LOOP(i, n)                                                \
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (n); \
       i += size_t(gridDim.x) * blockDim.x)

namespace fuyou::cuda {

constexpr int kWarp = 32;
// Threads per block of the row kernels (one block per row). A multiple of the warp size and
// at most 32 warps, which block_sum's 32-entry shared array relies on.
constexpr int kRowThreads = 256;
// Threads per block of the element-wise kernels.
constexpr int kEltThreads = 256;

// Blocks for an element-wise grid-stride loop over n elements: enough to fill the GPU, few
// enough that each thread does several elements.
inline unsigned elt_blocks(size_t n) {
  size_t b = (n + kEltThreads - 1) / kEltThreads;
  return static_cast<unsigned>(b < 4096 ? (b ? b : 1) : 4096);
}

// Row slices of a column reduction (bias, norm-weight and embedding gradients). A fixed
// number, not one derived from the device, so the partial sums and the order they are added
// in, hence every bit of the result, are the same on every run and every GPU: the engine's
// offloaded and in-memory runs, and a resumed run, must agree bit for bit.
constexpr int kReduceSlices = 128;

inline int reduce_slices(int N) { return N < kReduceSlices ? N : kReduceSlices; }

// Row slices of the wide column reductions (bias gradients, LayerNorm weight gradients): more
// slices than kReduceSlices so enough loads are in flight to keep the memory busy, as many as
// keep the partial sums within 4 Mi floats. A function of N and C alone, so the bits are the
// same on every run and every GPU.
inline int wide_reduce_slices(int N, int C) {
  int s = C > 0 ? (1 << 22) / C : kReduceSlices;
  s = s < kReduceSlices ? kReduceSlices : s > 1024 ? 1024 : s;
  return N < s ? N : s;
}

// ---- 16-byte vectors ------------------------------------------------------------------------
// Element-wise kernels load and store 16 bytes at a time (8 bf16 / fp16 or 4 fp32 values)
// where every pointer is 16-byte aligned, element by element otherwise and for the tail; the
// arithmetic per element is the same either way, so the bits do not depend on the path.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
template <typename... P>
bool all_aligned16(const P*... p) {
  return (aligned16(p) && ...);
}

// ---- storage types ------------------------------------------------------------------------
// The device's tensors are fp32, bf16 or fp16 (Backend::storage_type). Kernels are templates
// on the storage type T: every load widens to fp32 (ld), the arithmetic is fp32 as in the
// fp32 kernel, and every store rounds once to nearest even (st<T>), which is what the CPU
// backend's 16-bit kernels do (kernels/cpu/stage.h: the fp32 kernel on widened inputs, each
// output rounded once). A kernel that accumulates into a 16-bit tensor reads it widened,
// adds in fp32 and rounds once per call.
__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ld(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T st(float v);
template <>
__device__ __forceinline__ float st<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 st<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half st<__half>(float v) {
  return __float2half_rn(v);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the device type of `t`: the host side of every kernel
// launch, so one template serves the three storage types.
template <typename F>
void with_storage(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kF32:
      f(TypeTag<float>{});
      return;
    case ElemType::kBF16:
      f(TypeTag<__nv_bfloat16>{});
      return;
    case ElemType::kF16:
      f(TypeTag<__half>{});
      return;
  }
}

// Inside a CudaBackend member: runs the statements with E the device type of the backend's
// storage type (`FY_TYPED(E, FY_LAUNCH(kernel<E>, ...))`).
#define FY_TYPED(E, ...)                                    \
  ::fuyou::cuda::with_storage(storage_, [&](auto fy_tag_) { \
    using E = typename decltype(fy_tag_)::type;             \
    __VA_ARGS__;                                            \
  })

// cuBLAS's name for the storage type.
inline cudaDataType_t blas_type(ElemType t) {
  return t == ElemType::kBF16 ? CUDA_R_16BF : t == ElemType::kF16 ? CUDA_R_16F : CUDA_R_32F;
}

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

template <typename T, typename Op>
__device__ T warp_reduce(T v, Op op) {
  // Butterfly over the 32 lanes: after the loop every lane holds the reduction of all 32.
  for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduces one value per thread over the whole block and returns the result to every thread.
// Invariants: every thread of the block calls it (it contains __syncthreads), blockDim.x is a
// multiple of 32 and at most 1024, so one shared slot per warp suffices. The trailing barrier
// lets a caller invoke it again right away (the shared slots are reused).
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_reduce(v, op);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / kWarp;
  v = threadIdx.x < warps ? partial[threadIdx.x] : identity;
  if (warp == 0) v = warp_reduce(v, op);
  if (threadIdx.x == 0) partial[0] = v;
  __syncthreads();
  v = partial[0];
  __syncthreads();
  return v;
}

// out(c) += the sum of part(r, c) over the slices r: the second pass of every column
// reduction; out of the storage type, the partial sums fp32. A block of (32, 32) threads
// takes 32 columns: thread (x, y) adds slices y, y + 32, ... of its column in order (the
// warps read rows of 32 adjacent columns), then thread (x, 0) adds the 32 sums in y order.
// A fixed order, so the same bits every run. Launch with slices_add_grid(C) and
// slices_add_block(). Static: each .cu file that launches it has its own copy.
constexpr int kSlicesAddRows = 32;
inline dim3 slices_add_block() { return dim3(kWarp, kSlicesAddRows); }
inline unsigned slices_add_grid(int C) { return static_cast<unsigned>((C + kWarp - 1) / kWarp); }

template <typename T>
static __global__ void column_slices_add(T* out, const float* part, int slices, int C) {
  __shared__ float sums[kSlicesAddRows][kWarp + 1];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float s = 0.0f;
  if (c < C)
    for (int r = threadIdx.y; r < slices; r += kSlicesAddRows) s += part[size_t(r) * C + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float total = 0.0f;
  for (int y = 0; y < kSlicesAddRows; ++y) total += sums[y][threadIdx.x];
  out[c] = st<T>(ld(out[c]) + total);
}

}  // namespace fuyou::cuda
