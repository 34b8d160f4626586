#include <cstdint>

#include "fuyou/error.h"
#include "kernels/cuda/lt_bias_gemm.h"

namespace fuyou::cuda {

namespace {

// The largest power of two dividing the address, at most 256: what cuBLASLt's heuristic may
// assume of a buffer (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES).
unsigned alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  unsigned al = 256;
  while (al > 1 && a % al) al /= 2;
  return al;
}

}  // namespace

LtBiasGemm::LtBiasGemm() {
  const cublasStatus_t s = cublasLtCreate(&lt_);
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(str("cublasLtCreate failed (status ", int(s), ")"));
}

LtBiasGemm::~LtBiasGemm() {
  for (auto& [key, p] : plans_) destroy(p);
  if (lt_) cublasLtDestroy(lt_);
}

void LtBiasGemm::destroy(Plan& p) {
  for (cublasLtMatrixLayout_t l : {p.a, p.b, p.d})
    if (l) cublasLtMatrixLayoutDestroy(l);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

// Row-major out(N,OC) = in(N,IC) w(OC,IC)^T is, column-major, out^T(OC,N) = W^T in^T with W
// the column-major (IC,OC) that w's rows are, and in^T the column-major (IC,N) of in's: so A =
// w transposed, B = in, D = out with OC rows, and the bias (one value per row of D, broadcast
// over its N columns) is one value per output feature.
LtBiasGemm::Plan& LtBiasGemm::plan_for(const Key& key, size_t workspace_bytes) {
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second;
  Plan& p = plans_[key];
  const auto [N, IC, OC, type, al_out, al_in, al_w, al_bias] = key;
  const auto t = static_cast<cudaDataType_t>(type);
  bool ok =
      cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  ok = ok &&
       cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) ==
           CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) ==
           CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                      sizeof(epilogue)) == CUBLAS_STATUS_SUCCESS;
  ok = ok && cublasLtMatrixLayoutCreate(&p.a, t, IC, OC, IC) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatrixLayoutCreate(&p.b, t, IC, N, IC) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatrixLayoutCreate(&p.d, t, OC, N, OC) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreference_t pref = nullptr;
  ok = ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS;
  // Each output rounded once: partial sums over K kept in fp32 (no in-place or output-type
  // reduction), as the cuBLAS handle's CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION.
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  const uint64_t ws = workspace_bytes;
  const uint32_t als[4] = {al_w, al_in, al_out, al_out};
  const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  ok = ok &&
       cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof(ws)) == CUBLAS_STATUS_SUCCESS &&
       cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                            &reduction, sizeof(reduction)) == CUBLAS_STATUS_SUCCESS;
  for (int i = 0; i < 4 && ok; ++i)
    ok = cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &als[i], sizeof(als[i])) ==
         CUBLAS_STATUS_SUCCESS;
  // The bias pointer's alignment: a heuristic that assumed more would read it misaligned, so
  // a bias aligned to less than a 16-byte vector keeps the broadcast path.
  ok = ok && al_bias >= 16;
  cublasLtMatmulHeuristicResult_t heur{};
  int count = 0;
  ok = ok &&
       cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.d, p.d, pref, 1, &heur, &count) ==
           CUBLAS_STATUS_SUCCESS &&
       count > 0 && heur.state == CUBLAS_STATUS_SUCCESS;
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (!ok) {
    destroy(p);
    return p;  // ok false: this shape keeps the broadcast and GEMM
  }
  p.algo = heur.algo;
  p.ok = true;
  return p;
}

bool LtBiasGemm::run(cudaStream_t stream, void* workspace, size_t workspace_bytes, cudaDataType_t t,
                     void* out, const void* in, const void* w, const void* bias, int N, int IC,
                     int OC) {
  const Key key{
      N, IC, OC, static_cast<int>(t), alignment(out), alignment(in), alignment(w), alignment(bias)};
  Plan& p = plan_for(key, workspace_bytes);
  if (!p.ok) return false;
  if (cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                     sizeof(bias)) != CUBLAS_STATUS_SUCCESS)
    return false;
  const float alpha = 1.0f, beta = 0.0f;
  if (cublasLtMatmul(lt_, p.op, &alpha, w, p.a, in, p.b, &beta, out, p.d, out, p.d, &p.algo,
                     workspace, workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS)
    return true;
  destroy(p);  // refused: this shape keeps the broadcast and GEMM from now on
  return false;
}

}  // namespace fuyou::cuda
