// The executor: runs a Plan on a Backend, the SSD store and the out-of-core optimizer.
// Each resource is a thread that performs its operations in plan order; each dependency is
// an event (an op's completion). Every buffer comes from pools sized from the plan before
// the first step; nothing is allocated during an iteration.
//
// Iterations overlap: step() returns once the step's loss and gradients exist (and, in
// exact mode, its norm), while its updates and weight writes still run; the next step's
// ops start at once, each waiting only for the ops of the previous step that touch its
// buffers (previous_iteration_deps), so a layer's forward waits for that layer's update and
// the next weights stream in during the previous step's last updates. Everything that
// reads state from the caller (validation, read_params, set_params, the trace) first waits
// for the work in flight.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/plan.h"
#include "fuyou/step_result.h"
#include "fuyou/storage.h"
#include "fuyou/train_state.h"

namespace fuyou {

class PlanExecutor {
 public:
  // `store` may be null when the plan keeps nothing on SSD.
  PlanExecutor(const Config& cfg, Backend& backend, Plan plan, SsdStore* store);
  ~PlanExecutor();
  PlanExecutor(const PlanExecutor&) = delete;
  PlanExecutor& operator=(const PlanExecutor&) = delete;

  const Plan& plan() const;
  // Sets every parameter (host array in make_gpt_layout order): weights to their tiers,
  // optimizer master copies, Adam moments to zero.
  void set_params(const float* params);
  // The current fp32 master weights, in layout order.
  void read_params(float* params);
  // The same one parameter group at a time (group-relative arrays of groups[g].numel), for
  // models larger than host memory.
  void set_group_params(int group, const float* params);
  void read_group_params(int group, float* params);
  // A host buffer of the largest group's size from the plan's pools, free between steps:
  // callers stage set_group_params / read_group_params through it instead of allocating.
  float* group_staging();

  // Checkpoints, between steps (each first waits for the work in flight). read_group_state
  // streams one kind of a group's state (OocAdamW::read_state). write_group_state with
  // kMaster fills group_staging() from `source` and sets the group as set_group_params does
  // (weights on every tier, moments zero); kAdamM / kAdamV then stream into the optimizer.
  void read_group_state(int group, StateKind kind, const StateSink& sink);
  void write_group_state(int group, StateKind kind, const StateSource& source);
  // Packed moments as the optimizer stores them (OocAdamW::read_packed).
  void read_group_packed(int group, StateKind kind, const PackedSink& sink);
  void write_group_packed(int group, StateKind kind, const PackedSource& source);
  OptimizerCounters counters();
  void set_counters(const OptimizerCounters& c);

  // One optimizer step on one micro-batch of B*(T+1) tokens; `mask` (B*T, or null: every
  // target counts) says which targets count in the loss (split_batch).
  StepResult step(int64_t step_index, const int32_t* batch, const uint8_t* mask = nullptr);
  // One optimizer step on plan().grad_accum micro-batches (masks: empty, or one per
  // micro-batch): their gradients accumulate and the updates run after the last one's
  // backward; the loss is the mean over the step's counted targets (mean_over_counted).
  // `positions`: empty, or one B*T array per micro-batch of packed records (InMemoryStep::step).
  StepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                  const std::vector<const uint8_t*>& masks = {},
                  const std::vector<const int32_t*>& positions = {});
  // Validation: the mean loss over the counted targets of one B*(T+1) batch at the current
  // weights, by the plan's forward-only counterpart (make_forward_plan: weights streamed as
  // in the forward, nothing saved, no backward, no update). Bitwise InMemoryStep::eval_loss.
  float eval_loss(const int32_t* batch, const uint8_t* mask = nullptr,
                  const int32_t* positions = nullptr);

  // Chrome trace-event JSON of the last two training steps (they overlap), one row per
  // resource.
  void write_trace(const std::string& path) const;

  // Test hook: called on the compute thread before each layer's forward with the device
  // weights it is about to use (`count` elements of the device's tensor type).
  std::function<void(int layer, const void* weights, size_t count)> on_forward;
  // Test hook: called on a resource's thread before each op of a training step (`step` is
  // the step index; -1 for validation).
  std::function<void(int64_t step, const PlanOp& op)> on_op;
  // Test hook: called on a resource's thread after each op with the bytes it moved.
  std::function<void(int64_t step, const PlanOp& op, const OpTraffic& moved)> on_op_done;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
