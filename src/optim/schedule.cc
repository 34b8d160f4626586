#include <cmath>

#include "fuyou/optim.h"

namespace fuyou {

double learning_rate(const OptimizerConfig& o, const ScheduleConfig& s, int64_t step) {
  if (step < s.warmup_steps) return o.lr * static_cast<double>(step + 1) / s.warmup_steps;
  int64_t span = s.steps - s.warmup_steps;
  if (span <= 0) return o.lr;
  double progress = static_cast<double>(step - s.warmup_steps) / span;
  if (progress > 1) progress = 1;
  if (s.lr_decay == "constant") return o.lr;
  if (s.lr_decay == "linear") return o.lr + (o.min_lr - o.lr) * progress;
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace fuyou
