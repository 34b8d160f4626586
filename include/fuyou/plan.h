// A plan: one training iteration as plain data. For each resource (compute, host->device,
// device->host, SSD read, SSD write, CPU optimizer) the ordered operations it performs, the
// dependencies between them, and the buffer slots they use from fixed pools. The executor
// (scheduler.h) runs a plan; it can be printed as a table and dumped as JSON.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuyou/config.h"
#include "fuyou/elem_type.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/resource.h"
#include "fuyou/tier.h"

namespace fuyou {

// Fixed process overhead counted against the host budget (code, libraries, allocator,
// thread stacks), measured as the RSS of a small run: about 150 MiB; rounded up.
constexpr uint64_t kProcessBaseline = 256ull << 20;

// Where a layer's input checkpoint (the block input) lives between forward and backward.
// keep: on the device with every internal activation (no recompute); device: the
// checkpoint on the device, internals recomputed; host / ssd: the checkpoint swapped out
// through host slots (and to SSD), internals recomputed; recompute: nothing stored, the
// input rebuilt in the backward from layer l-1's checkpoint.
enum class ActPlacement { kKeep, kDevice, kHost, kSsd, kRecompute };
const char* act_placement_name(ActPlacement a);

struct LayerDecision {
  ActPlacement act = ActPlacement::kKeep;
  Tier weights = Tier::kHost;  // where the layer's weights wait between uses
  Tier optim = Tier::kHost;    // where its fp32 master and Adam moments live
  // Where its gradient is held while the step needs it later (Plan::holds_grads: between
  // micro-batches, or until the global norm is known): a host buffer, or an SSD extent
  // written and read back through host staging slots.
  Tier grads = Tier::kHost;
  // SSD-weight layers updated last in a step (the lowest) keep their new weights in the
  // host slot the update wrote them to (this index into the weights-out slots, -1: not
  // retained) until the next step's forward loads them from there: that forward neither
  // waits for their SSD write nor reads them back. Not in exact mode (updates after the
  // norm, in forward order; fp16 may skip a step's updates).
  int retained = -1;
};

// ---- the buffer table ---------------------------------------------------------------------

// What a buffer holds. With PlanBuffer::index (a slot, a layer or a parameter group, as noted)
// it names one buffer of the plan.
enum class BufferKind {
  // Device.
  kEmbedWeights,
  kFinalWeights,  // the resident embedding and final-norm groups
  kEmbedRows,     // view of kEmbedWeights: the rows the first update part refreshes
  kEmbedGrads,
  kFinalGrads,      // their gradients, accumulated over the step
  kWeightSlot,      // index: slot; one layer's weights
  kGradSlot,        // index: slot; one layer's gradients
  kCkptSlot,        // index: slot; a block input brought back for the backward
  kStream,          // index: 0 or 1; the forward's block inputs and outputs
  kLayerCkpt,       // index: layer; its block input kept on the device (keep, device)
  kLayerActs,       // index: layer; its internal activations (keep)
  kWorkActs,        // the activations every other layer's forward and backward use
  kScratch,         // recomputation's unused block output
  kResidualGrad,    // the gradient flowing down the residual stream
  kModelWorkspace,  // the model's own (logits, head, backward scratch)
  // Plan::device_optimizer:
  kDeviceOptim,    // index: group; fp32 master (unless the weights are fp32) and Adam moments
  kDeviceGradSum,  // index: group; its fp32 gradient sum over micro-batches (Plan::accum_fp32)
  kAdamWPieces,    // the device AdamW's pieces (AdamWPiece), every group's
  // Host, in the order the table lists them (in_table_order).
  kProcess,        // code, libraries, allocator, thread stacks
  kDeviceArena,    // the device's memory where it is host memory (CPU backend)
  kKernelScratch,  // the CPU backend's fp32 views of 16-bit tensors (cpu_kernel_scratch_bytes)
  kHostCkpt,       // index: layer; its block input in host memory
  kHostGradSlot,   // index: slot; a group's gradient between its save and update
  kGradHold,       // index: layer; its held gradient in host memory
  kEmbedGradHold,
  kFinalGradHold,  // Plan::accum_fp32: the resident groups' fp32 gradient sums
  kGradStage,      // index: slot; held gradients to and from SSD, or a deferred update's
  kCkptStage,      // index: slot; staging of checkpoints to and from SSD
  kStateStage,     // 16-bit tensors only: one group's fp32 state on its way to or from a checkpoint
  kHostEmbed,
  kHostFinal,    // host copies of the resident groups' weights
  kHostWeights,  // index: layer; its weights while they wait in host memory
  kReadSlot,     // index: slot; staging of weights read from SSD
  kWoutSlot,     // index: slot; new weights on their way to SSD
  kHostOptim,    // index: group; fp32 master and Adam moments (the optimizer's)
  kOptimChunks,  // the out-of-core optimizer's chunk slots
  // SSD, likewise.
  kSsdWeights,  // index: layer
  kSsdOptim,    // index: group; master and moments (the optimizer's extents)
  kSsdCkpt,     // index: layer
  kSsdGrads,    // index: layer; held gradients
};
const char* buffer_kind_name(BufferKind k);

struct PlanBuffer {
  BufferKind kind = BufferKind::kProcess;
  int index = 0;
  Tier tier = Tier::kHost;
  uint64_t bytes = 0;
  // The line of the plan's memory breakdown this buffer is counted under.
  std::string part;
  std::string name() const;  // e.g. "device.weight_slot.2", "ssd.weights.layer5"
};

// How an op uses a buffer. kAccumulate reads and adds: for hazards a write.
enum class Access { kRead, kWrite, kAccumulate };
// Which operand of its op a use is, where an op has several of one access.
enum class Role {
  kSource,
  kDest,  // transfers: what is copied, where to
  kWeights,
  kInput,
  kOutput,    // compute: the layer's weights, block input and output
  kGrads,     // compute: the gradients a backward writes or adds to
  kResidual,  // compute: the gradient flowing down the residual stream
  kWork,      // compute: the activations a block saves or reads back
  kState,     // optimizer: the group's fp32 master and Adam moments
};

struct BufferUse {
  int buffer = -1;  // index into Plan::buffers
  Access access = Access::kRead;
  Role role = Role::kSource;
  uint64_t offset = 0, bytes = 0;  // the byte range used
  bool writes() const { return access != Access::kRead; }
};

// ---- operations ---------------------------------------------------------------------------

// What an op does. Its buffers, and which of them it reads or writes, are its uses
// (PlanOp::uses): the executor, the hazard analysis and the simulator read those. Its queue,
// name and traffic are its row of op_kind_info.
enum class OpKind {
  kReadWeights,      // a layer's weights extent -> host read slot (split master: -> the update's
                     // weights-out slot)
  kLoadWeights,      // host weights, a read slot or a weights-out slot -> device weight slot
  kEmbedForward,     // the micro-batch's tokens to the device, embedding forward
  kForward,          // block forward of `layer`
  kSaveCheckpoint,   // block input of `layer` -> host (resident or staging)
  kWriteCheckpoint,  // staging -> checkpoint extent
  kReadCheckpoint,   // checkpoint extent -> staging
  kLoadCheckpoint,   // host -> device checkpoint slot
  kZeroGrads,        // the step's first micro-batch zeroes the embedding and final gradients
  kHead,             // final norm, logits, loss and their backward
  kRecomputeInput,   // forward of layer-1 to rebuild `layer`'s input
  kRecompute,        // block forward of `layer` to rebuild its internals
  kBackward,         // block backward of `layer` into a device gradient slot
  kEmbedBackward,    // the embedding's backward from the residual gradient
  kSaveGrads,        // gradients of `group` -> host gradient buffer
  kGradNorm,         // global norm over all staged gradients (exact mode)
  kUpdate,           // AdamW of `group`, new weights to host
  kWriteWeights,     // new weights of `group` -> its weights extent
  kLoadResident,     // new embedding / final-norm weights -> resident device copy
  // Held gradients (exact mode, gradient accumulation):
  kWriteGrads,       // gradient staging slot -> gradient extent of `group`
  kReadGrads,        // gradient extent -> staging slot
  kLoadGrads,        // held gradient -> device gradient slot, the next micro-batch adds to it
  kGradSumSq,        // sum of squares of one group's gradient (exact mode)
  kAccumulateGrads,  // a micro-batch's 16-bit gradient added into the group's fp32 sum
                     // (Plan::accum_fp32)
  kDeviceGradSumSq,  // kGradSumSq from the device's gradient, on the compute queue
                     // (Plan::device_sum_squares); group -1: every group's at once, one use
                     // each (Plan::device_optimizer)
  // AdamW on the device (Plan::device_optimizer), on the compute queue:
  kDeviceUpdate,      // AdamW of `group` from its gradient on the device, into its weights there
  kDeviceAccumulate,  // a micro-batch's 16-bit gradient added into the group's fp32 sum on the
                      // device (Plan::accum_fp32)
  // Forward-only plans (validation):
  kHeadLoss,  // final norm, logits and the loss, no backward
};
// Kinds are numbered 0 .. kNumOpKinds-1 (the last one's + 1).
constexpr int kNumOpKinds = static_cast<int>(OpKind::kHeadLoss) + 1;

// Where the bytes of an op of a kind go, and how they derive from its uses (op_traffic,
// op_bytes, the simulator's durations).
enum class Traffic {
  kNone,      // compute, the norm: no bytes of its own
  kH2D,       // its `role` use, host -> device
  kD2H,       // its `role` use, device -> host
  kSsdRead,   // its `role` use from the store, in whole 4 KiB blocks
  kSsdWrite,  // its `role` use to the store, in whole 4 KiB blocks
  kHostRead,  // its `role` use streamed once from host memory by the optimizer's threads
  kHostSum,   // every use streamed through host memory, an accumulated one twice (read, written)
  kState,     // an update: where its `role` use (the state) is on SSD, master and moments read
              // and written back in the plan's state format (ooc_update_io_bytes)
};

// One row per op kind: everything the plan's readers know of a kind other than what it does
// (the executor's run_op) and where the planner emits it.
struct OpKindInfo {
  const char* name = nullptr;              // listings, JSON, traces, messages
  Resource resource = Resource::kCompute;  // the queue that runs it
  Traffic traffic = Traffic::kNone;
  Role role = Role::kSource;  // the use its traffic counts, where it names one
};

// The table. A kind without a row does not compile (-Wswitch as an error); a test walks
// every kind up to kNumOpKinds.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
constexpr OpKindInfo op_kind_info(OpKind k) {
  using R = Resource;
  using T = Traffic;
  switch (k) {
    case OpKind::kReadWeights:
      return {"read_weights", R::kSsdRead, T::kSsdRead, Role::kDest};
    case OpKind::kLoadWeights:
      return {"load_weights", R::kH2D, T::kH2D, Role::kDest};
    case OpKind::kEmbedForward:
      return {"embed_forward", R::kCompute, T::kNone};
    case OpKind::kForward:
      return {"forward", R::kCompute, T::kNone};
    case OpKind::kSaveCheckpoint:
      return {"save_checkpoint", R::kD2H, T::kD2H, Role::kSource};
    case OpKind::kWriteCheckpoint:
      return {"write_checkpoint", R::kSsdWrite, T::kSsdWrite, Role::kSource};
    case OpKind::kReadCheckpoint:
      return {"read_checkpoint", R::kSsdRead, T::kSsdRead, Role::kDest};
    case OpKind::kLoadCheckpoint:
      return {"load_checkpoint", R::kH2D, T::kH2D, Role::kDest};
    case OpKind::kZeroGrads:
      return {"zero_grads", R::kCompute, T::kNone};
    case OpKind::kHead:
      return {"head", R::kCompute, T::kNone};
    case OpKind::kRecomputeInput:
      return {"recompute_input", R::kCompute, T::kNone};
    case OpKind::kRecompute:
      return {"recompute", R::kCompute, T::kNone};
    case OpKind::kBackward:
      return {"backward", R::kCompute, T::kNone};
    case OpKind::kEmbedBackward:
      return {"embed_backward", R::kCompute, T::kNone};
    case OpKind::kSaveGrads:
      return {"save_grads", R::kD2H, T::kD2H, Role::kSource};
    case OpKind::kGradNorm:
      return {"grad_norm", R::kOptimizer, T::kNone};
    case OpKind::kUpdate:
      return {"update", R::kOptimizer, T::kState, Role::kState};
    case OpKind::kWriteWeights:
      return {"write_weights", R::kSsdWrite, T::kSsdWrite, Role::kSource};
    case OpKind::kLoadResident:
      return {"load_resident", R::kH2D, T::kH2D, Role::kDest};
    case OpKind::kWriteGrads:
      return {"write_grads", R::kSsdWrite, T::kSsdWrite, Role::kSource};
    case OpKind::kReadGrads:
      return {"read_grads", R::kSsdRead, T::kSsdRead, Role::kDest};
    case OpKind::kLoadGrads:
      return {"load_grads", R::kH2D, T::kH2D, Role::kDest};
    case OpKind::kGradSumSq:
      return {"grad_sum_sq", R::kOptimizer, T::kHostRead, Role::kSource};
    case OpKind::kAccumulateGrads:
      return {"accumulate_grads", R::kOptimizer, T::kHostSum};
    case OpKind::kDeviceGradSumSq:
      return {"device_grad_sum_sq", R::kCompute, T::kNone};
    case OpKind::kDeviceUpdate:
      return {"device_update", R::kCompute, T::kNone};
    case OpKind::kDeviceAccumulate:
      return {"device_accumulate", R::kCompute, T::kNone};
    case OpKind::kHeadLoss:
      return {"head_loss", R::kCompute, T::kNone};
  }
  return {};  // not a kind
}
#pragma GCC diagnostic pop
inline const char* op_kind_name(OpKind k) { return op_kind_info(k).name; }

// Parameter groups are numbered as in ParamLayout: 0 = embed, 1..L = layers, L+1 = final.
struct PlanOp {
  int id = 0;
  OpKind kind = OpKind::kForward;
  Resource resource = Resource::kCompute;  // op_kind_info(kind).resource
  int layer = -1;  // transformer layer of a compute, weight or checkpoint op; -1: none
  int group = -1;  // parameter group of a gradient or optimizer op (a layer's: layer + 1); -1: none
  int micro = 0;   // micro-batch of the step (0 .. grad_accum-1)
  // The embedding's gradient save, update and device refresh run in `parts` element ranges
  // (part 0 .. parts-1, ParamRange) so that the three pipeline after the last backward;
  // part -1 of a save, update or refresh: the rows first (Plan::embed_rows_first).
  int part = 0, parts = 1;
  std::vector<BufferUse> uses;
  std::vector<int> deps;  // ops of the same iteration that must finish first
  double flops = 0;       // useful model FLOPs (compute)
  double recompute_flops = 0;
  uint64_t params = 0;  // parameters an update or a sum of squares reads

  // The use with `role` (the first, if several); FY_CHECKs that there is one.
  const BufferUse& use(Role role) const;
  const BufferUse* find(Role role) const;
};

// The bytes of an op whose kind's traffic counts one use (transfers, a sum of squares): that
// use's, before the store's rounding to whole blocks; 0 for the others (op_traffic and the
// simulator read all of an accumulation's or an update's uses).
uint64_t op_bytes(const PlanOp& op);

struct PlanPools {
  int device_weight_slots = 0;  // one layer's weights each
  int host_weight_slots = 0;    // staging for SSD weights being read
  int host_wout_slots = 0;      // staging for new weights being written to SSD
  int device_ckpt_slots = 0;    // backward checkpoints brought back
  int host_ckpt_slots = 0;      // staging for SSD checkpoints
  int device_grad_slots = 0;    // one layer's gradients each
  int host_grad_slots = 0;      // one group's gradients each (exact mode: embedding and final)
  // One layer's gradient each: staging for held gradients on SSD, or (Plan::deferred_updates)
  // a deferred layer's gradient until its update (slot L-1-l for layer l).
  int host_grad_stage_slots = 0;
};

// The buffer table summed per tier, and per PlanBuffer::part in table order.
struct MemoryPlan {
  uint64_t device_bytes = 0;   // peak device memory the plan needs
  uint64_t host_bytes = 0;     // host memory: pool slots, resident weights/checkpoints, optimizer
  uint64_t ssd_bytes = 0;      // store extents
  bool device_in_host = true;  // host_bytes includes the device arena (PlanRequest::device_in_host)
  std::vector<std::pair<std::string, uint64_t>> device_parts, host_parts, ssd_parts;
};
MemoryPlan sum_buffers(const std::vector<PlanBuffer>& buffers);

struct Plan {
  ModelConfig model;
  int micro_batch = 1;
  ElemType tensors = ElemType::kF32;  // PlanRequest::tensors
  double attention_keys = 0;          // PlanRequest::attention_keys
  bool exact = false;                 // global-norm clipping: every update waits for the norm
  int grad_accum = 1;                 // micro-batches per step; gradients accumulate on the device
  OptimFormat optim_format;           // PlanRequest::optim_format
  // grad_accum > 1 with 16-bit tensors (PlanRequest::accum_fp32): each micro-batch's gradient
  // is made afresh on the device, saved, and added on the host (kAccumulateGrads) into an fp32
  // sum held per group (layers: host buffer or SSD extent by LayerDecision::grads; the
  // embedding and final groups: host); the norm and the updates read the fp32 sums. Else the
  // held gradient returns to the device and the next backward adds to it in the tensors' type.
  bool accum_fp32 = false;
  bool forward_only = false;  // a validation plan (make_forward_plan)
  std::vector<LayerDecision> layers;
  Tier embed_optim = Tier::kHost;
  Tier final_optim = Tier::kHost;
  // The embedding's update in parts (host-memory state, not exact mode) starts with part -1:
  // the token rows the next step's first micro-batch looks up and the position table, then
  // refreshed on the device; parts 0 .. parts-1 then update the rest while the next forward
  // runs (its head, which reads every row, waits for them).
  bool embed_rows_first = false;
  // The top `deferred_updates` layers' updates run last, after the embedding's, lowest first,
  // while the next step's forward computes the layers below them (which need only their own
  // updates); layer l's gradient waits in host gradient staging slot L-1-l. Without it the
  // optimizer idles through every forward when it lags the backward (state streamed from
  // SSD), since the next forward starts with the embedding and layer 0, updated last.
  int deferred_updates = 0;
  // Parts of the embedding's gradient save, update and refresh (PlanOp::parts).
  int embed_parts = 1;
  // PlanRequest::resident_weights: a device weight slot per layer, so every layer's weights
  // come up once a step (the forward's load after its update) and stay for the backward.
  bool resident_weights = false;
  // PlanRequest::device_sum_squares, in exact mode without fp32 sums: each group's sum of
  // squares runs on the compute queue from its gradient on the device (kDeviceGradSumSq),
  // before the save, instead of on the optimizer's thread from the host copy (kGradSumSq).
  bool device_sum_squares = false;
  // PlanRequest::device_optimizer: every group's fp32 state on the device (kDeviceOptim) and
  // its AdamW on the compute queue (kDeviceUpdate) from its gradient there, into its weights
  // there: nothing crosses the bus. Layer gradients are held in a device slot per layer where
  // the step holds them (exact mode, or accumulation in the tensors' type); fp32 sums over
  // micro-batches are device buffers (kDeviceGradSum). Exact mode: one sum of squares over every
  // group's gradient on the compute queue after the last backward (a kDeviceGradSumSq of group
  // -1, one use per group), the norm on the optimizer's thread, the updates after it.
  bool device_optimizer = false;
  PlanPools pools;
  // Every buffer the iteration uses, with its tier and size; MemoryPlan sums them.
  std::vector<PlanBuffer> buffers;
  MemoryPlan memory;
  std::vector<PlanOp> ops;

  // The buffer of `kind` and `index`; FY_CHECKs that the table has it.
  int buffer(BufferKind kind, int index = 0) const;
  // Where group g's optimizer state lives.
  Tier optim_tier(int group) const;

  // Layer gradients outlive their backward: held (LayerDecision::grads) until the norm is
  // known (exact) or the next micro-batch adds to them (grad_accum > 1).
  bool holds_grads() const { return exact || grad_accum > 1; }

  std::string table() const;    // human-readable: decisions, pools, memory, op counts
  std::string listing() const;  // every buffer, then every op with its deps and uses

  nlohmann::json to_json() const;
};

struct PlanRequest {
  ModelConfig model;
  int micro_batch = 1;
  // Keys each query's attention covers on average, as the FLOP count charges attention (a
  // dense square per sequence: seq_len). Packed records (docs/data.md, "Records") attend
  // within their record only: sum of L^2 / sum of L over record lengths L. 0: seq_len. Only
  // compute time changes with it; no byte does.
  double attention_keys = 0;
  // The device's tensors (runtime.device_tensors): weights, activations, checkpoints and
  // gradients are this type on the device, in transit and in their host and SSD copies;
  // master weights and optimizer state are fp32 whatever it is.
  ElemType tensors = ElemType::kF32;
  bool exact = false;
  int grad_accum = 1;
  // How the optimizer stores its state (optimizer.state, optimizer.master): the bytes per
  // parameter of its host buffers, extents and streaming. A split master's working halves are
  // the layer's weights, which its update reads: for a layer whose weights are on SSD the
  // update's weights-out slot is first filled from the layer's extent (kReadWeights), unless
  // the slot still holds them. int8 blocks do not follow token rows: no embed_rows_first.
  OptimFormat optim_format;
  // Plan::accum_fp32, where grad_accum > 1 and the tensors are 16-bit (schedule.grad_accum_type).
  bool accum_fp32 = false;
  uint64_t device_budget = 0;  // 0: unlimited
  uint64_t host_budget = 0;    // 0: unlimited
  // host_budget is the machine's physical memory (offload.host_memory unset: train_plan), which
  // the refusal names instead of the key.
  bool host_budget_physical = false;
  // Whether the device arena is host memory, and so counts against host_budget: true for the
  // CPU backend (its "device" is process memory), false for a GPU's and the emulated device's
  // (Backend::device_is_host_memory).
  bool device_in_host = true;
  bool have_ssd = false;
  // Forced decisions (tests, or offload.activations other than auto); empty = choose.
  std::vector<ActPlacement> acts;
  ActPlacement default_act = ActPlacement::kKeep;
  // Force every layer's weights / optimizer state to SSD (tests); else by budget.
  bool weights_on_ssd = false;
  // In-memory training as a plan (make_train_engine): one device weight slot per layer, so the
  // weights stay on the device through the step and each layer's new weights come up once,
  // after its update; an error when the budget cannot hold them. Else as many slots as fit,
  // 4 at most.
  bool resident_weights = false;
  // Exact mode's sums of squares (the clip's norm) on the compute queue, from each group's
  // gradient on the device before its save, through Backend::sum_squares (a GPU's kernel with
  // the host's bits), instead of on the optimizer's thread from the host copy, which then only
  // updates. For backends whose device is not the host's CPU. Not with fp32 sums over
  // micro-batches (Plan::accum_fp32): those are on the host.
  bool device_sum_squares = false;
  // AdamW on the device (Plan::device_optimizer): only for in-memory plans (resident_weights,
  // every layer's activations on the device, no SSD) and plain fp32 state
  // (optimizer.state fp32, optimizer.master fp32); the backend needs Backend::adamw.
  bool device_optimizer = false;
  bool optim_on_ssd = false;
  bool grads_on_ssd = false;  // held gradients (exact / grad_accum > 1) to SSD; else by budget
  // Parts of the embedding's save / update / refresh (PlanOp::parts); 0: by size. Only
  // without exact mode and with the embedding's optimizer state in host memory.
  int embed_parts = 0;
  // With parts: save, update and refresh first the rows the next step's first micro-batch
  // looks up (Plan::embed_rows_first), the other parts beside the next forward. For backends
  // whose compute does not share the CPU with the optimizer (a GPU's): on the CPU backend the
  // other parts slow the forward about as much as its earlier start saves (docs/scheduler.md).
  bool embed_rows_first = false;
  // The layers whose optimizer state takes host memory beyond the tail's (the embedding,
  // layers 0 and 1) are spread evenly among those on SSD instead of the lowest ones: the
  // backward then meets a short update between long ones, and its compute runs beside the
  // disk's streaming instead of after it. For backends whose compute does not share the CPU
  // with the optimizer.
  bool spread_host_state = false;
  // Plan::deferred_updates: how many top layers' updates are deferred (0 .. n_layer-1), or -1
  // auto: the top layer's where its optimizer state is on SSD (its update is long), no weights
  // are read from SSD and the slot moves no state to SSD; else none. Not with held gradients
  // (exact mode, grad_accum > 1).
  int deferred_updates = -1;
};

// What of the device a plan runs on shapes its request: one list of the device's rules for the
// engine's plans (plan_device(Backend), src/runtime/engine.cc) and the simulator's
// (plan_device(HardwareProfile), swap_search.h).
struct PlanDevice {
  // Compute does not share the CPU with the optimizer (a GPU, emulated or not):
  // PlanRequest::embed_rows_first and spread_host_state.
  bool own_compute = false;
  bool device_in_host = true;  // PlanRequest::device_in_host
  // PlanRequest::device_sum_squares: the sum of squares on a GPU's own memory frees the
  // optimizer's thread; on the CPU backend the same host loop would only move from that thread
  // to compute's.
  bool sum_squares = false;
};
// `req` with the device's rules.
PlanRequest with_device(PlanRequest req, const PlanDevice& device);

// Element range [begin, end) of part `part` of `parts` of a group of `numel` elements; part
// boundaries fall on multiples of 1024 elements (4 KiB of fp32).
struct ParamRange {
  size_t begin = 0, end = 0;
};
ParamRange part_range(size_t numel, int part, int parts);

// Parameters the embedding's first update part (-1, Plan::embed_rows_first) covers at most:
// a micro-batch's token rows and everything after the token table (the position table).
uint64_t embed_rows_first_params(const Plan& plan);

// The SSD queues and the host-to-device queue may start an op ahead of earlier queued ones
// on the same queue that are not ready yet (a read of the next step's layer 3 while the read
// of layer 2 still waits for its write; the next step's first weight load while the
// embedding's last refresh parts wait for their updates), when the two touch no common
// buffer that either writes. The other queues run strictly in plan order.
inline bool reorders(Resource r) {
  return r == Resource::kSsdRead || r == Resource::kSsdWrite || r == Resource::kH2D;
}
constexpr size_t kReorderWindow = 32;

// The position of the op a queue of resource `r` starts next, or -1 for none yet, for the
// executor and the simulator alike. The queue holds `size` items, at(k) the k-th, oldest
// first, where at(0) is not done. In order: at(0) once ready(at(0)). Reordering: the first
// item among the next kReorderWindow not done that is ready and conflicts with no earlier
// item not done (conflict(earlier, item): they touch a common buffer that either writes,
// which the queue's order otherwise keeps; hazards with other queues are deps).
template <class At, class Done, class Ready, class Conflict>
long next_in_queue(Resource r, size_t size, At at, Done done, Ready ready, Conflict conflict) {
  if (!size) return -1;
  if (!reorders(r)) return ready(at(0)) ? 0 : -1;
  size_t seen = 0;
  for (size_t k = 0; k < size && seen < kReorderWindow; ++k) {
    const auto x = at(k);
    if (done(x)) continue;
    ++seen;
    if (!ready(x)) continue;
    bool passes = true;
    for (size_t j = 0; j < k && passes; ++j) {
      const auto y = at(j);
      if (!done(y)) passes = !conflict(y, x);
    }
    if (passes) return static_cast<long>(k);
  }
  return -1;
}

// Iterations overlap: the executor starts iteration t+1's operations while iteration t's
// last ones (updates, weight writes) still run. For each op of the plan (as iteration t+1),
// the ops of the same plan (as iteration t) that it must wait for: those on other resources
// that used a buffer it uses (read after write, write after read or write): the last such
// op of each in-order queue (the earlier ones are done by then), every such op of a
// reordering queue. Same-resource order holds by itself (a reordering queue
// never lets two such ops pass each other). An op's forward of layer l thereby waits only
// for that layer's update.
std::vector<std::vector<int>> previous_iteration_deps(const Plan& plan);

// The bytes an op moves, per channel: what the simulator charges it (op_traffic, simulator.h)
// and what the executor moves for it (PlanExecutor::on_op_done). The uses' bytes; store
// requests in whole 4 KiB blocks; an out-of-core update's master, m and v read and written
// back. Plan bytes are the bytes the run stores (fp32 today), whatever element size a
// hardware profile names.
struct OpTraffic {
  uint64_t h2d = 0, d2h = 0;
  uint64_t ssd_read = 0, ssd_write = 0;
  bool operator==(const OpTraffic& o) const {
    return h2d == o.h2d && d2h == o.d2h && ssd_read == o.ssd_read && ssd_write == o.ssd_write;
  }
};

// Per op of the plan: the buffers it uses, sorted, each as (buffer id, written). Two ops
// conflict when they share one that either writes.
using OpBuffers = std::vector<std::pair<int64_t, bool>>;
std::vector<OpBuffers> op_buffers(const Plan& plan);
bool buffers_conflict(const OpBuffers& a, const OpBuffers& b);

// The ops a step waits for before the next one is submitted: every micro-batch's head (the
// loss) and, in exact mode, the norm (the step's decision). The rest (the backward, updates,
// weight writes) runs on while the next step is submitted, so that the next step's reads
// can start as soon as what they read was written, during this step's backward.
inline bool step_waits_for(const PlanOp& op) {
  return op.kind == OpKind::kHead || op.kind == OpKind::kGradNorm;
}

// Whether an update runs while compute has nothing to do until the next step's forward,
// which waits for it: the embedding's (with the rows first only its rows part; the other
// parts run beside the next forward) and layer 0's, and in exact mode (every update after the
// norm) the final group's, updated before layer 0's. Where compute shares the CPU's cores
// with the optimizer (the CPU backend), only these updates take every core: two OpenMP teams
// on the same cores spin against each other at every barrier (measured: compute 1.7-3x
// slower while the optimizer ran); the others take one thread.
bool update_has_cores(const Plan& plan, const PlanOp& update);

// Builds the plan, sizing pools and placing state within the budgets. Throws Error with the
// numbers that do not fit, and the smallest budget that would, when nothing fits.
Plan make_plan(const PlanRequest& req);

// The validation pass of a training plan: embedding, every layer's forward and the loss, with
// the weights brought as the training forward brings them (the same builder, tiers, slots and
// pools); no checkpoints, gradients or updates.
Plan make_forward_plan(const Plan& train);

}  // namespace fuyou
