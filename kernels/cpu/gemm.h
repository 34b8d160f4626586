// CPU GEMM entry points. One place chooses the library (docs/dependencies.md records the
// measurement that chose it) so the rest of the CPU backend never names it.
#pragma once

#include <cstdint>

namespace fuyou::cpu {

// C(M,N) = alpha * op(A) * op(B) + beta * C, all row-major; op(X) = X^T when trans_X.
// lda/ldb/ldc are row strides in elements. Uses the calling thread's OpenMP team
// (set_thread_team, include/fuyou/threads.h).
void gemm_f32(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
              const float* B, int ldb, float beta, float* C, int ldc);

// The same product with A and B rounded to bf16 (nearest even) and fp32 accumulation: the
// mixed precision a GPU runs by default, at about twice the fp32 rate on CPUs with
// AVX-512 bf16 (docs/dependencies.md). alpha must be 1 and beta 0 or 1.
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc);

// Whether gemm_bf16 runs oneDNN's bf16 matmul (AVX-512 CPUs) or, elsewhere, the fp32 GEMM on
// bf16-rounded operands (the same products, fp32 speed).
bool bf16_gemm_native();
// Forces the fp32 path even where the bf16 matmul exists, so tests cover both (tests only).
void set_bf16_gemm_fallback(bool on);

// The backend's matmul_forward / matmul_backward (include/fuyou/backend.h) with bf16 GEMM
// inputs, as gemm_bf16 computes them but with fewer passes over memory (gemm_lowp.cc). Only
// where bf16_gemm_native(); elsewhere the backend's fp32 matmuls call gemm_bf16 instead.
void matmul_forward_bf16(float* out, const float* in, const float* w, const float* bias, int N,
                         int IC, int OC);
void matmul_backward_bf16(float* din, float* dw, float* dbias, const float* dout, const float* in,
                          const float* w, int N, int IC, int OC);

// The same on operands already stored as bf16 (bf16 device tensors, runtime.device_tensors):
// nothing to round, the same products and sums as the fp32-operand versions given the same
// values. Outputs stay fp32 (the caller rounds what it stores).
void matmul_forward_bf16_stored(float* out, const uint16_t* in, const uint16_t* w,
                                const float* bias, int N, int IC, int OC);
void matmul_backward_bf16_stored(float* din, float* dw, float* dbias, const uint16_t* dout,
                                 const uint16_t* in, const uint16_t* w, int N, int IC, int OC);

// The same with A and B rounded to fp16 (fp32 accumulation); see gemm_lowp.cc for why it
// runs at fp32 speed here.
void gemm_fp16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
               int lda, const float* B, int ldb, float beta, float* C, int ldc);

// The library and version, for logs and bench output.
const char* gemm_library_name();

}  // namespace fuyou::cpu
