// The CPU backend: fp32 kernels over OpenMP threads and a BLAS GEMM, with a "device
// memory" arena that has a hard capacity like a GPU's.
#pragma once

#include <mutex>
#include <unordered_map>

#include "fuyou/backend.h"

namespace fuyou::cpu {

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, uint64_t capacity);
  ~CpuBackend() override;

  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string name() const override;
  int threads() const override { return threads_; }
  void set_matmul_precision(MatmulPrecision p) override;
  MatmulPrecision matmul_precision() const override { return precision_; }

  void* alloc(size_t bytes, const std::string& what) override;
  void free(void* ptr) override;
  MemoryStats memory() const override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void zero(void* ptr, size_t bytes) override;
  void synchronize() override {}

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C) override;
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                          int B, int T, int C) override;
  void layernorm_forward(float* out, float* mean, float* rstd, const float* in, const float* w,
                         const float* b, int N, int C) override;
  void layernorm_backward(float* din, float* dw, float* db, const float* dout, const float* in,
                          const float* w, const float* mean, const float* rstd, int N,
                          int C) override;
  void matmul_forward(float* out, const float* in, const float* w, const float* bias, int N,
                      int IC, int OC) override;
  void matmul_backward(float* din, float* dw, float* dbias, const float* dout, const float* in,
                       const float* w, int N, int IC, int OC) override;
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C,
                         int H) override;
  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                          const float* att, int B, int T, int C, int H) override;
  void gelu_forward(float* out, const float* in, size_t n) override;
  void gelu_backward(float* din, const float* in, const float* dout, size_t n) override;
  void add(float* out, const float* a, const float* b, size_t n) override;
  void crossentropy_forward(float* losses, float* lse, const float* logits,
                            const int32_t* targets, int N, int V) override;
  void crossentropy_backward(float* logits_to_dlogits, const float* lse, const int32_t* targets,
                             float scale, int N, int V) override;
  // kernels/cpu/ops_families.cc: what the opt and llama families add.
  void rmsnorm_forward(float* out, float* rstd, const float* in, const float* w, float eps, int N,
                       int C) override;
  void rmsnorm_backward(float* din, float* dw, const float* dout, const float* in,
                        const float* w, const float* rstd, int N, int C) override;
  void rope_forward(float* qkvc, int B, int T, int Hq, int Hkv, int D, float theta) override;
  void rope_backward(float* dqkvc, int B, int T, int Hq, int Hkv, int D, float theta) override;
  void repeat_kv_forward(float* qkv, const float* qkvc, int N, int Hq, int Hkv, int D) override;
  void repeat_kv_backward(float* dqkvc, const float* dqkv, int N, int Hq, int Hkv,
                          int D) override;
  void swiglu_forward(float* out, const float* gu, int N, int F) override;
  void swiglu_backward(float* dgu, const float* gu, const float* dout, int N, int F) override;
  void relu_forward(float* out, const float* in, size_t n) override;
  void relu_backward(float* din, const float* in, const float* dout, size_t n) override;

 private:
  int threads_;
  MatmulPrecision precision_ = MatmulPrecision::kFp32;
  uint64_t capacity_;
  mutable std::mutex mu_;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  std::unordered_map<void*, size_t> sizes_;
};

}  // namespace fuyou::cpu
