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
};

}  // namespace fuyou
