// PEFT adapter directories (adapter_config.json, adapter_model.safetensors), read and written
// with PEFT's names, so a LoRA run continues from an adapter PEFT saved and exports one that
// PeftModel.from_pretrained loads (docs/lora.md).
#pragma once

#include <string>

#include "fuyou/config.h"
#include "fuyou/lora.h"

namespace fuyou {

// Reads the adapters of `dir` into params (the layout's flat array). adapter_config.json must
// agree with the run's lora section (r, lora_alpha, target_modules, use_rslora; peft_type LORA,
// bias none, no modules_to_save) and the safetensors hold exactly the layout's PEFT tensors
// (fp32), else ConfigError naming the key or the tensor.
void read_peft_adapter(const std::string& dir, const LoraConfig& lora, const ModelConfig& model,
                       const LoraLayout& layout, float* params);
// Writes them as PEFT saves an adapter (fp32 tensors), atomically per file.
void write_peft_adapter(const std::string& dir, const LoraConfig& lora, const ModelConfig& model,
                        const LoraLayout& layout, const float* params);

}  // namespace fuyou
