#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

#include <cstdlib>
#include <cstring>

#include "fuyou/error.h"
#include "fuyou/sizes.h"
#include "fuyou/threads.h"
#include "kernels/cpu/gemm.h"

namespace fuyou::cpu {

namespace {
int thread_team(int threads) {
  FY_CHECK(threads >= 1, "threads ", threads);
  return set_thread_team(threads);
}
}  // namespace

CpuBackend::CpuBackend(int threads, uint64_t capacity)
    : threads_(thread_team(threads)), k_(threads_), capacity_(capacity) {}

CpuBackend::~CpuBackend() {
  for (auto& [ptr, size] : sizes_) std::free(ptr);
}

std::string CpuBackend::name() const {
  const MatmulPrecision p = k_.matmul_precision();
  return str(
      "cpu (", threads_, " threads, ", gemm_library_name(),
      storage_ == ElemType::kF32 ? "" : str(", ", elem_type_name(storage_), " tensors"),
      p == MatmulPrecision::kBf16
          ? (bf16_gemm_native() ? ", bf16 GEMM inputs"
                                : ", bf16 GEMM inputs (fp32 GEMM: no AVX-512 bf16 matmul here)")
      : p == MatmulPrecision::kFp16 ? ", fp16 GEMM inputs (emulated)"
                                    : "",
      ")");
}

// fp16 runs at fp32 speed (kernels/cpu/gemm_lowp.cc): it is here so fp16 training and its
// loss scaling run, and are tested, without a GPU.
void CpuBackend::set_matmul_precision(MatmulPrecision p) { k_.set_matmul_precision(p); }

void CpuBackend::set_storage_type(ElemType t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (t != storage_ && used_ != 0)
    throw Error("the CPU backend's storage type changes only before anything is allocated");
  storage_ = t;
}

void* CpuBackend::alloc(size_t bytes, const std::string& what) {
  size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ != 0 && used_ + rounded > capacity_)
      throw Error(str("device memory: ", what, " needs ", format_size(rounded), " but only ",
                      format_size(capacity_ - used_), " of the ", format_size(capacity_),
                      " budget (offload.device_memory) is free"));
    used_ += rounded;
    peak_ = std::max(peak_, used_);
  }
  void* p = std::aligned_alloc(64, rounded);
  if (!p)
    throw Error(
        str("device memory: out of host memory allocating ", format_size(rounded), " for ", what));
  std::memset(p, 0, rounded);
  std::lock_guard<std::mutex> lock(mu_);
  sizes_[p] = rounded;
  return p;
}

void CpuBackend::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sizes_.find(ptr);
  FY_CHECK(it != sizes_.end(), "free of a pointer this backend did not allocate");
  used_ -= it->second;
  sizes_.erase(it);
  std::free(ptr);
}

MemoryStats CpuBackend::memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {capacity_, used_, peak_};
}

void CpuBackend::copy_to_device(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}
void CpuBackend::zero(void* ptr, size_t bytes) { std::memset(ptr, 0, bytes); }

}  // namespace fuyou::cpu

namespace fuyou {

std::unique_ptr<Backend> make_cpu_backend(int threads, uint64_t device_memory) {
  if (threads <= 0) threads = omp_get_num_procs();
  return std::make_unique<cpu::CpuBackend>(threads, device_memory);
}

const char* matmul_precision_name(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::kFp32:
      return "fp32";
    case MatmulPrecision::kBf16:
      return "bf16";
    case MatmulPrecision::kFp16:
      return "fp16";
  }
  return "?";
}

void Backend::set_attention_impl(AttentionImpl impl) {
  if (impl == AttentionImpl::kCudnn)
    throw Error(str("runtime.attention is cudnn, but backend ", name(),
                    " has no cuDNN attention (it runs on the CUDA backend with 16-bit tensors)"));
}

void Backend::set_bias_epilogue(bool on) {
  if (on)
    throw Error(str("runtime.gemm_bias is epilogue, but backend ", name(),
                    " has no GEMM epilogue (it runs on the CUDA backend with 16-bit tensors)"));
}

void Backend::rope_forward_at(void*, int, int, int, int, int, const RopeTable&) {
  throw Error(str("backend ", name(),
                  " has no rope_forward_at (decoding with a key/value cache runs on the cpu "
                  "and cuda backends)"));
}

void Backend::attention_decode(void*, void*, void*, const void*, int, int, int, int, int) {
  throw Error(str("backend ", name(),
                  " has no attention_decode (decoding with a key/value cache runs on the cpu "
                  "and cuda backends)"));
}

// make_backend (runtime.backend cpu | cuda | auto) is in src/runtime/backend_select.cc.

}  // namespace fuyou
