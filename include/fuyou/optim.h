// AdamW with bias correction and decoupled weight decay, and the learning-rate schedule.
// The optimizer always runs on the host over fp32 master weights, as the engine's design
// puts it (the device only ever sees the weights it computes with).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/elem_type.h"

namespace fuyou {

struct AdamWStep {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;  // already 0 for tensors without decay
  int64_t t;           // 1-based step count, for bias correction
};

// Instruction-set paths of the optimizer kernels. kAuto picks the widest the CPU has.
enum class SimdPath { kAuto, kScalar, kAvx2, kAvx512 };
const char* simd_path_name(SimdPath p);
SimdPath best_simd_path();

// One fused pass over n elements: reads fp32 master, m, v and the gradient (of grad_type),
// writes fp32 master, m, v and, when lowp is non-null, the updated weights as lowp_type
// (round to nearest even) for the next forward. The gradient is multiplied by grad_scale
// first (global-norm clipping, or undoing an fp16 loss scale). Every path gives
// bit-identical results to the scalar reference (math::adamw_element). Threads: OpenMP.
struct AdamWArgs {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  ElemType grad_type = ElemType::kF32;
  void* lowp = nullptr;
  ElemType lowp_type = ElemType::kBF16;
  size_t n = 0;
  float grad_scale = 1.0f;
};
void adamw_update(const AdamWArgs& a, const AdamWStep& s, SimdPath path = SimdPath::kAuto);
// Several pieces of one update in one parallel pass: piece i is pieces[i] with weight decay
// decay[i] in place of s.weight_decay. Element for element what adamw_update gives each piece
// alone, without a parallel region per piece (a rows-first embedding update has thousands of
// one-row ranges, each too short to pay for one).
void adamw_update(const AdamWArgs* pieces, const float* decay, size_t count, const AdamWStep& s,
                  SimdPath path = SimdPath::kAuto);

// The constants of step s for AdamW on the device (Backend::adamw), computed exactly as
// adamw_update computes its own, so both give the same bits.
void set_adamw_constants(DeviceAdamW* a, const AdamWStep& s, float weight_decay, float grad_scale);

// Convenience for fp32 gradients without a low-precision copy (the CPU backend's case).
void adamw_update(float* param, float* m, float* v, const float* grad, size_t n,
                  const AdamWStep& s);

// Sum of squares (in double) and count of non-finite values of a gradient: the fused pass
// that global-norm clipping and fp16 overflow checks need before any update.
struct GradStats {
  double sum_squares = 0;
  uint64_t nonfinite = 0;
};
GradStats grad_stats(const void* grad, ElemType type, size_t n, SimdPath path = SimdPath::kAuto);

// Bytes the update moves per parameter: read master, m, v, grad; write master, m, v, lowp.
size_t adamw_bytes_per_param(ElemType grad_type, bool with_lowp, ElemType lowp_type);

// Warmup, then schedule.lr_decay: lr(s) = max_lr (s+1)/warmup for s < warmup, then with
// p = (s - warmup) / (steps - warmup): cosine min_lr + (max_lr - min_lr) (1 + cos(pi p)) / 2,
// linear max_lr + (min_lr - max_lr) p, constant max_lr.
double learning_rate(const OptimizerConfig& o, const ScheduleConfig& s, int64_t step);

}  // namespace fuyou
