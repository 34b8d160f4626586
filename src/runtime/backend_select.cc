// runtime.backend: which backend runs, and the sentence the first log line says about why.
// auto takes the GPU when this build has the CUDA backend and a device is usable, else the
// CPU; cuda without a usable device is an error naming the CUDA call that said no.
#include "fuyou/backend_select.h"

#include <omp.h>

#include <thread>

#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/hardware.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"
#include "kernels/emulated/emulated_backend.h"

namespace fuyou {
namespace {

// runtime.threads beyond this many per CPU the process may use is refused.
constexpr int kMaxThreadsPerCpu = 4;

}  // namespace

#if !defined(FUYOU_WITH_CUDA)
// Built without the CUDA toolkit: the entry points of include/fuyou/cuda.h say so.
bool cuda_built() { return false; }

int cuda_usable_devices(std::string* why) {
  if (why) *why = "this build has no CUDA backend (configured without the CUDA toolkit)";
  return 0;
}

std::unique_ptr<Backend> make_cuda_backend(int, uint64_t, const std::string&) {
  throw Error(
      "this build has no CUDA backend (configured without the CUDA toolkit; install "
      "it and rebuild to get one)");
}

std::string cudnn_attention_graph_check(ElemType, int, int, int, int) {
  return "this build has no CUDA backend (configured without the CUDA toolkit)";
}

LtGemmTiming cublaslt_gemm_time(const LtGemmShape&, const LtGemmOperands&, int) {
  throw Error("this build has no CUDA backend (configured without the CUDA toolkit)");
}
#endif

void page_lock_host(Backend& be, const std::vector<std::pair<void*, size_t>>& buffers,
                    std::vector<void*>* locked, const char* whose) {
  uint64_t refused = 0;
  for (auto [p, n] : buffers) {
    if (!p || !n) continue;
    if (be.register_host(p, n))
      locked->push_back(p);
    else
      refused += n;
  }
  if (refused)
    spdlog::warn(
        "{}: {} of {} could not be page-locked (locked-memory limit?); copies from them run slower",
        be.name(), format_size(refused), whose);
}

std::unique_ptr<Backend> make_backend(const Config& cfg, std::string* reason) {
  const RuntimeConfig& runtime = cfg.runtime;
  // Refused before any thread starts: thousands of threads on a few CPUs only contend for them,
  // and the OpenMP runtime may fail to create them at all.
  const int procs = omp_get_num_procs();
  if (runtime.threads > kMaxThreadsPerCpu * procs)
    throw ConfigError(str("runtime.threads is ", runtime.threads, " but this process may run on ",
                          procs, " CPU(s); at most ", kMaxThreadsPerCpu, " threads per CPU (",
                          kMaxThreadsPerCpu * procs, ") are accepted (0 uses one per CPU)"));
  const uint64_t device_memory = cfg.offload.device_memory;
  std::unique_ptr<Backend> backend;
  std::string why;
  if (runtime.backend == "cuda" || runtime.backend == "auto") {
    std::string no_gpu;
    if (cuda_usable_devices(&no_gpu) > 0) {
      backend = make_cuda_backend(0, device_memory, runtime.cuda_wait);
      why = str("runtime.backend is ", runtime.backend, " and CUDA device 0 is usable");
    } else if (runtime.backend == "cuda") {
      throw Error(str("runtime.backend is 'cuda' but ", no_gpu,
                      "; use runtime.backend: cpu (or auto, which falls back to the CPU)"));
    } else {
      why = str("runtime.backend is auto and ", no_gpu);
    }
  } else if (runtime.backend == "cpu-streams") {
    StreamOptions so;
    so.max_delay_us = runtime.stream_delay_us;
    so.seed = runtime.seed;
    backend = make_cpu_stream_backend(runtime.threads, device_memory, so);
    why = "runtime.backend is cpu-streams (the CPU backend under CUDA's ordering rules, for tests)";
  } else if (runtime.backend == "emulated") {
    backend = make_emulated_backend(cfg);
    why = str("runtime.backend is emulated: no arithmetic, the time of ", cfg.offload.hardware,
              " at ", runtime.emulated_scale, "x its throughput; losses are NaN");
  } else {
    why = "runtime.backend is cpu";
  }
  if (!backend) backend = make_cpu_backend(runtime.threads, device_memory);
  apply_precision(*backend, runtime);
  if (reason) *reason = str("backend ", backend->name(), ": ", why);
  return backend;
}

ElemType device_tensor_type(const RuntimeConfig& runtime) {
  if (runtime.device_tensors == "bf16") return ElemType::kBF16;
  if (runtime.device_tensors == "fp16") return ElemType::kF16;
  return ElemType::kF32;
}

// runtime.precision for a backend: auto is bf16 on a GPU, emulated or not (tensor cores), and
// fp32 on the CPU (the precision the PyTorch fixtures check).
void apply_precision(Backend& be, const RuntimeConfig& runtime) {
  MatmulPrecision p =
      be.kind() != BackendKind::kCpu ? MatmulPrecision::kBf16 : MatmulPrecision::kFp32;
  if (runtime.precision == "fp32") p = MatmulPrecision::kFp32;
  if (runtime.precision == "bf16") p = MatmulPrecision::kBf16;
  if (runtime.precision == "fp16") p = MatmulPrecision::kFp16;
  be.set_matmul_precision(p);
  be.set_storage_type(device_tensor_type(runtime));
  be.set_attention_impl(runtime.attention == "cudnn"     ? AttentionImpl::kCudnn
                        : runtime.attention == "kernels" ? AttentionImpl::kKernels
                                                         : AttentionImpl::kAuto);
  be.set_bias_epilogue(runtime.gemm_bias == "epilogue");
}

std::unique_ptr<Backend> make_emulated_backend(const Config& cfg) {
  if (cfg.offload.hardware.empty())
    throw ConfigError(
        "runtime.backend is emulated but offload.hardware names no profile: set it to the GPU to "
        "emulate (e.g. configs/hardware/rtx4090.yaml)");
  emulated::EmulatedOptions o;
  o.gpu = load_hardware_profile(cfg.offload.hardware);
  o.scale = cfg.runtime.emulated_scale;
  o.gemm_size = gemm_work_size(cfg.model, cfg.schedule.micro_batch);
  // The device holds the tensors the run stores (fp32), as a GPU of that memory would.
  o.capacity = cfg.offload.device_memory ? cfg.offload.device_memory : o.gpu.device_memory;
  o.threads = cfg.runtime.threads > 0 ? cfg.runtime.threads
                                      : static_cast<int>(std::thread::hardware_concurrency());
  return std::make_unique<emulated::EmulatedBackend>(o);
}

}  // namespace fuyou
