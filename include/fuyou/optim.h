// AdamW with bias correction and decoupled weight decay, and the learning-rate schedule.
// The optimizer always runs on the host over fp32 master weights, as the engine's design
// puts it (the device only ever sees the weights it computes with).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fuyou/config.h"

namespace fuyou {

struct AdamWStep {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;  // already 0 for tensors without decay
  int64_t t;           // 1-based step count, for bias correction
};

// One AdamW update of n elements, the same arithmetic as torch.optim.AdamW:
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
void adamw_update(float* param, float* m, float* v, const float* grad, size_t n,
                  const AdamWStep& s);

// Warmup then cosine decay: lr(s) = max_lr (s+1)/warmup for s < warmup, then
// min_lr + (max_lr - min_lr) (1 + cos(pi (s - warmup) / (steps - warmup))) / 2.
double learning_rate(const OptimizerConfig& o, const ScheduleConfig& s, int64_t step);

}  // namespace fuyou
