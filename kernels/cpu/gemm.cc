// CPU GEMM through oneDNN's dnnl_sgemm: row-major, JIT-generated kernels chosen from the
// CPU's instruction-set flags at run time (AVX-512 here), threads from the OpenMP runtime
// the rest of the CPU backend shares. docs/dependencies.md records why this library.
#include "kernels/cpu/gemm.h"

#include <dnnl.h>
#include <omp.h>

#include "fuyou/error.h"

namespace fuyou::cpu {

void gemm_f32(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
              const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                ldb, beta, C, ldc);
  FY_CHECK(st == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(st), " (M=", M,
           " N=", N, " K=", K, ")");
}

const char* gemm_library_name() {
  static std::string name = [] {
    const dnnl_version_t* v = dnnl_version();
    return str("oneDNN ", v->major, ".", v->minor, ".", v->patch, " sgemm");
  }();
  return name.c_str();
}

}  // namespace fuyou::cpu
