// runtime.backend: which backend runs, and the sentence the first log line says about why.
// auto takes the GPU when this build has the CUDA backend and a device is usable, else the
// CPU; cuda without a usable device is an error naming the CUDA call that said no.
#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/cuda.h"
#include "fuyou/error.h"
#include "fuyou/log.h"
#include "fuyou/sizes.h"

namespace fuyou {

#if !defined(FUYOU_WITH_CUDA)
// Built without the CUDA toolkit: the entry points of include/fuyou/cuda.h say so.
bool cuda_built() { return false; }

int cuda_usable_devices(std::string* why) {
  if (why) *why = "this build has no CUDA backend (configured without the CUDA toolkit)";
  return 0;
}

std::unique_ptr<Backend> make_cuda_backend(int, uint64_t) {
  throw Error(
      "this build has no CUDA backend (configured without the CUDA toolkit; install "
      "it and rebuild to get one)");
}

std::string cudnn_attention_graph_check(ElemType, int, int, int, int) {
  return "this build has no CUDA backend (configured without the CUDA toolkit)";
}
#endif

void page_lock_host(Backend& be, const std::vector<std::pair<void*, size_t>>& buffers, std::vector<void*>* locked,
                    const char* whose) {
  uint64_t refused = 0;
  for (auto [p, n] : buffers) {
    if (!p || !n) continue;
    if (be.register_host(p, n)) locked->push_back(p);
    else refused += n;
  }
  if (refused)
    spdlog::warn("{}: {} of {} could not be page-locked (locked-memory limit?); copies from them run slower",
                 be.name(), format_size(refused), whose);
}

std::unique_ptr<Backend> make_backend(const Config& cfg, std::string* reason) {
  const RuntimeConfig& runtime = cfg.runtime;
  const uint64_t device_memory = cfg.offload.device_memory;
  std::unique_ptr<Backend> backend;
  std::string why;
  if (runtime.backend == "cuda" || runtime.backend == "auto") {
    std::string no_gpu;
    if (cuda_usable_devices(&no_gpu) > 0) {
      backend = make_cuda_backend(0, device_memory);
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
    why = str("runtime.backend is emulated: no arithmetic, the time of ", cfg.offload.hardware, " at ",
              runtime.emulated_scale, "x its throughput; losses are NaN");
  } else {
    why = "runtime.backend is cpu";
  }
  if (!backend) backend = make_cpu_backend(runtime.threads, device_memory);
  apply_precision(*backend, runtime);
  if (reason) *reason = str("backend ", backend->name(), ": ", why);
  return backend;
}

}  // namespace fuyou
