// Reductions over a whole gradient, shared by the host step (src/runtime/trainer.cc), the CPU
// backend and the CUDA kernels, so the clipping norm and the fp32 sums over micro-batches,
// and with them every update, have the same bits wherever the gradient is.
//
// The sum of squares:
//
// A group of n elements (a parameter group: the embedding, one layer, the final norm) is cut
// into blocks of kSumBlock elements from its start. Within a block, element lo + i goes to
// lane i % kSumLanes; each lane adds x * x in double in element order (a product rounded,
// then a sum rounded: no fused multiply-add); the lanes are combined pairwise by
// combine_lanes. A group's sum is its first block's sum, plus each further block's in
// order; a step's sum of squares is 0 plus each group's sum in group order. Eight
// independent chains instead of one let the adds overlap (one chain runs at one add's
// latency per element), and the blocks run in parallel without changing a bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuyou/elem_type.h"
#include "kernels/common/element_math.h"

namespace fuyou::math {

constexpr size_t kSumBlock = size_t(1) << 16;
constexpr int kSumLanes = 8;

FY_HD double combine_lanes(const double* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Blocks of a group of n elements.
FY_HD size_t sum_blocks(size_t n) { return (n + kSumBlock - 1) / kSumBlock; }

#if !defined(__CUDACC__)
// Element i of an array stored as t, widened to fp32 / x rounded once to t and stored there
// (nearest even): what the host optimizer and the CPU backend's device optimizer read and
// write.
inline float load_elem(const void* p, ElemType t, size_t i) {
  switch (t) {
    case ElemType::kF32:
      return static_cast<const float*>(p)[i];
    case ElemType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case ElemType::kF16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

inline void store_elem(void* p, ElemType t, size_t i, float x) {
  switch (t) {
    case ElemType::kF32:
      static_cast<float*>(p)[i] = x;
      break;
    case ElemType::kBF16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(x);
      break;
    case ElemType::kF16:
      static_cast<uint16_t*>(p)[i] = float_to_fp16(x);
      break;
  }
}

// The host's form: one block [lo, hi), then a group of n elements, blocks in parallel
// (OpenMP) and added in order. Host code is compiled without fused multiply-adds (x86-64's
// baseline has none), so each lane's x * x is rounded before it is added, as the CUDA
// kernel does explicitly.
template <typename Widen>
double block_sum_squares(size_t lo, size_t hi, Widen widen) {
  double lane[kSumLanes] = {};
  size_t i = lo;
  for (; i + kSumLanes <= hi; i += kSumLanes)
    for (int l = 0; l < kSumLanes; ++l) {
      const double x = widen(i + l);
      lane[l] += x * x;
    }
  for (; i < hi; ++i) {
    const double x = widen(i);
    lane[(i - lo) % kSumLanes] += x * x;
  }
  return combine_lanes(lane);
}

template <typename Widen>
double sum_squares(size_t n, Widen widen) {
  const size_t blocks = sum_blocks(n);
  if (blocks <= 1) return n ? block_sum_squares(0, n, widen) : 0.0;
  std::vector<double> sums(blocks);
#pragma omp parallel for schedule(static) if (blocks >= 8)
  for (ptrdiff_t b = 0; b < static_cast<ptrdiff_t>(blocks); ++b) {
    const size_t lo = static_cast<size_t>(b) * kSumBlock;
    sums[b] = block_sum_squares(lo, lo + kSumBlock < n ? lo + kSumBlock : n, widen);
  }
  double s = 0;
  for (double x : sums) s += x;
  return s;
}

// One group's sum of n elements of g, stored as `type`.
inline double group_sum_squares(const void* g, ElemType type, size_t n) {
  if (type == ElemType::kF32) {
    const float* f = static_cast<const float*>(g);
    return sum_squares(n, [f](size_t i) { return static_cast<double>(f[i]); });
  }
  const uint16_t* h = static_cast<const uint16_t*>(g);
  if (type == ElemType::kBF16)
    return sum_squares(n, [h](size_t i) { return static_cast<double>(bf16_to_float(h[i])); });
  return sum_squares(n, [h](size_t i) { return static_cast<double>(fp16_to_float(h[i])); });
}

// The fp32 sum of a gradient over micro-batches: sum = widen(g) for the first, else
// sum[i] += widen(g[i]), element by element, so the threads' shares do not change a bit.
inline void accumulate_fp32(float* sum, const void* g, ElemType type, size_t n, bool first) {
  if (first) return widen_from(type, sum, g, n);  // exact: the sum is the gradient
  const ptrdiff_t count = static_cast<ptrdiff_t>(n);
  const bool parallel = n >= (size_t(1) << 16);
  if (type == ElemType::kF32) {
    const float* f = static_cast<const float*>(g);
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += f[i];
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(g);
  if (type == ElemType::kBF16) {
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += bf16_to_float(h[i]);
  } else {
#pragma omp parallel for schedule(static) if (parallel)
    for (ptrdiff_t i = 0; i < count; ++i) sum[i] += fp16_to_float(h[i]);
  }
}
#endif

}  // namespace fuyou::math
