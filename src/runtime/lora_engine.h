// The train engine of a run with a lora section (docs/lora.md): LoraStep behind TrainEngine,
// so that fuyou-train's run directory (steps, metrics, validation, checkpoints, resume, final
// weights) works as for a full fine-tune. Its state is the adapters' (LoraLayout::params,
// checkpoint_layout): master and moments per adapter group; its final weights file holds the
// adapters under their engine names, which `fuyou-convert to-hf` writes as a PEFT directory.
#pragma once

#include <memory>

#include "fuyou/backend.h"
#include "fuyou/config.h"
#include "fuyou/engine.h"

namespace fuyou {

std::unique_ptr<TrainEngine> make_lora_engine(const Config& cfg, Backend& backend);

}  // namespace fuyou
