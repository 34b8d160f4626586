// The CUDA backend: one device arena with a hard capacity, a compute stream, a stream per
// copy direction, cuBLAS GEMMs and the custom kernels of kernels/cuda/*.cu, whose
// per-element arithmetic is kernels/common/element_math.h (the CPU backend's).
//
// Ordering contract with callers (the model, InMemoryStep, the offload scheduler's threads):
// every Backend call behaves as if it completed when it returns. Kernels are queued on the
// compute stream, so kernel-after-kernel order is stream order. A copy waits (through an
// event recorded on the compute stream) for every kernel queued before it and returns only
// once the copy is done, so a copy never races a kernel the caller already considers
// finished and a host buffer may be reused as soon as the call returns. This is correct for
// the scheduler's host-side events, but serialises copies behind compute; see docs/cuda.md
// for what overlapping them needs. In caller-ordered mode (set_caller_ordered) a copy skips
// that wait, except for the zeroing that alloc() queues on the compute stream: the caller
// orders its own work, not the arena's, so every copy waits for the last allocation's
// memset (an event; already complete in steady state, where nothing is allocated).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fuyou/backend.h"
#include "kernels/common/arena.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/lt_bias_gemm.h"

namespace fuyou::cuda {

// cudaSetDeviceFlags' wait mode for `device` (runtime.cuda_wait: spin, yield or block), set
// before its context starts; a context already active keeps its mode, with a warning.
void set_wait(int device, const std::string& wait);

class CudaBackend final : public Backend {
 public:
  // capacity 0: what the device has free less a reserve (see make_cuda_backend).
  CudaBackend(int device, uint64_t capacity);
  ~CudaBackend() override;

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string name() const override;
  int threads() const override { return 1; }  // host threads used: the caller's
  void set_matmul_precision(MatmulPrecision p) override { precision_ = p; }
  // fp32, bf16 or fp16 tensors (runtime.device_tensors): every kernel is a template on the
  // storage type (cuda_util.cuh), the GEMMs take 16-bit operands as cuBLAS types.
  void set_storage_type(ElemType t) override { storage_ = t; }
  ElemType storage_type() const override { return storage_; }
  // runtime.attention: auto and cudnn load cuDNN (cudnn throws if it cannot); with 16-bit
  // tensors the attention then runs on cuDNN's fused kernels, a shape it refuses on this
  // backend's kernels (attention.cu), logged once per reason.
  void set_attention_impl(AttentionImpl impl) override;
  // runtime.gemm_bias: on, matmul_forward adds the bias in cuBLASLt's epilogue where cuBLASLt
  // has an algorithm for the shape (lt_bias_gemm.h); throws when cuBLASLt cannot start. Off
  // (the default): the broadcast kernel and cuBLAS's GEMM, beta = 1.
  void set_bias_epilogue(bool on) override;
  // matmul_forward calls whose bias the epilogue added.
  uint64_t bias_epilogues() const { return bias_epilogues_.load(); }
  // Whether attention_forward / backward go to cuDNN (for a shape it accepts).
  bool fused_attention() const;
  // Calls cuDNN refused so far (each ran on the kernels instead), and the cuDNN in use.
  size_t attention_refusals() const { return refusals_.load(); }
  CudnnAttention* cudnn() const { return cudnn_.get(); }
  MatmulPrecision matmul_precision() const override { return precision_; }

  void* alloc(size_t bytes, const std::string& what) override;
  void free(void* ptr) override;
  MemoryStats memory() const override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void zero(void* ptr, size_t bytes) override;
  void synchronize() override;

  FUYOU_LAYER_KERNELS(FY_KERNEL_OVERRIDE)
  FUYOU_DECODE_KERNELS(FY_KERNEL_OVERRIDE)  // kernels/cuda/decode.cu

  // The optimizer on the device (optimizer.cu).
  bool supports_device_optimizer() const override { return true; }
  void accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) override;
  double sum_squares_spans(const std::vector<SquareSpan>& spans, ElemType type) override;
  double sum_squares(const void* x, ElemType type,
                     const std::vector<std::pair<size_t, size_t>>& groups) override;
  void adamw(const DeviceAdamW& a) override;

  // Timing marks: events recorded on the compute stream (timed events, from a pool kept for
  // the next step).
  void timing_start() override;
  void timing_mark(int tag) override;
  std::vector<TimingMark> timing_stop() override;

  void set_caller_ordered(bool on) override { caller_ordered_ = on; }
  void finish_compute() override;
  bool register_host(void* ptr, size_t bytes) override;
  void unregister_host(void* ptr) override;

  cudaStream_t compute_stream() const { return compute_; }
  // Makes this backend's device current on the calling thread (the runtime keeps it per
  // thread, and the scheduler calls from several).
  void bind() const;

  // Row-major C(M,N) = alpha op(A) op(B) + beta C, `batch` times with element strides
  // sa/sb/sc between the problems, on the compute stream; A and B of element type `ab`, C of
  // `c` (fp32 unless given). fp32 operands: `mixed` lets the GEMM round its inputs to the
  // matmul precision (tensor cores, fp32 accumulation); otherwise fp32. 16-bit operands are
  // multiplied as they are with fp32 accumulation, and a 16-bit C is rounded once.
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, int lda,
            long long sa, const void* B, int ldb, long long sb, float beta, void* C, int ldc,
            long long sc, int batch, bool mixed, ElemType ab = ElemType::kF32,
            ElemType c = ElemType::kF32);

 private:
  void copy_on(cudaStream_t stream, cudaEvent_t ready, std::mutex& mu, void* dst, const void* src,
               size_t bytes, cudaMemcpyKind kind);
  // Column sums of x(N,C) added into out(C) (bias gradients), both of the storage type.
  void add_column_sums(void* out, const void* x, int N, int C);
  // rope_forward (sign 1) and rope_backward (-1) on storage type E (ops_families.cu).
  template <typename E>
  void rope_launch(void* qkvc, int B, int T, int Hq, int Hkv, int D, const RopeTable& rope,
                   const int32_t* pos, float sign);

 public:
  // Device scratch of at least `bytes`, outside the arena: the partial sums of the reductions
  // (kReduceSlices x the widest reduced row, or 2 x 4 Mi floats for the wide ones), the embedding
  // gradient's token ranks (8 B T bytes) and the unfused attention's batched (T, T) blocks
  // with, for 16-bit tensors, fp32 copies of a chunk of heads (attention.cu: at most 64 MiB,
  // or one head's copies, 7 T head_size floats). The caller holds `scratch_mu()` from the call
  // until its kernels are queued; kernels on the compute stream run one at a time, so one buffer
  // serves them all. Growing it frees the old one, which waits for the whole device (cudaFree): it
  // grows at the first call of each kind, in the first step.
  void* scratch(size_t bytes);
  std::mutex& scratch_mu() { return scratch_mu_; }

 private:
  // Runs cuDNN's attention when fused_attention(); false (after logging the reason once) when
  // cuDNN refuses the shape.
  bool use_cudnn();   // fused_attention(), opening cuDNN first if the tensors turned 16-bit
  void load_cudnn();  // opens cuDNN once; logs (auto) or throws (cudnn) when it is missing
  bool cudnn_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int H);
  bool cudnn_backward(void* dqkv, const void* dout, const void* out, const void* qkv,
                      const float* lse, int B, int T, int C, int H);
  void refused(const char* direction, const std::string& why);

  int device_;
  std::string device_name_;
  AttentionImpl attention_ = AttentionImpl::kKernels;  // tests that make a backend get the kernels
  std::unique_ptr<CudnnAttention> cudnn_;
  std::mutex refused_mu_;
  std::set<std::string> refusals_logged_;
  std::atomic<size_t> refusals_{0};
  MatmulPrecision precision_ = MatmulPrecision::kFp32;
  ElemType storage_ = ElemType::kF32;

  cudaStream_t compute_ = nullptr, h2d_ = nullptr, d2h_ = nullptr;
  cudaEvent_t h2d_ready_ = nullptr, d2h_ready_ = nullptr;
  cudaEvent_t zeroed_ = nullptr;  // recorded after each alloc's memset on the compute stream
  std::mutex zeroed_mu_;          // record and wait on zeroed_ one at a time
  std::mutex h2d_mu_, d2h_mu_;    // one copy per direction at a time (event and stream reuse)
  std::atomic<bool> caller_ordered_{false};  // set_caller_ordered
  cublasHandle_t blas_ = nullptr;
  static constexpr size_t kBlasWorkspace = 32u << 20;  // cublasSetWorkspace's
  void* blas_workspace_ = nullptr;
  std::mutex blas_mu_;  // a cuBLAS handle must not be used by two threads at once
  // matmul_forward's bias in the GEMM's epilogue (16-bit tensors), under blas_mu_, sharing
  // the cuBLAS workspace on the compute stream.
  std::unique_ptr<LtBiasGemm> lt_bias_;  // runtime.gemm_bias epilogue only
  std::atomic<uint64_t> bias_epilogues_{0};

  // Arena: one cudaMalloc, its blocks kept by ArenaBlocks (kernels/common/arena.h), every
  // block a multiple of kAlign.
  static constexpr uint64_t kAlign = 256;
  char* base_ = nullptr;
  mutable std::mutex mu_;  // guards arena_
  ArenaBlocks arena_{0, kAlign};

  std::mutex scratch_mu_;
  char* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;

  std::vector<cudaEvent_t> timing_events_;  // the pool; marks_ uses its first marks_.size()
  std::vector<int> timing_tags_;
  // sum_squares: per list of groups, its table, each (block, lane)'s sum, each group's and the
  // total, in one allocation outside the arena. A plan asks for a few lists over and over (one
  // per group size: a layer's, the embedding's, the final group's), so each is made once
  // instead of freed (a device-wide sync) and made again whenever the list changes.
  struct SquaresTable {
    char* buf = nullptr;
    unsigned long long blocks = 0;
  };
  static constexpr size_t kMaxSquaresTables = 16;  // beyond it, all are freed and made anew
  std::mutex squares_mu_;
  std::map<std::vector<std::pair<size_t, size_t>>, SquaresTable> squares_tables_;
};

}  // namespace fuyou::cuda
