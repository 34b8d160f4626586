// The ceiling the engine's GEMMs are judged against: a plain cuBLASLt GEMM with bf16 inputs
// and output, fp32 accumulation, the heuristic's first algorithm and a 32 MiB workspace, timed
// on its own stream over the caller's operands (fuyou-bench gemm --backend cuda passes the
// engine's own buffers, filled with random bf16, so both sides multiply the same numbers).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/sizes.h"

namespace fuyou {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(str("cuBLASLt bench: ", what, ": ", cudaGetErrorString(e)));
}
void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(str("cuBLASLt bench: ", what, " failed (status ", int(s), ")"));
}

// Owns what one measurement allocates, so an error on the way frees it.
struct LtResources {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  void* ws = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~LtResources() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    if (ws) cudaFree(ws);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (auto* l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  }
};

}  // namespace

LtGemmTiming cublaslt_gemm_time(const LtGemmShape& s, const LtGemmOperands& ops, int reps) {
  constexpr size_t kWorkspace = 32u << 20;
  FY_CHECK(s.m > 0 && s.n > 0 && s.k > 0 && reps > 0, "cuBLASLt bench: bad shape or reps");
  FY_CHECK(ops.a && ops.b && ops.c, "cuBLASLt bench: an operand is null");
  LtResources r;
  check_lt(cublasLtCreate(&r.lt), "cublasLtCreate");
  check_lt(cublasLtMatmulDescCreate(&r.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
           "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
           "TRANSB");
  // Column-major: op(A) is m x k, op(B) k x n, C m x n; stored A is (trans_a ? k x m : m x k).
  const uint64_t a_rows = s.trans_a ? s.k : s.m, a_cols = s.trans_a ? s.m : s.k;
  const uint64_t b_rows = s.trans_b ? s.n : s.k, b_cols = s.trans_b ? s.k : s.n;
  check_lt(cublasLtMatrixLayoutCreate(&r.a, CUDA_R_16BF, a_rows, a_cols, a_rows), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&r.b, CUDA_R_16BF, b_rows, b_cols, b_rows), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&r.c, CUDA_R_16BF, s.m, s.n, s.m), "layout C");
  check_cuda(cudaMalloc(&r.ws, kWorkspace), "cudaMalloc workspace");
  check_cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  // The operands were written on another stream (the caller's copies): wait for the device.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_lt(cublasLtMatmulPreferenceCreate(&r.pref), "preference");
  const size_t ws = kWorkspace;
  check_lt(cublasLtMatmulPreferenceSetAttribute(r.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws, sizeof(ws)),
           "workspace preference");
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(r.lt, r.op, r.a, r.b, r.c, r.c, r.pref, 1, &heur, &found),
           "heuristic");
  if (found < 1)
    throw Error(str("cuBLASLt bench: no algorithm for m ", s.m, " n ", s.n, " k ", s.k));
  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&] {
    check_lt(cublasLtMatmul(r.lt, r.op, &alpha, ops.a, r.a, ops.b, r.b, &beta, ops.c, r.c, ops.c,
                            r.c, &heur.algo, r.ws, kWorkspace, r.stream),
             "cublasLtMatmul");
  };
  check_cuda(cudaEventCreate(&r.start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&r.stop), "cudaEventCreate");
  // As the engine's side is timed (profile_bench.cc, engine_seconds): `reps` calls queued
  // between two events, so a call's launch overlaps the one before it; a warm-up batch, then
  // the median of five batches, per call.
  std::vector<float> ms;
  for (int batch = 0; batch < 6; ++batch) {
    check_cuda(cudaEventRecord(r.start, r.stream), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) run();
    check_cuda(cudaEventRecord(r.stop, r.stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(r.stop), "cudaEventSynchronize");
    float t = 0;
    check_cuda(cudaEventElapsedTime(&t, r.start, r.stop), "cudaEventElapsedTime");
    if (batch > 0) ms.push_back(t / reps);
  }
  std::sort(ms.begin(), ms.end());
  LtGemmTiming out;
  out.median_s = ms[ms.size() / 2] / 1e3;
  out.best_s = ms.front() / 1e3;
  out.workspace = heur.workspaceSize;
  return out;
}

}  // namespace fuyou
