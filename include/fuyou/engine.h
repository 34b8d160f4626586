// The training engine behind fuyou-train and fuyou-bench: always a plan of the executor. When
// the whole model fits the device budget and nothing asks for offloading, in memory: the
// weights and activations resident (in_memory_plan), AdamW on the host or on the device.
// Otherwise the offloading scheduler's plan over the SSD store and the out-of-core optimizer.
// The in-memory step (InMemoryStep) runs only where runtime.in_memory asks for it: the
// reference the plans are compared with.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/hardware.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"
#include "fuyou/train_state.h"

namespace fuyou {

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  virtual bool offloaded() const = 0;
  // Whether AdamW runs on the device, its state beside the model (optimizer.placement).
  virtual bool optimizer_on_device() const = 0;
  virtual std::string describe() const = 0;  // where every state lives, peak memory per tier
  virtual void init_params() = 0;            // init_gpt_params, group by group
  // `masks`: empty (every target counts) or one B*T loss mask per micro-batch (split_batch);
  // the loss and gradient are the mean over the step's counted targets. `positions`: empty
  // (one record per row) or one B*T array per micro-batch of packed records
  // (Transformer::set_tokens).
  virtual StepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                          const std::vector<const uint8_t*>& masks = {},
                          const std::vector<const int32_t*>& positions = {}) = 0;
  // Validation loss of one batch: the mean over its counted targets (mask B*T, or null: all
  // count; positions B*T or null, as step's). The offloaded engine runs its plan's
  // forward-only counterpart.
  virtual float eval_loss(const int32_t* batch, const uint8_t* mask = nullptr,
                          const int32_t* positions = nullptr) = 0;
  // Writes the fp32 master weights as safetensors (engine tensor names), group by group.
  virtual void save_weights(const std::string& path,
                            const std::map<std::string, std::string>& metadata) = 0;
  virtual void write_trace(const std::string& path) const = 0;

  // Training-state checkpoints (include/fuyou/checkpoint.h), between steps. read_state
  // streams one kind of one parameter group (make_gpt_layout order, padding included) from
  // wherever it lives; write_state sets it: kMaster (it also sets the group's weights for the
  // forward) and kAdamM and kAdamV, each written for every group restored (the master does not
  // reset the moments).
  virtual void read_state(int group, StateKind kind, const StateSink& sink) = 0;
  virtual void write_state(int group, StateKind kind, const StateSource& source) = 0;
  // How the optimizer stores its state (optimizer.state, optimizer.master), and packed moments
  // (kAdamM, kAdamV) as stored, which a checkpoint of the same format keeps exactly
  // (OocAdamW::read_packed); read_state / write_state convert them to and from fp32.
  virtual OptimFormat optim_format() const = 0;
  virtual void read_packed(int group, StateKind kind, const PackedSink& sink) = 0;
  virtual void write_packed(int group, StateKind kind, const PackedSource& source) = 0;
  virtual OptimizerCounters counters() = 0;
  virtual void set_counters(const OptimizerCounters& c) = 0;
  // What closing this engine's SSD store removes (SsdStore::cleanup_paths); empty without one.
  virtual std::vector<std::string> store_cleanup_paths() const { return {}; }
  // The simulator's iteration time for the plan the automatic activation placement chose
  // (offload.activations auto with offload.hardware set); 0 when there is none.
  virtual double predicted_iteration_s() const { return 0; }
  // The plan the offloading engine runs; null in memory.
  virtual const Plan* plan() const { return nullptr; }
  // A LoRA run's frozen base as LoraStep::base_xxh3 gives it; empty for a full fine-tune. A
  // checkpoint records it and a resume on a base of another checksum is refused.
  virtual std::string base_xxh3() const { return {}; }
};

// Bytes per element of the device's tensors under runtime.device_tensors.
size_t device_tensor_bytes(const RuntimeConfig& runtime);
// Device bytes in-memory training of this model needs (parameters, gradients, every layer's
// activations, workspace), with device tensors of `elem_bytes` bytes per element.
uint64_t in_memory_device_bytes(const ModelConfig& m, int micro_batch, size_t elem_bytes);
// Whether the config asks for the offloading scheduler whatever the device holds:
// offload.ssd_paths set, or offload.activations swap or recompute.
bool wants_offload(const Config& cfg);
// Host bytes in-memory training needs: the process baseline, fp32 master weights, gradients
// and Adam moments (16 bytes per parameter) and, where the device is host memory
// (Backend::device_is_host_memory: the CPU backend), the device arena and, with 16-bit
// tensors, its kernels' fp32 scratch (cpu_kernel_scratch_bytes). An in-memory run with
// offload.host_memory set is refused at start when this exceeds it.
// `fp32_sums` (sums_grads_in_fp32) adds the fp32 gradient sum, 4 bytes per parameter.
// `format`: the optimizer's state format (optim_state_bytes: 12 bytes per parameter in fp32,
// 4.03 with int8 moments and a split master).
uint64_t in_memory_host_bytes(const ModelConfig& m, int micro_batch, bool device_in_host,
                              size_t elem_bytes, bool fp32_sums = false,
                              const OptimFormat& format = {});
// The part of in_memory_host_bytes that is the master, the moments and the gradients (and
// their fp32 sums).
uint64_t in_memory_state_bytes(const ModelConfig& m, bool fp32_sums, const OptimFormat& format);
// Whether a step's micro-batch gradients are summed in fp32 on the host rather than in the
// device's 16-bit gradients (schedule.grad_accum_type; PlanRequest::accum_fp32): grad_accum > 1
// with 16-bit tensors, unless grad_accum_type is `tensors`.
bool sums_grads_in_fp32(const Config& cfg);
// The same for a backend whose tensors are `tensors` (Backend::storage_type).
bool sums_grads_in_fp32(const ScheduleConfig& schedule, ElemType tensors);

// The plan request a config asks for: model, micro-batch, budgets, SSD availability and the
// activation decisions of offload.activations (empty for auto).
PlanRequest plan_request(const Config& cfg);
// The backend's rules for its plans (PlanDevice).
PlanDevice plan_device(const Backend& backend);
// plan_request(cfg) with the device's rules and PlanRequest::attention_keys.
PlanRequest plan_request(const Config& cfg, const PlanDevice& device, double attention_keys);
// The plan the offloading engine runs for this config on `backend` (make_train_engine, and
// `fuyou-bench plan`): plan_request with the backend's rules (rows first and spread host state
// where compute does not share the CPU, the device's memory counted on the host only where it
// is host memory, within the device's capacity) and, with offload.activations auto and
// offload.hardware set, the simulator's best activation placement (on `placement` where given,
// else on offload.hardware's profile); *predicted_s: that placement's simulated step (0
// without the search).
// attention_keys: PlanRequest::attention_keys (packed records; 0: dense).
Plan train_plan(const Config& cfg, Backend& backend, double* predicted_s = nullptr,
                const HardwareProfile* placement = nullptr, double attention_keys = 0);

// In-memory training (choose_engine) as a plan of the executor: every layer's
// activations kept and its weights in a device slot of its own (PlanRequest::resident_weights),
// no SSD. AdamW on the host: its gradients go down and its AdamW runs during the backward, its
// new weights go up beside the next forward. AdamW on the device (in_memory_optimizer_on_device:
// PlanRequest::device_optimizer): its state on the device, updated there on the compute queue.
// Null, with *why saying so, for runtime.in_memory step, or a plan over offload.device_memory
// (or the device's capacity) or offload.host_memory.
std::optional<Plan> in_memory_plan(const Config& cfg, Backend& backend, double attention_keys,
                                   std::string* why);

// Which engine a config trains with on a backend (make_train_engine; fuyou-train --dry-run
// reports the same): offloaded where the config asks for it (wants_offload); else in memory as
// a plan (in_memory_plan) where it fits; else offloaded, the scheduler placing what the device
// cannot hold. The in-memory step only for runtime.in_memory step, where the model fits the
// device (offload.device_memory, or a GPU's capacity: in_memory_device_bytes). A config with a
// lora section: the LoRA step (LoraStep, docs/lora.md), whatever else it says.
enum class EngineKind { kOffloaded, kInMemoryPlan, kInMemoryStep, kLora };
struct EngineChoice {
  EngineKind kind = EngineKind::kOffloaded;
  std::optional<Plan> plan;  // kInMemoryPlan's
  std::string why;           // for the log
};
EngineChoice choose_engine(const Config& cfg, Backend& backend, double attention_keys);

class FileLayer;  // src/storage/file_layer.h

struct EngineOptions {
  // The SSD store's file layer (StoreConfig::files); null: the real one. Tests inject
  // faults through it.
  std::shared_ptr<FileLayer> store_files;
  // The machine the automatic activation placement searches on (train_plan's `placement`);
  // unset: offload.hardware's profile. For an emulated run fuyou-bench train sets the machine
  // as emulated: the GPU's compute and PCIe at runtime.emulated_scale with this machine's
  // disks and optimizer (emulated_machine), which offload.hardware alone does not describe.
  std::optional<HardwareProfile> placement_profile;
  // PlanRequest::attention_keys of the training data (packed records); 0: dense.
  double attention_keys = 0;
};

// offload.hardware's profile as the run's plan is timed on it: with offload.ssd_paths, as many
// SSDs as the distinct filesystems those paths are on (the store stripes over the paths; two
// paths on one filesystem share its disk), each at the profile's per-SSD rates.
HardwareProfile run_hardware_profile(const Config& cfg);

// Refuses (IoError, per filesystem, in make_train_engine's words) a plan whose SSD state the
// filesystems of offload.ssd_paths cannot hold; opens nothing (--dry-run).
void check_plan_ssd_space(const Config& cfg, const Plan& plan);

// Opens the SSD store if offload.ssd_paths is set and builds the plan within the budgets;
// throws Error naming what does not fit.
std::unique_ptr<TrainEngine> make_train_engine(const Config& cfg, Backend& backend,
                                               const EngineOptions& opts = {});

}  // namespace fuyou
