// Dynamic loss scaling for fp16 GEMM inputs: the state machine, independent of any backend.
//
// fp16 flushes gradients below 2^-24 to zero, so the loss (and with it every gradient) is
// multiplied by `scale()` before the backward; the optimizer divides it out again (AdamW's
// grad_scale). A step whose scaled gradients overflowed (any inf or NaN, which the global
// sum of squares exposes, see Backend::sum_squares) must not be applied: update() says to
// skip it and halves the scale; after `growth_interval` clean steps in a row the scale
// doubles again. The same rules as PyTorch's GradScaler and Megatron's DynamicGradScaler.
//
// Both engines call decide_step() once per step with the global sum of squares: InMemoryStep
// after the backward, the offload scheduler in its exact mode's global-norm op (fp16 always
// builds exact plans), so they skip and scale identically.
#pragma once

#include <cstdint>

namespace fuyou {

struct LossScaleConfig {
  double initial = 65536.0;  // 2^16
  double growth = 2.0;
  double backoff = 0.5;
  int64_t growth_interval = 2000;  // clean steps before the scale grows
  double min_scale = 1.0;
  double max_scale = 16777216.0;  // 2^24: beyond it fp32 sums of scaled losses lose digits
};

// Everything the scaler's future decisions depend on, for checkpoints.
struct LossScaleState {
  double scale = 65536.0;
  int64_t clean = 0;    // clean steps in a row since the last change
  int64_t skipped = 0;  // steps skipped so far
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const LossScaleConfig& cfg = {});

  // Multiplies the loss before the backward.
  double scale() const { return scale_; }
  // Multiplies the gradients before the update (1 / scale()).
  double unscale() const { return 1.0 / scale_; }

  // After the backward, with the sum of squares of the scaled gradients. Returns true when
  // every gradient was finite and the step may be applied; false when it must be skipped
  // (the scale has then backed off). Throws fuyou::Error once the scale is at min_scale and
  // still overflows: training has diverged, and skipping forever would hide it.
  bool update(double scaled_grad_sum_squares);

  int64_t skipped_steps() const { return skipped_; }
  LossScaleState state() const { return {scale_, clean_, skipped_}; }
  // Continues from a saved state; throws Error for a scale outside [min_scale, max_scale].
  void restore(const LossScaleState& s);
  int64_t clean_steps_in_a_row() const { return clean_; }

 private:
  LossScaleConfig cfg_;
  double scale_;
  int64_t clean_ = 0;
  int64_t skipped_ = 0;
};

// What one step does once the global sum of squares of its gradients is known. `loss_scale`
// is the factor the loss was multiplied by (1 without fp16), `scaler` null without fp16.
// The factor each per-target loss gradient gets in the backward: loss_scale / (counted targets
// of the step), 0 when nothing counts. Written so that without fp16 (loss_scale 1) it is
// exactly the 1 / float(counted) the engines used before loss scaling existed.
inline float backward_scale(int64_t counted, double loss_scale) {
  if (counted == 0) return 0.0f;
  return loss_scale == 1.0 ? 1.0f / static_cast<float>(counted)
                           : static_cast<float>(loss_scale / static_cast<double>(counted));
}

struct StepDecision {
  bool apply = true;        // false: skip the update (fp16 overflow)
  double grad_norm = 0;     // of the unscaled gradients (inf when they overflowed)
  float grad_scale = 1.0f;  // multiplies each gradient in the update: unscale x clip coefficient
};
StepDecision decide_step(double scaled_sum_squares, double loss_scale, double grad_clip,
                         DynamicLossScaler* scaler);

}  // namespace fuyou
