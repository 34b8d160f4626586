// The training state an engine holds beyond its weights, in the terms a checkpoint needs:
// per parameter group, the fp32 master weights and the two AdamW moments (wherever they
// live: host memory, SSD extents), and the counters beside them. Engines stream state in
// pieces through the buffers they already own, so saving or restoring a model larger than
// host memory stays within the host budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "fuyou/loss_scale.h"

namespace fuyou {

enum class StateKind { kMaster, kAdamM, kAdamV };
const char* state_kind_name(StateKind k);  // "master", "adam_m", "adam_v"

// Receives one group's state in pieces: `n` elements starting at group-relative element
// `begin`, in increasing order and without gaps, valid only during the call.
using StateSink = std::function<void(size_t begin, const float* data, size_t n)>;
// Fills one group's state in pieces the same way: the callee writes `n` elements from `begin`.
using StateSource = std::function<void(size_t begin, float* data, size_t n)>;

struct OptimizerCounters {
  int64_t adam_step = 0;        // updates applied so far (AdamW's bias-correction step)
  bool has_loss_scale = false;  // fp16 GEMM inputs: the dynamic loss scaler's state
  LossScaleState loss_scale;
};

// The counters of an engine at AdamW step `adam_step` with `scaler` (null: no fp16).
OptimizerCounters optimizer_counters(int64_t adam_step, const DynamicLossScaler* scaler);
// Restores them into the engine's step and scaler; Error when the checkpoint has loss-scale
// state and this run does not use fp16, or the reverse.
void restore_optimizer_counters(const OptimizerCounters& c, int64_t* adam_step,
                                DynamicLossScaler* scaler);

}  // namespace fuyou
