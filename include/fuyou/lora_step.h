// A LoRA step (lora section): the frozen base on the device with no gradient and no optimizer
// state, the adapters beside it, their gradients copied to the host each step and AdamW (the
// engine's OocAdamW, host memory) over the adapters only. The in-memory reference path of the
// CPU backend; docs/lora.md says what runs and what does not yet.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/lora.h"
#include "fuyou/model.h"
#include "fuyou/ooc_adamw.h"
#include "fuyou/step_result.h"
#include "fuyou/train_state.h"

namespace fuyou {

class LoraStep {
 public:
  // Loads the base from cfg.model.checkpoint and the adapters as lora.init says.
  LoraStep(const Config& cfg, Backend& backend);
  ~LoraStep();
  LoraStep(const LoraStep&) = delete;
  LoraStep& operator=(const LoraStep&) = delete;

  const LoraLayout& layout() const { return layout_; }
  // As TrainEngine::step: the loss is the mean over the step's counted targets.
  StepResult step(int64_t step_index, const std::vector<const int32_t*>& micro_batches,
                  const std::vector<const uint8_t*>& masks = {},
                  const std::vector<const int32_t*>& positions = {});
  float eval_loss(const int32_t* batch, const uint8_t* mask = nullptr,
                  const int32_t* positions = nullptr);
  // The adapters now (the layout's flat fp32 array) and the last step's gradient (before
  // clipping), host memory.
  const std::vector<float>& adapters() const { return master_; }
  const std::vector<float>& adapter_gradient() const { return grad_; }
  // The logits (B*T, vocab_size) of inputs (B*T tokens) with the adapters applied, in dst;
  // needs model.head_chunk_tokens 0.
  void logits(const int32_t* inputs, float* dst);
  // The adapters as a PEFT adapter directory.
  void write_peft(const std::string& dir) const;

  // Checkpoints (TrainEngine::read_state): one kind of one adapter group (layout().params) in
  // pieces; a master written sets the group's adapters on the device too, and leaves the
  // moments as they are.
  void read_state(int group, StateKind kind, const StateSink& sink);
  void write_state(int group, StateKind kind, const StateSource& source);
  OptimizerCounters counters() const;
  void set_counters(const OptimizerCounters& c);
  // XXH3-64 (16 hex digits) of the base's fp32 parameters as loaded (make_gpt_layout order,
  // padding zero): a LoRA checkpoint records it, so that a resume on another base is refused
  // whatever the base's files are called or where they moved.
  const std::string& base_xxh3() const { return base_xxh3_; }

 private:
  Config cfg_;
  Backend& be_;
  Transformer model_;
  LoraLayout layout_;
  void* d_params_ = nullptr;  // adapters on the device
  void* d_grads_ = nullptr;   // their gradients
  std::vector<float> master_, grad_;
  std::unique_ptr<OocAdamW> opt_;
  std::vector<int32_t> inputs_, targets_;
  int64_t t_ = 0;  // AdamW steps taken
  std::string base_xxh3_;
};

}  // namespace fuyou
