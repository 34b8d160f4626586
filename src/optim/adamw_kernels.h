// Internal: the per-ISA AdamW and gradient-statistics loops over [begin, end). Each handles
// whole vectors and finishes the remainder with the scalar reference, so results do not
// depend on where block boundaries fall.
#pragma once

#include "fuyou/optim.h"
#include "kernels/common/element_math.h"

namespace fuyou::optim_detail {

constexpr size_t kBlock = 4096;  // elements per work item; a multiple of every vector width
// Work items a thread claims at a time (OpenMP schedule(dynamic, kClaimItems)), in both AdamW
// kernels: 128K elements, tens of microseconds. Claiming rather than a fixed share keeps the
// update going at the pace of the CPUs it gets: beside one busy-looping process on 2 vCPUs
// (as the executor's threads spin while they wait for a GPU) the int8 update ran 1.2-1.5x and
// the fp32 one 1.25x faster than with equal shares, and alone as fast (docs/performance.md).
// Each element's result depends on nothing but its index, so the bits do not change.
constexpr int kClaimItems = 32;

// The constants of step s that every piece shares (grad_scale and decay are per piece: 1 here).
math::AdamWConsts step_consts(const AdamWStep& s);

float load_grad(const void* g, ElemType t, size_t i);
void store_lowp(void* out, ElemType t, size_t i, float x);

void adamw_scalar(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end);
void adamw_avx2(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end);
void adamw_avx512(const AdamWArgs& a, const math::AdamWConsts& k, size_t begin, size_t end);

void grad_stats_scalar(const void* g, ElemType t, size_t begin, size_t end, GradStats* out);
void grad_stats_avx512(const void* g, ElemType t, size_t begin, size_t end, GradStats* out);

}  // namespace fuyou::optim_detail
