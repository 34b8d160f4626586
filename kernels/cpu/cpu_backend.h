// The CPU backend: fp32 kernels over OpenMP threads and a BLAS GEMM (CpuKernels), with a
// "device memory" arena that has a hard capacity like a GPU's and holds fp32 or bf16 tensors.
#pragma once

#include <mutex>
#include <unordered_map>

#include "fuyou/backend.h"
#include "kernels/cpu/cpu_kernels.h"

namespace fuyou::cpu {

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, uint64_t capacity);
  ~CpuBackend() override;

  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string name() const override;
  int threads() const override { return threads_; }
  void set_matmul_precision(MatmulPrecision p) override;
  MatmulPrecision matmul_precision() const override { return k_.matmul_precision(); }

  void* alloc(size_t bytes, const std::string& what) override;
  void free(void* ptr) override;
  MemoryStats memory() const override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void zero(void* ptr, size_t bytes) override;
  void synchronize() override {}

  void set_storage_type(ElemType t) override;
  ElemType storage_type() const override { return storage_; }

  // Each kernel runs CpuKernels' fp32 code through a Stage (kernels/cpu/stage.h); the
  // embedding's are typed (cpu_backend_kernels.cc says why).
  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B,
                         int T, int C) override;
  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, int B,
                          int T, int C) override;
  void layernorm_forward(void* out, float* mean, float* rstd, const void* in, const void* w,
                         const void* b, int N, int C) override;
  void layernorm_backward(void* din, void* dw, void* db, const void* dout, const void* in,
                          const void* w, const float* mean, const float* rstd, int N,
                          int C) override;
  void matmul_forward(void* out, const void* in, const void* w, const void* bias, int N, int IC,
                      int OC) override;
  void matmul_backward(void* din, void* dw, void* dbias, const void* dout, const void* in,
                       const void* w, int N, int IC, int OC) override;
  void attention_forward(void* out, float* lse, float* scratch, const void* qkv, int B, int T,
                         int C, int H, const int32_t* pos) override;
  void attention_backward(void* dqkv, float* scratch, const void* dout, const void* out,
                          const void* qkv, const float* lse, int B, int T, int C, int H,
                          const int32_t* pos) override;
  void gelu_forward(void* out, const void* in, size_t n) override;
  void gelu_backward(void* din, const void* in, const void* dout, size_t n) override;
  void add(void* out, const void* a, const void* b, size_t n) override;
  void crossentropy_forward(float* losses, float* lse, const void* logits, const int32_t* targets,
                            int N, int V, int ld) override;
  void crossentropy_backward(void* logits_to_dlogits, const float* lse, const int32_t* targets,
                             float scale, int N, int V, int ld) override;
  void rmsnorm_forward(void* out, float* rstd, const void* in, const void* w, float eps, int N,
                       int C) override;
  void rmsnorm_backward(void* din, void* dw, const void* dout, const void* in, const void* w,
                        const float* rstd, int N, int C) override;
  void rope_forward(void* qkvc, int B, int T, int Hq, int Hkv, int D, float theta,
                    const int32_t* pos) override;
  void rope_backward(void* dqkvc, int B, int T, int Hq, int Hkv, int D, float theta,
                     const int32_t* pos) override;
  void repeat_kv_forward(void* qkv, const void* qkvc, int N, int Hq, int Hkv, int D) override;
  void repeat_kv_backward(void* dqkvc, const void* dqkv, int N, int Hq, int Hkv, int D) override;
  void swiglu_forward(void* out, const void* gu, int N, int F) override;
  void swiglu_backward(void* dgu, const void* gu, const void* dout, int N, int F) override;
  void relu_forward(void* out, const void* in, size_t n) override;
  void relu_backward(void* din, const void* in, const void* dout, size_t n) override;
  // kernels/cpu/decode.cc
  void rope_forward_at(void* qkvc, int N, int pos0, int Hq, int Hkv, int D, float theta) override;
  void attention_decode(void* out, void* k_cache, void* v_cache, const void* qkvc, int N, int pos0,
                        int Hq, int Hkv, int D) override;

  bool supports_device_optimizer() const override { return true; }
  void accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) override;
  double sum_squares(const void* x, ElemType type,
                     const std::vector<std::pair<size_t, size_t>>& groups) override;
  void adamw(const DeviceAdamW& a) override;

 private:
  bool bf16_operands() const;

  int threads_;
  CpuKernels k_;
  ElemType storage_ = ElemType::kF32;
  uint64_t capacity_;
  mutable std::mutex mu_;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  std::unordered_map<void*, size_t> sizes_;
};

}  // namespace fuyou::cpu
