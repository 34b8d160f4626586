// Element types of tensors: what the device stores its tensors as (Backend::storage_type,
// runtime.device_tensors) and what the optimizer reads gradients as and writes working
// weights as (include/fuyou/optim.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fuyou {

enum class ElemType { kF32, kBF16, kF16 };
const char* elem_type_name(ElemType t);  // "f32", "bf16", "f16"
size_t elem_type_size(ElemType t);       // bytes per element

// dst[i] = src[i] rounded to t / widened from t to fp32: bf16 (nearest even; NaN stays NaN),
// fp16 (nearest even, overflow to inf, subnormals kept) or fp32 (a copy); vectorised per
// instruction set, over OpenMP threads for large n (kernels/cpu/stage.cc).
void round_to(ElemType t, void* dst, const float* src, size_t n);
void widen_from(ElemType t, float* dst, const void* src, size_t n);

}  // namespace fuyou
