// A backend from a run's configuration: which one runtime.backend picks, and the precision,
// storage type and attention the runtime keys set on it. The backends themselves
// (include/fuyou/backend.h) know nothing of configs; this is the runtime's side.
#pragma once

#include <memory>
#include <string>

#include "fuyou/backend.h"
#include "fuyou/config.h"

namespace fuyou {

// Picks and creates the backend for runtime.backend (cpu | cuda | auto | cpu-streams | emulated),
// its device memory offload.device_memory. `reason` receives a sentence saying which backend was
// chosen and why (for the first log line).
std::unique_ptr<Backend> make_backend(const Config& cfg, std::string* reason);

// The emulated device of runtime.backend: emulated, emulating the GPU of offload.hardware at
// runtime.emulated_scale (kernels/emulated/emulated_backend.h).
std::unique_ptr<Backend> make_emulated_backend(const Config& cfg);

// runtime.device_tensors as an element type.
ElemType device_tensor_type(const RuntimeConfig& runtime);

// Sets the backend's GEMM precision from runtime.precision (auto: bf16 on CUDA, fp32 on CPU),
// its storage type from runtime.device_tensors and its attention from runtime.attention.
void apply_precision(Backend& be, const RuntimeConfig& runtime);

}  // namespace fuyou
