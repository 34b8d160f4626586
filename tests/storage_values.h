// Values as the device's storage types hold them (runtime.device_tensors): one set of
// conversions for every test that builds or checks 16-bit tensors, CPU and CUDA alike.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuyou/elem_type.h"
#include "kernels/common/element_math.h"

namespace fuyou::test {

// f rounded to the 16-bit type t (bf16 or fp16, nearest even) / the 16 bits widened back.
inline uint16_t rnd16(ElemType t, float f) {
  return t == ElemType::kBF16 ? math::float_to_bf16(f) : math::float_to_fp16(f);
}
inline float wid16(ElemType t, uint16_t h) {
  return t == ElemType::kBF16 ? math::bf16_to_float(h) : math::fp16_to_float(h);
}

// f as t stores it, widened back to fp32 (fp32: f itself).
inline float as_stored(ElemType t, float f) {
  return t == ElemType::kF32 ? f : wid16(t, rnd16(t, f));
}

// The unit roundoff of round-to-nearest in t, 2^-p for p significant bits: 2^-24 for fp32,
// 2^-8 for bf16, 2^-11 for fp16 (half a unit in the last place of a value in [1, 2)).
inline double unit_roundoff(ElemType t) {
  return t == ElemType::kF32 ? FLT_EPSILON / 2 : std::ldexp(1.0, t == ElemType::kBF16 ? -8 : -11);
}

// The bytes of `values` as a tensor of type t: what copy_to_device takes.
inline std::vector<char> stored_bytes(const std::vector<float>& values, ElemType t) {
  std::vector<char> out(elem_type_size(t) * values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (t == ElemType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = rnd16(t, values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

}  // namespace fuyou::test
