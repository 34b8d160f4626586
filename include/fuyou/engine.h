// The training engine behind fuyou-train and fuyou-bench: in-memory training (StepRunner)
// when the whole model fits the device budget and nothing asks for offloading, else the
// offloading scheduler (plan + executor over the SSD store and the out-of-core optimizer).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/scheduler.h"
#include "fuyou/train.h"

namespace fuyou {

struct EngineStep {
  float loss = 0;
  double grad_norm = 0;
  double lr = 0;
  bool skipped = false;   // fp16 overflow: no update this step
  double loss_scale = 1;  // fp16 loss scale used this step, else 1
  bool offloaded = false;
  OffloadStepResult detail;  // iteration and per-resource busy times, SSD bytes (offloaded)
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  virtual bool offloaded() const = 0;
  virtual std::string describe() const = 0;  // where every state lives, peak memory per tier
  virtual void init_params() = 0;            // init_gpt_params, group by group
  // `masks`: empty (every target counts) or one B*T loss mask per micro-batch (split_batch);
  // the loss and gradient are the mean over the step's counted targets.
  virtual EngineStep step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                          const std::vector<const uint8_t*>& masks = {}) = 0;
  // Validation loss of one batch; false when this engine cannot evaluate (both engines can:
  // the offloaded one runs its plan's forward-only counterpart).
  // The loss is the mean over the batch's counted targets (mask B*T, or null: all count).
  virtual bool eval_loss(const int32_t* batch, float* loss, const uint8_t* mask = nullptr) = 0;
  // Writes the fp32 master weights as safetensors (engine tensor names), group by group.
  virtual void save_weights(const std::string& path, const std::map<std::string, std::string>& metadata) = 0;
  virtual void write_trace(const std::string& path) const = 0;
  // The simulator's iteration time for the plan the automatic activation placement chose
  // (offload.activations auto with offload.hardware set); 0 when there is none.
  virtual double predicted_iteration_s() const { return 0; }
};

// Device bytes in-memory training of this model needs (parameters, gradients, every layer's
// activations, workspace).
uint64_t in_memory_device_bytes(const ModelConfig& m, int micro_batch);
bool wants_offload(const Config& cfg);
// Host bytes in-memory training needs: the process baseline, fp32 master weights, gradients
// and Adam moments (16 bytes per parameter) and, on the CPU backend, the device arena. An
// in-memory run with offload.host_memory set is refused at start when this exceeds it.
uint64_t in_memory_host_bytes(const ModelConfig& m, int micro_batch, BackendKind kind);

// The plan request a config asks for: model, micro-batch, budgets, SSD availability and the
// activation decisions of offload.activations (empty for auto).
PlanRequest plan_request(const Config& cfg);

// Opens the SSD store if offload.ssd_paths is set and builds the plan within the budgets;
// throws Error naming what does not fit.
std::unique_ptr<TrainEngine> make_train_engine(const Config& cfg, Backend& backend);

}  // namespace fuyou
