// The CPU backend's arithmetic: fp32 kernels over OpenMP threads and a BLAS GEMM
// (kernels/cpu/ops.cc, ops_families.cc, attention.cc). CpuBackend runs them on its tensors,
// through fp32 views where it stores bf16 (kernels/cpu/stage.h). The declarations and what
// each kernel computes are Backend's (include/fuyou/backend.h), with float* for every tensor.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuyou/backend.h"

namespace fuyou::cpu {

// res(C) = a + b rounded to `stored` and widened back (fp32: the plain sum); res may alias a
// or b. The residual half of the fused residual + norm kernels.
void residual_row(float* res, const float* a, const float* b, int C, ElemType stored);

class CpuKernels {
 public:
  explicit CpuKernels(int threads) : threads_(threads) {}
  void set_matmul_precision(MatmulPrecision p) { precision_ = p; }
  MatmulPrecision matmul_precision() const { return precision_; }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C);
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C);
  void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* w,
                         const float* b, int N, int C);
  // res holds the sum as `stored` rounds it (residual_row), which the norm then reads.
  void residual_layernorm_forward(float* res, float* out, float* mean, float* rstd, const float* a,
                                  const float* b, const float* w, const float* bias, int N, int C,
                                  ElemType stored);
  void layernorm_backward(float* din, float* dw, float* db, const float* dout, const float* in,
                          const float* w, const float* mean, const float* rstd, int N, int C);
  void matmul_forward(float* out, const float* in, const float* w, const float* bias, int N, int IC,
                      int OC);
  void matmul_backward(float* din, float* dw, float* dbias, const float* dout, const float* in,
                       const float* w, int N, int IC, int OC);
  // Attention without the backend's scratch (each thread keeps its own block scratch).
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int H,
                         const int32_t* pos);
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* lse, int B,
                          int T, int C, int H, const int32_t* pos);
  void gelu_forward(float* out, const float* in, size_t n);
  void gelu_backward(float* din, const float* in, const float* dout, size_t n);
  void add(float* out, const float* a, const float* b, size_t n);
  void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                            int N, int V, int ld);
  void crossentropy_backward(float* logits_to_dlogits, const float* lse, const int32_t* targets,
                             float scale, int N, int V, int ld);
  void crossentropy_forward_backward(float* losses, float* lse, float* logits_to_dlogits,
                                     const int32_t* targets, float scale, int N, int V, int ld);
  // ops_families.cc: what the opt and llama families add.
  void rmsnorm_forward(float* out, float* rstd, const float* in, const float* w, float eps, int N,
                       int C);
  void rmsnorm_backward(float* din, float* dw, const float* dout, const float* in, const float* w,
                        const float* rstd, int N, int C);
  void residual_rmsnorm_forward(float* res, float* out, float* rstd, const float* a, const float* b,
                                const float* w, float eps, int N, int C, ElemType stored);
  void rope_forward(float* qkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,
                    const int32_t* pos);
  void rope_backward(float* dqkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,
                     const int32_t* pos);
  // Rows at positions pos0 .. pos0 + N - 1 (a decode step).
  void rope_forward_at(float* qkvc, int N, int pos0, int Hq, int Hkv, int D, const RopeTable& rope);
  void qk_norm_forward(float* qkvc, float* saved, float* rstd, const float* qw, const float* kw,
                       float eps, int N, const QkNormSpans& s);
  void qk_norm_backward(float* dqkvc, float* dqw, float* dkw, const float* saved, const float* qw,
                        const float* kw, const float* rstd, int N, const QkNormSpans& s);
  void repeat_kv_forward(float* qkv, const float* qkvc, int N, int Hq, int Hkv, int D);
  void repeat_kv_backward(float* dqkvc, const float* dqkv, int N, int Hq, int Hkv, int D);
  void swiglu_forward(float* out, const float* gu, int N, int F);
  void swiglu_backward(float* dgu, const float* gu, const float* dout, int N, int F);
  void relu_forward(float* out, const float* in, size_t n);
  void relu_backward(float* din, const float* in, const float* dout, size_t n);

 private:
  int threads_;
  MatmulPrecision precision_ = MatmulPrecision::kFp32;
};

}  // namespace fuyou::cpu
