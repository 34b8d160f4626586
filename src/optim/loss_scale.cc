#include "fuyou/loss_scale.h"

#include <algorithm>
#include <cmath>

#include "fuyou/error.h"

namespace fuyou {

DynamicLossScaler::DynamicLossScaler(const LossScaleConfig& cfg) : cfg_(cfg), scale_(cfg.initial) {
  FY_CHECK(cfg.min_scale > 0 && cfg.min_scale <= cfg.initial && cfg.initial <= cfg.max_scale,
           "loss scale bounds: min ", cfg.min_scale, ", initial ", cfg.initial, ", max ",
           cfg.max_scale);
  FY_CHECK(cfg.growth > 1 && cfg.backoff > 0 && cfg.backoff < 1 && cfg.growth_interval > 0,
           "loss scale growth ", cfg.growth, ", backoff ", cfg.backoff, ", interval ",
           cfg.growth_interval);
}

bool DynamicLossScaler::update(double scaled_grad_sum_squares) {
  if (!std::isfinite(scaled_grad_sum_squares)) {
    if (scale_ <= cfg_.min_scale)
      throw Error(str("fp16 gradients overflow even at the minimum loss scale ", cfg_.min_scale,
                      " (sum of squares ", scaled_grad_sum_squares, " after ", skipped_,
                      " skipped steps): training has diverged"));
    scale_ = std::max(cfg_.min_scale, scale_ * cfg_.backoff);
    clean_ = 0;
    ++skipped_;
    return false;
  }
  if (++clean_ >= cfg_.growth_interval) {
    scale_ = std::min(cfg_.max_scale, scale_ * cfg_.growth);
    clean_ = 0;
  }
  return true;
}

}  // namespace fuyou
