#include "fuyou/loss_scale.h"

#include <algorithm>
#include <cmath>

#include "fuyou/error.h"
#include "fuyou/train_state.h"

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

void DynamicLossScaler::restore(const LossScaleState& s) {
  if (!(s.scale >= cfg_.min_scale && s.scale <= cfg_.max_scale) || s.clean < 0 || s.skipped < 0)
    throw Error(str("loss scale state: scale ", s.scale, " (allowed ", cfg_.min_scale, " .. ",
                    cfg_.max_scale, "), clean steps ", s.clean, ", skipped steps ", s.skipped));
  scale_ = s.scale;
  clean_ = s.clean;
  skipped_ = s.skipped;
}

StepDecision decide_step(double scaled_sum_squares, double loss_scale, double grad_clip,
                         DynamicLossScaler* scaler) {
  StepDecision d;
  d.grad_norm = std::sqrt(scaled_sum_squares) / loss_scale;
  if (scaler && !scaler->update(scaled_sum_squares)) {
    d.apply = false;
    return d;
  }
  // Clipping multiplies each gradient by the coefficient inside the update kernel, in fp32,
  // as torch.nn.utils.clip_grad_norm_ does; the loss scale is divided out in the same product.
  double coef = 1.0;
  if (grad_clip > 0) coef = std::min(1.0, grad_clip / (d.grad_norm + 1e-6));
  d.grad_scale = static_cast<float>(coef / loss_scale);
  return d;
}

OptimizerCounters optimizer_counters(int64_t adam_step, const DynamicLossScaler* scaler) {
  OptimizerCounters c;
  c.adam_step = adam_step;
  c.has_loss_scale = scaler != nullptr;
  if (scaler) c.loss_scale = scaler->state();
  return c;
}

void restore_optimizer_counters(const OptimizerCounters& c, int64_t* adam_step,
                                DynamicLossScaler* scaler) {
  if (c.has_loss_scale != (scaler != nullptr))
    throw Error(str("training state: the checkpoint ", c.has_loss_scale ? "has" : "has no",
                    " fp16 loss-scale state but this run ", scaler ? "uses" : "does not use",
                    " fp16"));
  *adam_step = c.adam_step;
  if (scaler) scaler->restore(c.loss_scale);
}

}  // namespace fuyou
