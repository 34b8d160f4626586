// The CPU backend: fp32 kernels over OpenMP threads and a BLAS GEMM (CpuKernels), with a
// "device memory" arena that has a hard capacity like a GPU's and holds fp32 or bf16 tensors.
#pragma once

#include <mutex>
#include <unordered_map>

#include "fuyou/backend.h"
#include "kernels/cpu/cpu_kernels.h"

namespace fuyou::cpu {

class CpuBackend : public Backend {
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
  FUYOU_LAYER_KERNELS(FY_KERNEL_OVERRIDE)
  FUYOU_DECODE_KERNELS(FY_KERNEL_OVERRIDE)  // kernels/cpu/decode.cc

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
