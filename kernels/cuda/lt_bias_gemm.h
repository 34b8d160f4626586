// The projections' forward with the bias added by the GEMM itself (cuBLASLt's
// CUBLASLT_EPILOGUE_BIAS) instead of a broadcast kernel that writes every output row first and
// a GEMM that reads them back (beta = 1): one pass over the output instead of three.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <tuple>

namespace fuyou::cuda {

class LtBiasGemm {
 public:
  LtBiasGemm();  // throws fuyou::Error when cuBLASLt cannot start
  ~LtBiasGemm();
  LtBiasGemm(const LtBiasGemm&) = delete;
  LtBiasGemm& operator=(const LtBiasGemm&) = delete;

  // Queues out(N,OC) = in(N,IC) w(OC,IC)^T + bias(OC) on `stream`, all row-major of 16-bit
  // type `t` (CUDA_R_16BF or CUDA_R_16F), fp32 accumulation, the bias added in fp32 before
  // the one rounding of each output. The workspace is the caller's (the cuBLAS handle's, used
  // in turn on the same stream). Returns false, having queued nothing, where cuBLASLt offers no
  // algorithm for this shape, type and the pointers' alignment, or refuses the call: the caller
  // then runs its broadcast and GEMM. The caller serialises calls (one handle).
  bool run(cudaStream_t stream, void* workspace, size_t workspace_bytes, cudaDataType_t t,
           void* out, const void* in, const void* w, const void* bias, int N, int IC, int OC);

 private:
  // One shape, type and set of pointer alignments: its descriptors and the heuristic's
  // algorithm, or `ok` false where there is none (asked once).
  struct Plan {
    bool ok = false;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::tuple<int, int, int, int, unsigned, unsigned, unsigned, unsigned>;
  Plan& plan_for(const Key& key, size_t workspace_bytes);
  void destroy(Plan& p);

  cublasLtHandle_t lt_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace fuyou::cuda
