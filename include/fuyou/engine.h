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
  bool offloaded = false;
  OffloadStepResult detail;  // iteration and per-resource busy times, SSD bytes (offloaded)
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  virtual bool offloaded() const = 0;
  virtual std::string describe() const = 0;  // where every state lives, peak memory per tier
  virtual void init_params() = 0;            // init_gpt_params, group by group
  virtual EngineStep step(int64_t step_index, const std::vector<const int32_t*>& micro_batches) = 0;
  // Validation loss of one batch; false when this engine cannot evaluate (offloaded).
  virtual bool eval_loss(const int32_t* batch, float* loss) = 0;
  // Writes the fp32 master weights as safetensors (engine tensor names), group by group.
  virtual void save_weights(const std::string& path, const std::map<std::string, std::string>& metadata) = 0;
  virtual void write_trace(const std::string& path) const = 0;
};

// Device bytes in-memory training of this model needs (parameters, gradients, every layer's
// activations, workspace).
uint64_t in_memory_device_bytes(const ModelConfig& m, int micro_batch);
bool wants_offload(const Config& cfg);

// Opens the SSD store if offload.ssd_paths is set and builds the plan within the budgets;
// throws Error naming what does not fit.
std::unique_ptr<TrainEngine> make_train_engine(const Config& cfg, Backend& backend);

}  // namespace fuyou
