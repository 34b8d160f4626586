// The ceiling the engine's GEMMs are judged against: a plain cuBLASLt GEMM with bf16 inputs
// and output, fp32 accumulation, the heuristic's first algorithm and a 32 MiB workspace, timed
// on its own stream. Nothing of the engine runs here (fuyou-bench gemm --backend cuda times the
// engine's matmuls at the same shapes beside it).
#include <cublasLt.h>
#include <cuda_bf16.h>
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

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(v * float(1 + (i % 7)) / 7.0f);
}

// Owns what one measurement allocates, so an error on the way frees it.
struct LtResources {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  void *da = nullptr, *db = nullptr, *dc = nullptr, *ws = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~LtResources() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    for (void* p : {da, db, dc, ws})
      if (p) cudaFree(p);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (auto* l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  }
};

}  // namespace

LtGemmTiming cublaslt_gemm_time(const LtGemmShape& s, int reps) {
  constexpr size_t kWorkspace = 32u << 20;
  FY_CHECK(s.m > 0 && s.n > 0 && s.k > 0 && reps > 0, "cuBLASLt bench: bad shape or reps");
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
  const size_t na = a_rows * a_cols, nb = b_rows * b_cols, nc = uint64_t(s.m) * s.n;
  check_cuda(cudaMalloc(&r.da, 2 * na), "cudaMalloc A");
  check_cuda(cudaMalloc(&r.db, 2 * nb), "cudaMalloc B");
  check_cuda(cudaMalloc(&r.dc, 2 * nc), "cudaMalloc C");
  check_cuda(cudaMalloc(&r.ws, kWorkspace), "cudaMalloc workspace");
  check_cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  fill_bf16<<<1024, 256, 0, r.stream>>>(static_cast<__nv_bfloat16*>(r.da), na, 0.01f);
  fill_bf16<<<1024, 256, 0, r.stream>>>(static_cast<__nv_bfloat16*>(r.db), nb, 0.02f);
  check_cuda(cudaGetLastError(), "fill");
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
    check_lt(cublasLtMatmul(r.lt, r.op, &alpha, r.da, r.a, r.db, r.b, &beta, r.dc, r.c, r.dc, r.c,
                            &heur.algo, r.ws, kWorkspace, r.stream),
             "cublasLtMatmul");
  };
  for (int i = 0; i < 3; ++i) run();  // warm-up
  check_cuda(cudaEventCreate(&r.start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&r.stop), "cudaEventCreate");
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    check_cuda(cudaEventRecord(r.start, r.stream), "cudaEventRecord");
    run();
    check_cuda(cudaEventRecord(r.stop, r.stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(r.stop), "cudaEventSynchronize");
    float t = 0;
    check_cuda(cudaEventElapsedTime(&t, r.start, r.stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  LtGemmTiming out;
  out.median_s = ms[ms.size() / 2] / 1e3;
  out.best_s = ms.front() / 1e3;
  out.workspace = heur.workspaceSize;
  return out;
}

}  // namespace fuyou
