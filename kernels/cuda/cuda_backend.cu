// The CUDA backend's memory, streams, copies and GEMMs; the kernels are in ops.cu,
// attention.cu and ops_families.cu (first run on a GPU: docs/cuda.md).
#include <algorithm>

#include "fuyou/cuda.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_util.cuh"

namespace fuyou::cuda {

void cuda_failed(const char* file, int line, const char* call, cudaError_t e) {
  throw Error(str(file, ":", line, ": ", call, " failed: ", cudaGetErrorName(e), ": ",
                  cudaGetErrorString(e)));
}

void cublas_failed(const char* file, int line, const char* call, cublasStatus_t s) {
  throw Error(str(file, ":", line, ": ", call, " failed: ", cublasGetStatusName(s), ": ",
                  cublasGetStatusString(s)));
}

namespace {

// Left free on the device when the budget is "everything": the CUDA context, cuBLAS's
// workspaces and library kernels live outside the arena.
constexpr uint64_t kDeviceReserve = 1ull << 30;

constexpr int kMinMajor = 8;  // the oldest architecture CMake compiles for (sm_80)

}  // namespace

void set_wait(int device, const std::string& wait) {
  // A thread that waits for the device by spinning holds a CPU for the whole wait: with an
  // executor thread per queue that is up to three CPUs the host's AdamW does not get.
  const unsigned flags = wait == "spin"    ? cudaDeviceScheduleSpin
                         : wait == "yield" ? cudaDeviceScheduleYield
                         : wait == "block" ? cudaDeviceScheduleBlockingSync
                                           : cudaDeviceScheduleAuto;
  FY_CUDA(cudaSetDevice(device));
  const cudaError_t e = cudaSetDeviceFlags(flags);
  if (e == cudaSuccess) {
    spdlog::info("cuda: host threads {} while they wait for device {} (runtime.cuda_wait)", wait,
                 device);
    return;
  }
  cudaGetLastError();  // not sticky: the device stays usable with its earlier flags
  spdlog::warn(
      "cuda: runtime.cuda_wait {} not applied to device {} ({}: {}); the context was "
      "already active, its wait mode stays as it was",
      wait, device, cudaGetErrorName(e), cudaGetErrorString(e));
}

CudaBackend::CudaBackend(int device, uint64_t capacity) : device_(device) {
  bind();
  cudaDeviceProp prop{};
  FY_CUDA(cudaGetDeviceProperties(&prop, device_));
  device_name_ = str(prop.name, ", sm_", prop.major, prop.minor);
  if (prop.major < kMinMajor)
    throw Error(str("CUDA device ", device_, " (", device_name_,
                    ") is older than sm_80, the "
                    "oldest architecture this build compiles for"));
  size_t free_b = 0, total_b = 0;
  FY_CUDA(cudaMemGetInfo(&free_b, &total_b));
  if (capacity == 0) {
    if (free_b <= kDeviceReserve)
      throw Error(str("CUDA device ", device_, " (", prop.name, ") has only ", format_size(free_b),
                      " free; set offload.device_memory explicitly"));
    capacity = free_b - kDeviceReserve;
  }
  capacity = capacity / kAlign * kAlign;
  if (capacity > free_b)
    throw Error(str("offload.device_memory is ", format_size(capacity), " but CUDA device ",
                    device_, " (", prop.name, ") has ", format_size(free_b), " free of ",
                    format_size(total_b)));
  FY_CUDA(cudaMalloc(reinterpret_cast<void**>(&base_), capacity));
  arena_ = ArenaBlocks(capacity, kAlign);

  FY_CUDA(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  FY_CUDA(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
  FY_CUDA(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
  FY_CUDA(cudaEventCreateWithFlags(&h2d_ready_, cudaEventDisableTiming));
  FY_CUDA(cudaEventCreateWithFlags(&d2h_ready_, cudaEventDisableTiming));
  FY_CUDA(cudaEventCreateWithFlags(&zeroed_, cudaEventDisableTiming));
  FY_CUBLAS(cublasCreate(&blas_));
  FY_CUBLAS(cublasSetStream(blas_, compute_));
  // A 16-bit output is rounded once: cuBLAS may otherwise add split-K partial sums in bf16 /
  // fp16 (the weight-gradient GEMMs have K = B T, where it splits).
  FY_CUBLAS(cublasSetMathMode(blas_, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  // An explicit workspace of the size cuBLAS recommends for Hopper on every device (its
  // default pool is 4 MiB before sm_90), so the GEMMs may take the algorithms that need it.
  // Set after cublasSetStream, which resets it; outside the arena, within kDeviceReserve.
  FY_CUDA(cudaMalloc(&blas_workspace_, kBlasWorkspace));
  FY_CUBLAS(cublasSetWorkspace(blas_, blas_workspace_, kBlasWorkspace));
}

CudaBackend::~CudaBackend() {
  // Errors are ignored here: a destructor must not throw, and a failed device is reported
  // by whichever call met it first.
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  cudnn_.reset();
  lt_bias_.reset();
  if (blas_) cublasDestroy(blas_);
  for (cudaEvent_t e : {h2d_ready_, d2h_ready_, zeroed_})
    if (e) cudaEventDestroy(e);
  for (cudaStream_t s : {compute_, h2d_, d2h_})
    if (s) cudaStreamDestroy(s);
  for (cudaEvent_t e : timing_events_) cudaEventDestroy(e);
  cudaFree(scratch_);
  cudaFree(blas_workspace_);
  for (auto& [groups, t] : squares_tables_) cudaFree(t.buf);
  cudaFree(base_);
}

void CudaBackend::bind() const { FY_CUDA(cudaSetDevice(device_)); }

void CudaBackend::timing_start() {
  std::lock_guard<std::mutex> lock(timing_mu_);
  timing_tags_.clear();
  timing_on_ = true;
}

void CudaBackend::timing_mark(int tag) {
  std::lock_guard<std::mutex> lock(timing_mu_);
  if (!timing_on_) return;
  bind();
  if (timing_tags_.size() == timing_events_.size()) {
    cudaEvent_t e;
    FY_CUDA(cudaEventCreate(&e));  // timed (no cudaEventDisableTiming)
    timing_events_.push_back(e);
  }
  FY_CUDA(cudaEventRecord(timing_events_[timing_tags_.size()], compute_));
  timing_tags_.push_back(tag);
}

std::vector<Backend::TimingMark> CudaBackend::timing_stop() {
  std::lock_guard<std::mutex> lock(timing_mu_);
  timing_on_ = false;
  std::vector<TimingMark> out;
  if (timing_tags_.empty()) return out;
  bind();
  FY_CUDA(cudaEventSynchronize(timing_events_[timing_tags_.size() - 1]));
  for (size_t i = 0; i < timing_tags_.size(); ++i) {
    float ms = 0;
    FY_CUDA(cudaEventElapsedTime(&ms, timing_events_[0], timing_events_[i]));
    out.push_back({timing_tags_[i], ms / 1e3});
  }
  return out;
}

std::string CudaBackend::name() const {
  return str("cuda (", device_name_, ", cuBLAS, ", matmul_precision_name(precision_),
             " GEMM inputs",
             storage_ == ElemType::kF32 ? "" : str(", ", elem_type_name(storage_), " tensors"),
             fused_attention() ? str(", ", cudnn_->version(), " attention") : "", ")");
}

void CudaBackend::set_attention_impl(AttentionImpl impl) {
  attention_ = impl;
  // auto with fp32 tensors runs no cuDNN: it is opened when 16-bit tensors first need it.
  if (impl == AttentionImpl::kCudnn || (impl == AttentionImpl::kAuto && storage_ != ElemType::kF32))
    load_cudnn();
}

void CudaBackend::set_bias_epilogue(bool on) {
  // runtime.gemm_bias: epilogue asks for cuBLASLt, so a cuBLASLt that cannot start is an error
  // here, not a quiet return to the broadcast kernel.
  if (!on) {
    lt_bias_.reset();
    return;
  }
  if (lt_bias_) return;
  bind();
  try {
    lt_bias_ = std::make_unique<LtBiasGemm>();
  } catch (const Error& e) {
    throw Error(
        str("runtime.gemm_bias is epilogue, but ", e.what(), " (use runtime.gemm_bias: kernel)"));
  }
}

void CudaBackend::load_cudnn() {
  if (cudnn_) return;
  bind();
  cudnn_ = std::make_unique<CudnnAttention>(compute_);
  if (cudnn_->available()) return;
  if (attention_ == AttentionImpl::kCudnn)
    throw Error(str("runtime.attention is cudnn, but ", cudnn_->why()));
  spdlog::info("attention: the CUDA backend's own kernels ({})", cudnn_->why());
}

bool CudaBackend::fused_attention() const {
  return attention_ != AttentionImpl::kKernels && storage_ != ElemType::kF32 && cudnn_ &&
         cudnn_->available();
}

bool CudaBackend::use_cudnn() {
  if (attention_ == AttentionImpl::kKernels) return false;
  if (storage_ == ElemType::kF32) {
    if (attention_ == AttentionImpl::kCudnn)
      throw Error(
          "runtime.attention is cudnn, but the device's tensors are fp32: cuDNN's fused attention "
          "takes 16-bit tensors (runtime.device_tensors: bf16 or fp16)");
    return false;
  }
  load_cudnn();  // the storage type may have turned 16-bit after set_attention_impl
  return cudnn_->available();
}

void CudaBackend::refused(const char* direction, const std::string& why) {
  ++refusals_;
  std::lock_guard<std::mutex> lock(refused_mu_);
  if (refusals_logged_.insert(str(direction, why)).second)
    spdlog::warn("cuDNN refuses the attention {} ({}); the CUDA backend's own kernels run it",
                 direction, why);
}

// ---- arena -------------------------------------------------------------------------------

void* CudaBackend::alloc(size_t bytes, const std::string& what) {
  uint64_t offset = 0, rounded = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    offset = arena_.take(bytes, what, "budget (offload.device_memory)", &rounded);
  }
  void* p = base_ + offset;
  // Zeroed as the interface promises; queued on the compute stream, which every later
  // kernel follows. Copies wait for it through zeroed_, caller-ordered ones included.
  bind();
  std::lock_guard<std::mutex> lock(zeroed_mu_);
  FY_CUDA(cudaMemsetAsync(p, 0, rounded, compute_));
  FY_CUDA(cudaEventRecord(zeroed_, compute_));
  return p;
}

void CudaBackend::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  FY_CHECK(ptr >= base_ && ptr < base_ + arena_.capacity(),
           "free of a pointer outside the CUDA arena");
  // Kernels still queued that use this block are ahead of any later user of it on the
  // compute stream, so no wait is needed.
  arena_.give_back(static_cast<char*>(ptr) - base_);
}

MemoryStats CudaBackend::memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_.stats();
}

// ---- copies -------------------------------------------------------------------------------

// One copy on a transfer stream: wait for the kernels queued so far (one may still read dst
// or write src), or, where the caller orders the work itself, only for the zeroing of the
// allocations made so far (the caller does not order the arena's memsets); copy; wait for the
// copy.
void CudaBackend::copy_on(cudaStream_t stream, cudaEvent_t ready, std::mutex& mu, void* dst,
                          const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (!bytes) return;
  std::lock_guard<std::mutex> lock(mu);
  bind();
  if (!caller_ordered_) {
    FY_CUDA(cudaEventRecord(ready, compute_));
    FY_CUDA(cudaStreamWaitEvent(stream, ready, 0));
  } else {
    std::lock_guard<std::mutex> zlock(zeroed_mu_);
    FY_CUDA(cudaStreamWaitEvent(stream, zeroed_, 0));
  }
  FY_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream));
  FY_CUDA(cudaStreamSynchronize(stream));
}

void CudaBackend::copy_to_device(void* dst, const void* src, size_t bytes) {
  copy_on(h2d_, h2d_ready_, h2d_mu_, dst, src, bytes, cudaMemcpyHostToDevice);
}

void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  copy_on(d2h_, d2h_ready_, d2h_mu_, dst, src, bytes, cudaMemcpyDeviceToHost);
}

void CudaBackend::zero(void* ptr, size_t bytes) {
  if (!bytes) return;
  bind();
  FY_CUDA(cudaMemsetAsync(ptr, 0, bytes, compute_));
}

void CudaBackend::finish_compute() {
  bind();
  FY_CUDA(cudaStreamSynchronize(compute_));
}

bool CudaBackend::register_host(void* ptr, size_t bytes) {
  if (!ptr || !bytes) return true;
  bind();
  // Pageable memory still works (the driver stages it), only slower: the caller reports a
  // refusal and goes on.
  if (cudaHostRegister(ptr, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  cudaGetLastError();  // clear the error so the next call does not report it
  return false;
}

void CudaBackend::unregister_host(void* ptr) {
  if (!ptr) return;
  bind();
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();  // was never registered
}

void CudaBackend::synchronize() {
  bind();
  for (cudaStream_t s : {compute_, h2d_, d2h_}) FY_CUDA(cudaStreamSynchronize(s));
}

// ---- GEMMs --------------------------------------------------------------------------------

void CudaBackend::gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A,
                       int lda, long long sa, const void* B, int ldb, long long sb, float beta,
                       void* C, int ldc, long long sc, int batch, bool mixed, ElemType ab,
                       ElemType c) {
  if (M == 0 || N == 0 || batch == 0) return;
  // cuBLAS is column-major; a row-major X with row stride ld is the column-major X^T with
  // the same ld. So row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap
  // the operands and the dimensions M and N, keep the transposes.
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // fp32 accumulation
  if (ab == ElemType::kF32 && mixed && precision_ == MatmulPrecision::kBf16)
    compute = CUBLAS_COMPUTE_32F_FAST_16BF;
  if (ab == ElemType::kF32 && mixed && precision_ == MatmulPrecision::kFp16)
    compute = CUBLAS_COMPUTE_32F_FAST_16F;
  const cudaDataType_t tab = blas_type(ab), tc = blas_type(c);
  const cublasOperation_t opa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  std::lock_guard<std::mutex> lock(blas_mu_);
  bind();
  if (batch == 1) {
    FY_CUBLAS(cublasGemmEx(blas_, opb, opa, N, M, K, &alpha, B, tab, ldb, A, tab, lda, &beta, C, tc,
                           ldc, compute, CUBLAS_GEMM_DEFAULT));
  } else {
    FY_CUBLAS(cublasGemmStridedBatchedEx(blas_, opb, opa, N, M, K, &alpha, B, tab, ldb, sb, A, tab,
                                         lda, sa, &beta, C, tc, ldc, sc, batch, compute,
                                         CUBLAS_GEMM_DEFAULT));
  }
}

namespace {

// out(N,OC) rows set to bias(OC), so the GEMM can add into them with beta = 1: one row per
// blockIdx.y (strided), its columns over x, in 16-byte vectors when `vec` (OC a multiple of
// the vector, both pointers aligned).
template <typename T>
__global__ void broadcast_rows(T* out, const T* bias, int N, int OC, bool vec) {
  constexpr int K = Vec16<T>::kN;
  const int c0 = blockIdx.x * blockDim.x + threadIdx.x;
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    T* row = out + size_t(n) * OC;
    if (vec) {
      for (int j = c0; j < OC / K; j += gridDim.x * blockDim.x)
        reinterpret_cast<Vec16<T>*>(row)[j] = reinterpret_cast<const Vec16<T>*>(bias)[j];
    } else {
      for (int c = c0; c < OC; c += gridDim.x * blockDim.x) row[c] = bias[c];
    }
  }
}

// part(by, c) = sum of x(n, c) over the rows n = by, by + gridDim.y, ... (one slice per
// blockIdx.y), each thread K adjacent columns (16 bytes where `vec`: C a multiple of the
// vector, x aligned), each column's sum in row order; column_slices_add then adds the slices
// in order. No atomics: the result is the same bits on every run.
template <typename T, int K>
__global__ void column_slices(float* part, const T* x, int N, int C) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * K;
  if (c >= C) return;
  float s[K] = {};
  for (int n = blockIdx.y; n < N; n += gridDim.y) {
    if (K > 1) {
      const Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(x + size_t(n) * C + c);
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] += ld(v.v[k]);
    } else {
      s[0] += ld(x[size_t(n) * C + c]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) part[size_t(blockIdx.y) * C + c + k] = s[k];
}

}  // namespace

void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    bind();
    if (scratch_) FY_CUDA(cudaFree(scratch_));  // waits for every kernel that used it
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    FY_CUDA(cudaMalloc(reinterpret_cast<void**>(&scratch_), bytes));
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

void CudaBackend::add_column_sums(void* out, const void* x, int N, int C) {
  if (N == 0 || C == 0) return;
  const int slices = wide_reduce_slices(N, C);
  std::lock_guard<std::mutex> lock(scratch_mu_);
  float* part = static_cast<float*>(scratch(sizeof(float) * slices * size_t(C)));
  const unsigned cols = (C + kEltThreads - 1) / kEltThreads;
  FY_TYPED(E, {
    constexpr int K = Vec16<E>::kN;
    if (C % K == 0 && aligned16(x)) {
      const unsigned vcols = (C / K + kEltThreads - 1) / kEltThreads;
      FY_LAUNCH((column_slices<E, K>), dim3(vcols, slices), kEltThreads, part,
                static_cast<const E*>(x), N, C);
    } else {
      FY_LAUNCH((column_slices<E, 1>), dim3(cols, slices), kEltThreads, part,
                static_cast<const E*>(x), N, C);
    }
    FY_LAUNCH(column_slices_add<E>, slices_add_grid(C), slices_add_block(), static_cast<E*>(out),
              part, slices, C);
  });
}

void CudaBackend::matmul_forward(void* out, const void* in, const void* w, const void* bias, int N,
                                 int IC, int OC) {
  bind();
  // runtime.gemm_bias epilogue, 16-bit tensors: the bias in the GEMM's epilogue, where cuBLASLt
  // has an algorithm for the shape (each output rounded once from the fp32 product plus the
  // bias, as below); else, and by default, the broadcast kernel and cuBLAS's GEMM.
  if (lt_bias_ && bias && N > 0 && OC > 0 && IC > 0 && storage_ != ElemType::kF32) {
    std::lock_guard<std::mutex> lock(blas_mu_);
    if (lt_bias_->run(compute_, blas_workspace_, kBlasWorkspace, blas_type(storage_), out, in, w,
                      bias, N, IC, OC)) {
      ++bias_epilogues_;
      return;
    }
  }
  float beta = 0.0f;
  if (bias && N > 0 && OC > 0) {
    FY_TYPED(E, {
      constexpr int K = Vec16<E>::kN;
      const bool vec = OC % K == 0 && all_aligned16(out, bias);
      const int per_row = vec ? OC / K : OC;
      const unsigned cols =
          static_cast<unsigned>(std::min(4, (per_row + kEltThreads - 1) / kEltThreads));
      const unsigned rows = static_cast<unsigned>(std::min(N, 4096));
      FY_LAUNCH(broadcast_rows<E>, dim3(cols, rows), kEltThreads, static_cast<E*>(out),
                static_cast<const E*>(bias), N, OC, vec);
    });
    beta = 1.0f;
  }
  gemm(false, true, N, OC, IC, 1.0f, in, IC, 0, w, IC, 0, beta, out, OC, 0, 1, true, storage_,
       storage_);
}

void CudaBackend::matmul_backward(void* din, void* dw, void* dbias, const void* dout,
                                  const void* in, const void* w, int N, int IC, int OC) {
  // dw first: din may alias in (backend.h); both GEMMs are on the compute stream, in order.
  if (dw)
    gemm(true, false, OC, IC, N, 1.0f, dout, OC, 0, in, IC, 0, 1.0f, dw, IC, 0, 1, true, storage_,
         storage_);
  if (din)
    gemm(false, false, N, IC, OC, 1.0f, dout, OC, 0, w, IC, 0, 0.0f, din, IC, 0, 1, true, storage_,
         storage_);
  if (dbias) add_column_sums(dbias, dout, N, OC);
}

}  // namespace fuyou::cuda

// ---- entry points (include/fuyou/cuda.h) ----------------------------------------------------

namespace fuyou {

bool cuda_built() { return true; }

int cuda_usable_devices(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    if (why)
      *why = str(e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice
                     ? "no usable CUDA driver or device"
                     : "CUDA is not usable",
                 " (cudaGetDeviceCount: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")");
    return 0;
  }
  int usable = 0;
  std::string skipped;
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
    if (prop.major >= cuda::kMinMajor) {
      ++usable;
    } else {
      skipped += str(skipped.empty() ? "" : ", ", "device ", d, " ", prop.name, " is sm_",
                     prop.major, prop.minor);
    }
  }
  if (usable == 0 && why)
    *why = n == 0 ? std::string("no CUDA device (cudaGetDeviceCount returned 0)")
                  : str("no CUDA device of compute capability 8.0 or newer (", skipped,
                        "); this build compiles for sm_80 and newer");
  return usable;
}

std::string cudnn_attention_graph_check(ElemType t, int B, int T, int C, int H) {
  return cuda::CudnnAttention::check_graphs(t, B, T, C, H);
}

std::unique_ptr<Backend> make_cuda_backend(int device, uint64_t device_memory,
                                           const std::string& wait) {
  std::string why;
  if (cuda_usable_devices(&why) <= device)
    throw Error(str("CUDA device ", device,
                    " is not usable: ", why.empty() ? std::string("fewer usable devices") : why));
  if (wait != "auto") cuda::set_wait(device, wait);
  return std::make_unique<cuda::CudaBackend>(device, device_memory);
}

}  // namespace fuyou
