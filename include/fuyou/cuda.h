// The CUDA backend's entry points, declared for every build. Built without the CUDA toolkit
// (no FUYOU_WITH_CUDA), cuda_built() is false, cuda_usable_devices() reports why,
// make_cuda_backend() throws and cudnn_attention_graph_check() says so; those answers come
// from src/runtime/backend_select.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fuyou/backend.h"

namespace fuyou {

// Whether this build contains the CUDA backend.
bool cuda_built();

// How many CUDA devices this process can use (compute capability 8.0 or newer, the oldest
// this build compiles for). When none, *why (if given) says why, naming the CUDA call and
// its error, e.g. "no usable CUDA driver (cudaGetDeviceCount: cudaErrorInsufficientDriver:
// ...)". Never throws.
int cuda_usable_devices(std::string* why);

// The CUDA backend on `device`, with a device arena of `device_memory` bytes (0: what the
// device has free, less a reserve for the CUDA context and cuBLAS workspaces). Throws
// fuyou::Error when the device cannot be used or the budget does not fit.
//
// `wait`: how host threads wait for the device (runtime.cuda_wait): auto, spin, yield or block.
// It is the device's flag for the whole process; where the device's context is already active
// (another backend made first) it stays as it was, said once in the log.
std::unique_ptr<Backend> make_cuda_backend(int device, uint64_t device_memory,
                                           const std::string& wait = "auto");

// Builds cuDNN's fused-attention graphs (forward and backward) for shape (B, T, C, H) on the
// 16-bit type t and finalizes every tensor and operation descriptor: the part of cuDNN's
// graph API that needs no device. "" when all finalize; otherwise why not (no CUDA backend
// in this build, cuDNN not on the library path, or the first descriptor cuDNN refused).
std::string cudnn_attention_graph_check(ElemType t, int B, int T, int C, int H);

// A plain cuBLASLt GEMM, the ceiling the engine's GEMMs are judged against (fuyou-bench gemm
// --backend cuda): C(m, n) = op(A) op(B) in column-major terms, bf16 A, B and C, fp32
// accumulation, the heuristic's first algorithm with a 32 MiB workspace, on device 0, over the
// caller's device buffers (the bench passes the engine's own, so both sides multiply the same
// numbers). Times as the engine's side is timed: batches of `reps` calls queued between two
// CUDA events, a warm-up batch then the median of five, per call. Throws fuyou::Error on a
// CUDA or cuBLASLt failure, or without the CUDA backend in this build.
struct LtGemmShape {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
};
struct LtGemmOperands {
  const void* a = nullptr;  // (trans_a ? k x m : m x k), column-major
  const void* b = nullptr;  // (trans_b ? n x k : k x n)
  void* c = nullptr;        // m x n
};
struct LtGemmTiming {
  double median_s = 0, best_s = 0;
  size_t workspace = 0;  // what the chosen algorithm uses
};
LtGemmTiming cublaslt_gemm_time(const LtGemmShape& shape, const LtGemmOperands& operands, int reps);

}  // namespace fuyou
